"""The experiment core under ``simulate sweep`` (a grid of points) and ``simulate plan`` (an
adaptive search over points).

- :mod:`.points`: a point (arm or candidate, rate, seed), its content hash and folder names;
- :mod:`.store`: the ``vllm bench sweep`` folder layout, atomic writes, resume by hash,
  summaries;
- :mod:`.executors`: inline / local processes / Ray behind ``submit`` + ``as_completed``,
  with clean worker shutdown on Ctrl-C or when the driver is killed;
- :mod:`.runner`: :class:`ExperimentRun`, which ties them together with a progress bar and
  turns Ctrl-C into :class:`Interrupted` (how many points are kept, for ``--resume``).
"""

from servesim.simulator.experiments.executors import BACKENDS, Outcome, open_executor
from servesim.simulator.experiments.points import Point, content_hash, fmt_rate, one_line
from servesim.simulator.experiments.runner import ExperimentRun, Interrupted
from servesim.simulator.experiments.store import PointStore, atomic_write_text, write_json

__all__ = ["BACKENDS", "ExperimentRun", "Interrupted", "Outcome", "Point", "PointStore",
           "atomic_write_text", "content_hash", "fmt_rate", "one_line", "open_executor",
           "write_json"]
