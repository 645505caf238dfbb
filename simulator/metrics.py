"""What one simulated run produces, in columnar form (the contract with ``reports/``).

Units: seconds and tokens. ``reports/`` turns a :class:`RunResult` into ``result.json``
(vLLM bench schema, milliseconds there), ``requests.csv`` and ``timeseries.csv``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# requests.csv columns, in order (finished_reason: stop | length | abort | rejected | in_flight)
REQUEST_COLUMNS = (
    "request_id",
    "arrival_s",
    "prompt_len",
    "output_len",
    "num_cached_tokens",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "ttft_s",
    "tpot_s",
    "e2el_s",
    "queue_s",
    "num_preemptions",
    "finished_reason",
)

# timeseries.csv columns (vLLM Prometheus names where one exists)
STEP_COLUMNS = (
    "time_s",  # simulated time at the end of the step
    "step_seconds",
    "step_tokens",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",  # 0..1, used / total blocks (null block excluded)
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "num_decode_reqs",
    "num_prefill_tokens",
)


@dataclass
class RunResult:
    """Everything a run measured.

    - ``requests``: column name → array, one entry per request of the workload (finished,
      rejected or still in flight at the end). ``send_s`` (when the client actually sent it:
      later than ``arrival_s`` under ``max_concurrency``) and ``error`` are extra columns.
      Latencies (``ttft_s``, ``e2el_s``, ``queue_s``) are measured from ``send_s`` like
      ``vllm bench serve``; NaN where undefined (rejected, or ``tpot_s`` with one output token).
    - ``itl_values`` / ``itl_counts``: the pooled inter-token latencies of all requests as a
      weighted sample (value, multiplicity); expand with ``np.repeat`` for exact percentiles.
    - ``steps``: column name (``STEP_COLUMNS``) → array, one entry per recorded sample.
    - ``counters``: totals (``num_preemptions``, ``prefix_cache_queries``, ``prefix_cache_hits``,
      ``num_steps``, ``num_gpu_blocks``, ``wall_seconds``, ...).
    - ``workload_meta``: the workload's bench traffic fields (``num_prompts``,
      ``request_rate``, ``burstiness``, ``max_concurrency``, ``dataset_name``).
    - ``capacity``: the memory plan as a dict (weights per GPU, KV bytes per token, ...).
    """

    config: Any  # resolved ExperimentConfig
    requests: dict[str, np.ndarray]
    itl_values: np.ndarray
    itl_counts: np.ndarray
    steps: dict[str, np.ndarray]
    counters: dict[str, float] = field(default_factory=dict)
    workload_meta: dict[str, Any] = field(default_factory=dict)
    capacity: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        """Benchmark duration like vllm bench: from the benchmark start (t = 0, before the
        first send) to the last completion, in seconds."""
        ends = self.requests["finish_s"]
        ends = ends[np.isfinite(ends)]
        return float(ends.max()) if len(ends) else 0.0
