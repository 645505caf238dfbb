"""Run one experiment end to end: config → memory plan → workload → SimPy → RunResult."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

import numpy as np
import simpy
from servesim.simulator.config import ExperimentConfig, resolve_config
from servesim.simulator.engine import Client, Recorder, Replica
from servesim.simulator.metrics import STEP_COLUMNS, RunResult
from servesim.simulator.registry import get_kv_allocator, get_scheduler
from servesim.simulator.scheduler import SchedulerParams

# Beyond this many steps timeseries.csv is sampled every second instead of every step.
MAX_STEP_ROWS = 200_000


def run_experiment(cfg: ExperimentConfig, *, resolved: bool = False,
                   progress: Callable[[int, int | None], None] | None = None,
                   fast_path: bool = True) -> RunResult:
    """Simulate ``cfg`` and return what the run measured.

    ``progress(num_done, num_total)`` is called as requests end (``num_total`` may be None).
    Raises ``ConfigError`` / ``CapacityError`` (one-line, user-facing) before simulating when
    the config cannot run, as vLLM would fail at start-up.
    """
    from servesim.costmodels import build_cost_model, plan_memory
    from servesim.workloads import build_workload

    t0 = time.perf_counter()
    if not resolved:
        cfg = resolve_config(cfg)
    pp = cfg.parallel.pipeline_parallel_size
    batches = pp  # vLLM: max_concurrent_batches = pipeline_parallel_size
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
    )

    env = simpy.Environment()
    rec = Recorder()
    replicas: list[Replica] = []
    client_box: list[Client] = []

    def on_finish(req):
        client_box[0].on_finish(req)

    for i in range(cfg.parallel.data_parallel_size):
        kv = kv_factory(num_gpu_blocks, block_size, cfg.cache.enable_prefix_caching, mml)
        try:  # several batches in flight break the decode group's every-step invariant
            sched = sched_factory(params, kv, fast_path=fast_path and batches == 1)
        except TypeError:  # third-party policies need not know about the fast path
            sched = sched_factory(params, kv)
        replicas.append(Replica(env, sched, cost.step_seconds, rec, on_finish, i,
                                max_concurrent_batches=batches))

    total = workload.meta.get("num_prompts")
    cb = (lambda n: progress(n, total)) if progress is not None else None
    client = Client(env, workload, replicas, rec, max_model_len=mml,
                    num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                    max_concurrency=cfg.workload.max_concurrency, on_progress=cb)
    client_box.append(client)
    env.run()
    client.finalize()
    wall = time.perf_counter() - t0

    requests = _request_columns(rec)
    itl_values = np.concatenate([np.asarray(rec.itl_explicit, dtype=float),
                                 np.asarray([v for v, _ in rec.itl_weighted], dtype=float)])
    itl_counts = np.concatenate([np.ones(len(rec.itl_explicit), dtype=np.int64),
                                 np.asarray([c for _, c in rec.itl_weighted], dtype=np.int64)])
    steps = _step_columns(rec, cfg.output.timeseries_interval_s)
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
                     workload_meta=meta, capacity=mem.as_dict())


def _request_columns(rec: Recorder) -> dict[str, np.ndarray]:
    d = {k: np.frombuffer(v, dtype=float).copy() if len(v) else np.zeros(0)
         for k, v in rec.req.items()}
    order = np.argsort(d["index"], kind="stable")
    d = {k: v[order] for k, v in d.items()}
    ids = np.asarray(rec.request_id, dtype=object)[order]
    reason = np.asarray(rec.reason, dtype=object)[order]
    error = np.asarray(rec.error, dtype=object)[order]
    send = d["send_s"]
    ttft = d["first_token_s"] - send
    e2el = d["finish_s"] - send
    out = d["output_len"]
    ok = np.isin(reason, ("stop", "length"))
    ttft = np.where(ok, ttft, np.nan)
    e2el = np.where(ok, e2el, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(ok & (out > 1), (e2el - ttft) / np.maximum(out - 1, 1), np.nan)
    return {
        "request_id": ids,
        "arrival_s": d["arrival_s"],
        "prompt_len": d["prompt_len"].astype(np.int64),
        "output_len": out.astype(np.int64),
        "num_cached_tokens": d["num_cached_tokens"].astype(np.int64),
        "first_scheduled_s": d["first_scheduled_s"],
        "first_token_s": d["first_token_s"],
        "finish_s": np.where(ok, d["finish_s"], np.nan),
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2el_s": e2el,
        "queue_s": d["first_scheduled_s"] - send,
        "num_preemptions": d["num_preemptions"].astype(np.int64),
        "finished_reason": reason,
        "send_s": send,
        "error": error,
    }


def _step_columns(rec: Recorder, interval: float | None) -> dict[str, np.ndarray]:
    s = {k: np.frombuffer(v, dtype=float).copy() if len(v) else np.zeros(0)
         for k, v in rec.step.items()}
    n = len(s["time_s"])
    if n > 1:  # several replicas interleave: order by time
        order = np.argsort(s["time_s"], kind="stable")
        s = {k: v[order] for k, v in s.items()}
    if interval is None and n > MAX_STEP_ROWS:
        interval = 1.0
    if interval is not None and n:
        # Sample: the last step ending in each interval (gauges), sums for tokens/seconds.
        bucket = np.floor(s["time_s"] / interval).astype(np.int64)
        last = np.r_[np.nonzero(np.diff(bucket))[0], n - 1]
        sums = {k: np.add.reduceat(s[k], np.r_[0, last[:-1] + 1])
                for k in ("step_seconds", "step_tokens", "num_decode", "prefill_tokens")}
        s = {k: (sums[k] if k in sums else v[last]) for k, v in s.items()}
        s["time_s"] = (bucket[last] + 1) * interval
    names = dict(zip(Recorder.STEP, STEP_COLUMNS))
    return {names[k]: v for k, v in s.items()}
