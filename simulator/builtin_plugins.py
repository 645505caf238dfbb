"""Registers the built-in policies: vLLM's ``fcfs`` and ``priority`` schedulers and the
``paged`` KV allocator (vLLM's block pool; prefix caching per ``cache.enable_prefix_caching``).
Extra policies (``simulator/policies/``) register themselves when that package is imported."""

import importlib
import importlib.util
from dataclasses import replace

from servesim.simulator.kv_cache import KVCacheManager
from servesim.simulator.registry import register_kv_allocator, register_scheduler
from servesim.simulator.scheduler import Scheduler


@register_scheduler("fcfs")
def _fcfs(params, kv_cache_manager, **kw):
    return Scheduler(replace(params, policy="fcfs"), kv_cache_manager, **kw)


@register_scheduler("priority")
def _priority(params, kv_cache_manager, **kw):
    return Scheduler(replace(params, policy="priority"), kv_cache_manager, **kw)


register_kv_allocator("paged", KVCacheManager)

if importlib.util.find_spec("servesim.simulator.policies") is not None:
    importlib.import_module("servesim.simulator.policies")  # extra policies register themselves
