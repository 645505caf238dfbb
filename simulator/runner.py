"""Run one experiment end to end: config → memory plan → workload → SimPy → RunResult."""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from collections.abc import Callable

import numpy as np
import simpy
from servesim.simulator.config import ExperimentConfig, resolve_config
from servesim.simulator.engine import Client, Recorder, Replica
from servesim.simulator.metrics import (
    STEP_COLUMNS,
    LazyRequests,
    RequestLog,
    RunResult,
    derive_request_columns,
)
from servesim.simulator.progress import phase
from servesim.simulator.registry import get_kv_allocator, get_scheduler
from servesim.simulator.scheduler import SchedulerParams

# Beyond this many steps timeseries.csv is sampled every second instead of every step.
MAX_STEP_ROWS = 200_000
# A single FCFS engine keeps PARK_AFTER_SEQS × max_num_seqs (+64) requests in its waiting
# queue; later arrivals wait in the client's compact Parked queue (bounded memory).
PARK_AFTER_SEQS = 2
# Young-generation threshold of the cyclic GC while simulating (CPython's default is 700).
GC_THRESHOLD = 50_000


def run_experiment(cfg: ExperimentConfig, *, resolved: bool = False,
                   progress: Callable[[int, int | None], None] | None = None,
                   fast_path: bool = True, spool_dir: str | None = None,
                   request_sink: Callable[[dict], None] | None = None) -> RunResult:
    """Simulate ``cfg`` and return what the run measured.

    ``progress(num_done, num_total)`` is called as requests end (``num_total`` may be None).
    Raises ``ConfigError`` / ``CapacityError`` (one-line, user-facing) before simulating when
    the config cannot run, as vLLM would fail at start-up. Runs of more than
    ``metrics.EXACT_REQUESTS`` requests spill per-request rows to ``spool_dir`` (default: a
    temporary folder); ``RunResult.close()`` removes them. ``request_sink`` also receives
    the raw request rows as requests end (``Recorder.sink``; streamed requests.csv).
    """
    from servesim.costmodels import build_cost_model, plan_memory
    from servesim.workloads import build_workload

    t0 = time.perf_counter()
    if not resolved:
        cfg = resolve_config(cfg)
    pp = cfg.parallel.pipeline_parallel_size
    async_sched = bool(cfg.scheduler.async_scheduling)
    # vLLM executors: max_concurrent_batches = pp (pp > 1); with pp == 1 async scheduling
    # keeps two batches in flight (Replica._run_async).
    batches = pp
    if pp > 1 and cfg.scheduler.policy not in ("fcfs", "priority"):
        batches = 1
        warnings.warn(
            f"pipeline_parallel_size={pp} with scheduler.policy={cfg.scheduler.policy}: only "
            "vLLM's fcfs/priority keep several batches in flight here; this policy runs one "
            "batch at a time through all stages, so throughput is under-estimated",
            stacklevel=2)
    # Cheap checks first, so a typo fails before any warning about calibration.
    sched_factory = get_scheduler(cfg.scheduler.policy)
    kv_factory = get_kv_allocator(cfg.cache.allocator)
    block_size = cfg.cache.block_size
    mml = cfg.model.max_model_len
    workload = build_workload(cfg.workload, block_size=block_size, max_model_len=mml)
    mem = plan_memory(cfg)
    num_gpu_blocks = mem.num_gpu_blocks
    cost = build_cost_model(cfg)
    params = SchedulerParams(
        max_num_seqs=cfg.scheduler.max_num_seqs,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        max_model_len=mml,
        block_size=block_size,
        long_prefill_token_threshold=cfg.scheduler.long_prefill_token_threshold,
        enable_chunked_prefill=cfg.scheduler.enable_chunked_prefill,
        policy=cfg.scheduler.policy,
        reserve_full_isl=cfg.scheduler.reserve_full_isl,
        async_scheduling=async_sched,
    )

    env = simpy.Environment()
    rec = Recorder(log=RequestLog(spool_dir), steps=StepSampler(cfg.output.timeseries_interval_s))
    rec.sink = request_sink
    replicas: list[Replica] = []
    client_box: list[Client] = []

    def on_finish(req):
        client_box[0].on_finish(req)

    window = cost.spec.sliding_window
    window = window if window and window < mml else None  # a window ≥ max_model_len is moot
    for i in range(cfg.parallel.data_parallel_size):
        kv = kv_factory(num_gpu_blocks, block_size, cfg.cache.enable_prefix_caching, mml)
        if window and hasattr(kv, "set_sliding_window"):
            kv.set_sliding_window(window, cfg.scheduler.max_num_batched_tokens)
        try:  # several batches in flight break the decode group's every-step invariant, and
            # a sliding window frees blocks on the decode path (exact loop)
            sched = sched_factory(params, kv, fast_path=fast_path and batches == 1
                                  and not window)
        except TypeError:  # third-party policies need not know about the fast path
            sched = sched_factory(params, kv)
        replicas.append(Replica(env, sched, cost.step_seconds, rec, on_finish, i,
                                max_concurrent_batches=batches, async_scheduling=async_sched,
                                decode_seconds=cost.decode_step_seconds))

    total = workload.meta.get("num_prompts")
    with phase("simulating", total) as tick:
        if progress is None:
            cb = tick
        else:
            def cb(n: int) -> None:
                tick(n)
                progress(n, total)
        client = Client(env, workload, replicas, rec, max_model_len=mml,
                        num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                        max_request_blocks=mem.blocks_per_request,
                        max_concurrency=cfg.workload.max_concurrency, on_progress=cb,
                        park_after=_park_after(cfg))
        client_box.append(client)
        with _quiet_gc():
            env.run()
        client.finalize()
    wall = time.perf_counter() - t0

    rec.flush()
    log = rec.log
    requests = LazyRequests(log) if log.spilled else derive_request_columns(log.all_rows())
    if rec.itl.exact:
        itl_values, itl_counts = rec.itl.exact_sample()
        itl_stream = None
    else:
        itl_values, itl_counts, itl_stream = np.zeros(0), np.zeros(0, np.int64), rec.itl
    steps = rec.steps.columns()
    sched0 = [r.scheduler for r in replicas]
    kvs = [r.kv for r in replicas]
    queries = sum(k.prefix_cache_stats.queries for k in kvs)
    hits = sum(k.prefix_cache_stats.hits for k in kvs)
    sim_seconds = float(env.now)
    counters = {
        "num_steps": sum(r.num_steps for r in replicas),
        "num_preemptions": sum(s.num_preemptions for s in sched0),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_preempted_queries": sum(k.prefix_cache_stats.preempted_queries for k in kvs),
        "prefix_cache_preempted_hits": sum(k.prefix_cache_stats.preempted_hits for k in kvs),
        "num_evictions": sum(k.block_pool.num_evictions for k in kvs),
        "num_gpu_blocks": num_gpu_blocks,
        "num_replicas": len(replicas),
        "sim_seconds": sim_seconds,
        "gpu_busy_seconds": sum(r.busy_seconds for r in replicas),
        "wall_seconds": wall,
    }
    meta = dict(workload.meta)
    return RunResult(config=cfg, requests=requests, itl_values=itl_values,
                     itl_counts=itl_counts, steps=steps, counters=counters,
                     workload_meta=meta, capacity=mem.as_dict(),
                     request_log=log if log.spilled else None, itl_stream=itl_stream)


@contextlib.contextmanager
def _quiet_gc():
    """The event loop allocates mostly acyclic, short-lived objects (freed by reference
    counting): move what exists now out of the collector's way (``gc.freeze``) and collect
    young objects less often, restoring both afterwards. Measured: ~25% of a saturated run
    was spent in the cyclic collector traversing long-lived setup objects."""
    old = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(old[0], GC_THRESHOLD), old[1], old[2])
    try:
        yield
    finally:
        gc.set_threshold(*old)
        gc.unfreeze()


def _park_after(cfg: ExperimentConfig) -> int | None:
    """How many waiting requests a single vLLM-FCFS engine holds before the client parks the
    rest compactly (``engine.Parked``); None where parking could change a decision (other
    policies reorder or scan the whole queue; several replicas route by queue length)."""
    s = cfg.scheduler
    if s.policy != "fcfs" or cfg.parallel.data_parallel_size != 1:
        return None
    return PARK_AFTER_SEQS * s.max_num_seqs + 64


class StepSampler:
    """Step rows → ``timeseries.csv`` rows, streaming. Every step is kept while there are at
    most :data:`MAX_STEP_ROWS` and ``interval`` is None; otherwise each interval keeps its
    last step (gauges: running, waiting, KV usage, counters) with the per-step columns
    (seconds, tokens, decodes, prefill tokens) summed over the interval, and ``time_s`` =
    the interval's end. The open interval is carried across chunks as one pre-summed row."""

    SUMS = ("step_seconds", "step_tokens", "num_decode", "prefill_tokens")

    def __init__(self, interval: float | None):
        self.interval = interval
        self._raw: list[dict[str, np.ndarray]] = []
        self._num_raw = 0
        self._rows: list[dict[str, np.ndarray]] = []
        self._carry: dict[str, np.ndarray] | None = None

    def add(self, chunk: dict[str, np.ndarray]) -> None:
        if self.interval is None:
            self._raw.append(chunk)
            self._num_raw += len(chunk["time_s"])
            if self._num_raw <= MAX_STEP_ROWS:
                return
            self.interval = 1.0
            raw, self._raw = self._raw, []
            for c in raw:
                self._sample(c)
            return
        self._sample(chunk)

    def _sample(self, s: dict[str, np.ndarray]) -> None:
        if self._carry is not None:
            s = {k: np.concatenate([self._carry[k], v]) for k, v in s.items()}
        n = len(s["time_s"])
        if not n:
            return
        bucket = np.floor(s["time_s"] / self.interval).astype(np.int64)
        last = np.r_[np.nonzero(np.diff(bucket))[0], n - 1]
        starts = np.r_[0, last[:-1] + 1]
        rows = {k: (np.add.reduceat(v, starts) if k in self.SUMS else v[last])
                for k, v in s.items()}
        self._carry = {k: v[-1:] for k, v in rows.items()}
        self._carry["time_s"] = s["time_s"][-1:]  # raw time: the same interval next chunk
        rows["time_s"] = (bucket[last] + 1) * self.interval
        self._rows.append({k: v[:-1] for k, v in rows.items()})

    def columns(self) -> dict[str, np.ndarray]:
        """The ``RunResult.steps`` dict (``STEP_COLUMNS`` names)."""
        if self.interval is None:
            s = {k: np.concatenate([c[k] for c in self._raw]) if self._raw else np.zeros(0)
                 for k in Recorder.STEP}
            if len(s["time_s"]) > 1:  # several replicas interleave: order by time
                order = np.argsort(s["time_s"], kind="stable")
                s = {k: v[order] for k, v in s.items()}
        else:
            rows = list(self._rows)
            if self._carry is not None:
                last = dict(self._carry)
                last["time_s"] = (np.floor(last["time_s"] / self.interval) + 1) * self.interval
                rows.append(last)
            s = {k: np.concatenate([r[k] for r in rows]) if rows else np.zeros(0)
                 for k in Recorder.STEP}
        names = dict(zip(Recorder.STEP, STEP_COLUMNS))
        return {names[k]: v for k, v in s.items()}
