"""Extra scheduler policies and KV allocators, registered by name on import.

Schedulers: ``sarathi`` (Sarathi-Serve stall-free batching), ``orca`` (iteration-level,
whole-prompt prefills), ``static`` (request-level batching), ``spf`` (shortest prompt first
with aging). KV allocators (``simulator/allocators.py``): ``paged_no_prefix``, ``contiguous``,
``paged_lfu``. ``builtin_plugins`` imports this package, so the names are always available.
"""

from servesim.simulator import allocators  # noqa: F401  (registers the KV allocators)
from servesim.simulator.policies.orca import OrcaScheduler
from servesim.simulator.policies.sarathi import SarathiScheduler
from servesim.simulator.policies.spf import SPFScheduler
from servesim.simulator.policies.static import StaticBatchScheduler
from servesim.simulator.registry import register_scheduler

POLICIES = {
    "sarathi": SarathiScheduler,
    "orca": OrcaScheduler,
    "static": StaticBatchScheduler,
    "spf": SPFScheduler,
}
for _name, _cls in POLICIES.items():
    register_scheduler(_name, _cls)

__all__ = ["POLICIES", "OrcaScheduler", "SPFScheduler", "SarathiScheduler",
           "StaticBatchScheduler"]
