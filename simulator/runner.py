"""Run one experiment end to end: config → memory plan → workload → SimPy → RunResult."""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from array import array
from collections.abc import Callable

import numpy as np
import simpy
from servesim.simulator.client import Client
from servesim.simulator.config import ExperimentConfig, resolve_config
from servesim.simulator.engine import Replica
from servesim.simulator.errors import ConfigError
from servesim.simulator.frontend import Frontend, resolve_frontend
from servesim.simulator.metrics import (
    CHUNKS_COLUMN,
    STEP_COLUMNS,
    LazyRequests,
    RequestLog,
    RunResult,
    derive_request_columns,
)
from servesim.simulator.progress import phase
from servesim.simulator.recorder import Recorder
from servesim.simulator.registry import get_kv_allocator, get_scheduler
from servesim.simulator.scheduler import SchedulerParams

# Beyond this many steps timeseries.csv is sampled every second instead of every step.
MAX_STEP_ROWS = 200_000
# A single FCFS engine keeps PARK_AFTER_SEQS × max_num_seqs (+64) requests in its waiting
# queue; later arrivals wait in the client's compact Parked queue (29 bytes each, + 26 of
# API-server timestamps in ``frontend.Held``, instead of ≈ 1 KB of objects: a burst of millions
# in bounded memory). Parking changes no decision (the
# engine looks at the queue's head only) but rebuilds each request as it moves in (~8% of a
# 20k-request burst), and a long queue of objects costs more than that in collector and cache
# time in a long run (measured at 1M requests): a workload of at most PARK_AFTER requests
# never parks, a larger one parks early.
PARK_AFTER = 65_536
PARK_AFTER_SEQS = 2
# Young-generation threshold of the cyclic GC while simulating (CPython's default is 700).
GC_THRESHOLD = 50_000


def run_experiment(cfg: ExperimentConfig, *, resolved: bool = False,
                   progress: Callable[[int, int | None], None] | None = None,
                   fast_path: bool = True, spool_dir: str | None = None,
                   cost_model=None,
                   request_sink: Callable[[tuple], None] | None = None) -> RunResult:
    """Simulate ``cfg`` and return what the run measured.

    ``progress(num_done, num_total)`` is called as requests end (``num_total`` may be None).
    Raises ``ConfigError`` / ``CapacityError`` (one-line, user-facing) before simulating when
    the config cannot run, as vLLM would fail at start-up. Runs of more than
    ``metrics.EXACT_REQUESTS`` requests spill per-request rows to ``spool_dir`` (default: a
    temporary folder); ``RunResult.close()`` removes them. ``cost_model``: a prebuilt
    ``StepCostModel`` for ``cfg`` (``simulate fit`` reuses one while varying its host terms).
    ``request_sink`` also receives the raw request rows as requests end (``Recorder.sink``;
    streamed requests.csv).
    """
    from servesim.costmodels import build_cost_model, plan_memory
    from servesim.costmodels.power import sustained_clock
    from servesim.workloads import build_workload

    t0 = time.perf_counter()
    if not resolved:
        cfg = resolve_config(cfg)
    if cfg.speculative_config is not None:
        from servesim.simulator.spec_decode import check_acceptance_column

        check_acceptance_column(cfg)  # (a misspelt column would run every request at rate)
    if cfg.cluster is not None or cfg.cache.kv_offload is not None:
        from servesim.simulator.cluster.runner import run_cluster

        return run_cluster(cfg, progress=progress, fast_path=fast_path, spool_dir=spool_dir)
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
    cost = cost_model if cost_model is not None else build_cost_model(cfg)
    # speculative decoding / multi-LoRA (simulator/spec_decode.py, lora.py): the exact loop
    spec_cfg, lora_cfg = cfg.speculative_config, cfg.lora
    seed = int(getattr(cfg.workload, "seed", 0) or 0)
    lora_load = None
    if lora_cfg.enable_lora:
        from servesim.costmodels.lora import load_seconds
        from servesim.simulator.lora import AdapterAssignment

        workload = AdapterAssignment(workload, lora_cfg, seed)
        lora_load = load_seconds(cfg, cost.spec, cost.hw, cost.host.launch_s)
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
    spec_totals, lora_states = _step_columns(rec, spec_cfg, lora_cfg,
                                             cfg.scheduler.stream_interval > 1)
    rec.sink = request_sink
    replicas: list[Replica] = []
    clocks: list = []  # per engine: costmodels.power.SustainedClock or None
    client_box: list[Client] = []
    fe_params, n_api, fe_prov = resolve_frontend(cfg, cost.calibration)
    frontend = None
    if fe_params is not None:  # API servers between client and engines (frontend.py)
        frontend = Frontend(env, fe_params, n_api,
                            lambda *a: client_box[0].arrive_tokenized(*a),
                            lambda r: client_box[0].on_finish(r), rec,
                            cfg.scheduler.stream_interval)
        rec.on_step = frontend.on_step
        on_finish = frontend.on_engine_finish
    else:
        def on_finish(req):
            client_box[0].on_finish(req)

    window = cost.spec.sliding_window
    window = window if window and window < mml else None  # a window ≥ max_model_len is moot
    save_itls = bool(cfg.output.save_detailed)  # vllm bench --save-detailed: itls per request
    if save_itls:
        rec.request_itls = {}
        if frontend is not None:
            frontend.itl_hook = _append_itl
    for i in range(cfg.parallel.data_parallel_size):
        kv = kv_factory(num_gpu_blocks, block_size, cfg.cache.enable_prefix_caching, mml)
        if window and hasattr(kv, "set_sliding_window"):
            kv.set_sliding_window(window, cfg.scheduler.max_num_batched_tokens)
        try:  # several batches in flight break the decode group's every-step invariant, and
            # a sliding window frees blocks on the decode path (exact loop); so do spec decode
            # (1 + k tokens per decode row), LoRA (max_loras per step), a stream interval
            # (the API server's chunks follow each request's token count) and per-request
            # ITLs (save_detailed: every gap explicit)
            fast_ok = (fast_path and batches == 1 and not window and spec_cfg is None
                       and not lora_cfg.enable_lora and cfg.scheduler.stream_interval == 1
                       and not save_itls)
            sched = sched_factory(params, kv, fast_path=fast_ok)
        except TypeError:  # third-party policies need not know about the fast path
            sched = sched_factory(params, kv)
            if not fast_ok and getattr(sched, "fast_path", False):
                sched.fast_path = False  # (as enable_spec_decode / enable_lora turn it off)
        if (spec_cfg is not None or lora_cfg.enable_lora) and not _runs_vllm_loop(sched):
            raise ConfigError(
                f"scheduler.policy: {cfg.scheduler.policy} runs its own scheduling loop; "
                "speculative_config and lora are modelled on vLLM's (fcfs, priority, or a "
                "policy that keeps Scheduler.schedule and its waiting queue)")
        if save_itls and frontend is None:
            sched.itl_hook = _append_itl
        if spec_cfg is not None:
            from servesim.simulator.spec_decode import SpecDecoding

            sched.enable_spec_decode(SpecDecoding(spec_cfg, np.random.default_rng(
                [seed, i, 0x5BEC])))
        if lora_cfg.enable_lora:
            from servesim.simulator.lora import LoRAScheduling

            sched.enable_lora(LoRAScheduling(lora_cfg, lora_load))
            lora_states.append(sched.lora)
        clock = sustained_clock(cost, lambda: env._now)  # (None: burst times)
        clocks.append(clock)
        replicas.append(Replica(env, sched, clock.step_seconds if clock else cost.step_seconds,
                                rec, on_finish, i, max_concurrent_batches=batches,
                                async_scheduling=async_sched,
                                decode_seconds=clock.decode_seconds if clock
                                else cost.decode_step_seconds,
                                undo_step=clock.undo if clock else None))

    if len(replicas) > 1:  # (the engines' gauges and counters summed in each step row)
        rec.engine_rows = [(0, 0, 0.0, 0, 0, 0)] * len(replicas)
    meta = workload.meta
    control = _client_control(cfg, meta)
    if request_sink is not None:  # (the columns requests.csv gets)
        request_sink(("meta", {"client_columns": control is not None}))
    park_after = _park_after(cfg, workload.meta.get("num_prompts"))
    if control is not None and (control["request_timeout_s"] is not None or any(
            st.get("grace_s") is not None for st in control["stages"] or ())):
        park_after = None  # aborts take requests out of the engine's queues, not the park's
    max_concurrency = meta.get("client_max_concurrency", cfg.workload.max_concurrency)
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
                        max_concurrency=max_concurrency, on_progress=cb,
                        park_after=park_after, control=control, frontend=frontend,
                        api_servers=cfg.frontend.api_server_count
                        or cfg.parallel.data_parallel_size,
                        dp_engine_stats=cost.spec.is_moe)
        client_box.append(client)
        if frontend is not None:
            # the client acts on a finish (a free concurrency slot, a stage barrier, a
            # timeout watch) only when it sees it: after the step's output work
            frontend.defer_finish = max_concurrency is not None or control is not None
            frontend.admit, frontend.client_finish = client.arrive_tokenized, client.on_finish
            frontend.next_send = lambda: client.next_send
        with _quiet_gc():
            env.run()
        client.finalize()
    wall = time.perf_counter() - t0

    rec.flush()
    log = rec.log
    client_cols = control is not None
    requests = (LazyRequests(log, client_cols) if log.spilled
                else derive_request_columns(log.all_rows(), client_cols))
    if rec.itl.exact:
        itl_values, itl_counts = rec.itl.exact_sample()
        itl_stream = None
    else:
        itl_values, itl_counts, itl_stream = np.zeros(0), np.zeros(0, np.int64), rec.itl
    steps = rec.steps.columns()
    token_steps = rec.steps.token_steps()
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
    if any(clocks):  # the power cap's slowdown charged to compute-bound work (costmodels.power)
        counters["power_cap_seconds"] = sum(c.extra_seconds for c in clocks if c)
    if spec_totals is not None:
        counters.update(spec_totals.counters())
    if lora_states:
        for st in lora_states:
            for k, v in st.counters().items():
                counters[k] = counters.get(k, 0) + v if k != "lora_max_active_adapters" \
                    else max(counters.get(k, 0), v)
        counters["lora_adapters_seen"] = len(set().union(*(st.adapters_seen
                                                           for st in lora_states)))
    fe_info: dict = {"enable": frontend is not None}
    if frontend is not None:
        counters["api_server_busy_seconds"] = sum(frontend.busy_seconds)
        counters["tokenizer_batches"] = frontend.num_batches
        fe_info.update(api_server_count=n_api, params=fe_params.as_dict(), provenance=fe_prov)
        if frontend.stream_interval > 1:
            fe_info["stream_interval"] = frontend.stream_interval
    meta = {k: v for k, v in workload.meta.items() if not k.startswith("_")}
    if client.control is not None:
        meta["stage_windows"] = client.control.stage_windows
        if control["request_timeout_s"] is not None:
            meta["request_timeout_s"] = control["request_timeout_s"]
            meta["max_retries"] = control["max_retries"]
    return RunResult(config=cfg, requests=requests, itl_values=itl_values,
                     itl_counts=itl_counts, steps=steps, token_steps=token_steps,
                     counters=counters,
                     workload_meta=meta, capacity=mem.as_dict(),
                     request_log=log if log.spilled else None, itl_stream=itl_stream,
                     client_columns=client_cols,
                     stage_itl=dict(rec.stage_itl) if rec.stage_itl else None,
                     engine_itl=rec.engine_itl if frontend is not None else None,
                     frontend=fe_info,
                     request_itls=None if rec.request_itls is None else
                     [rec.request_itls[i] for i in sorted(rec.request_itls)])


def _client_control(cfg: ExperimentConfig, meta: dict) -> dict | None:
    """The client's stages / warm-up / timeout settings (``simulator/client_control.py``), or
    None for a plain ``vllm bench serve`` client. ``client.*`` keys of the config win over
    what a profile workload sets."""
    prof = meta.get("client") or {}
    timeout = cfg.client.request_timeout_s
    if timeout is None:
        timeout = prof.get("request_timeout_s")
    retries = cfg.client.max_retries
    if retries is None:
        retries = prof.get("max_retries", 0)
    if not (meta.get("stages") or meta.get("warmup") or timeout is not None):
        return None
    return {"stages": meta.get("stages"), "warmup": meta.get("warmup"),
            "request_timeout_s": timeout, "max_retries": retries or 0, "meta": meta}


def _runs_vllm_loop(sched) -> bool:
    """Whether ``sched`` schedules with vLLM's loops (where the spec-decode and LoRA hooks
    are): a Scheduler that overrides none of them and keeps vLLM's waiting queue."""
    from servesim.simulator.request_queue import _FCFSQueue, _PriorityQueue
    from servesim.simulator.scheduler import Scheduler

    cls = type(sched)
    return (isinstance(sched, Scheduler) and type(sched.waiting) in (_FCFSQueue, _PriorityQueue)
            and all(getattr(cls, m) is getattr(Scheduler, m) for m in (
                "schedule", "_schedule_running_exact", "_schedule_waiting", "_clamp",
                "update_from_output", "_build_shape")))


def _step_columns(rec: Recorder, spec_cfg, lora_cfg, stream_chunks: bool = False):
    """Extra ``timeseries.csv`` columns: vLLM's ``vllm:spec_decode_*`` counters (and
    ``vllm:generation_tokens_total``) with speculative decoding; ``num_output_chunks`` (SSE
    chunks the step's tokens went out in: one per row that sampled, or what the API server
    sent under ``stream_interval`` > 1) where a chunk may hold several tokens; the LoRA gauge
    and load counters with LoRA. Returns (spec totals or None, list to collect LoRA states
    in)."""
    lora_states: list = []
    totals = None
    names: list[str] = []
    chunks = spec_cfg is not None or stream_chunks
    if spec_cfg is not None:
        from servesim.simulator.spec_decode import SpecDecodeTotals

        totals = SpecDecodeTotals(spec_cfg.num_speculative_tokens)
        names += totals.columns()
    if chunks:
        names.append(CHUNKS_COLUMN)
    if lora_cfg.enable_lora:
        names += ["lora_num_active_adapters", "lora_loads_from_cpu_total",
                  "lora_loads_from_disk_total"]
    if not names:
        return None, lora_states
    n_spec = len(totals.columns()) if totals is not None else 0
    cols: list = []

    def on_step(out) -> None:
        if totals is not None:
            totals.add(out.spec_decoding_stats)
            for col, v in zip(cols, totals.row()):
                col.append(v)
        if chunks:
            cols[n_spec].append(_output_chunks(out))
        if lora_states:
            lc = cols[n_spec + chunks:]
            lc[0].append(out.shape.num_loras)
            lc[1].append(sum(st.num_loads_cpu for st in lora_states))
            lc[2].append(sum(st.num_loads_disk for st in lora_states))

    cols.extend(rec.add_step_columns(names, on_step))
    return totals, lora_states


def _append_itl(req, gap: float) -> None:
    """``itl_hook``: one more client-side inter-token gap of ``req`` (save_detailed; 8 bytes
    a gap)."""
    if req.itls is None:
        req.itls = array("d", (gap,))
    else:
        req.itls.append(gap)


def _output_chunks(out) -> int:
    """SSE chunks a step's tokens went out in: what the API server sent (``stream_interval``
    > 1: ``Frontend`` sets ``num_chunks``), else one per row that sampled."""
    n = getattr(out, "num_chunks", None)
    if n is not None:
        return n
    if out.sampled is None:  # (a batch advanced at schedule time: one token a row)
        return out.num_new_tokens
    return len(out.sampled) + out.num_group


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


def _park_after(cfg: ExperimentConfig, num_requests: int | None) -> int | None:
    """How many waiting requests a single vLLM-FCFS engine holds before the client parks the
    rest compactly (``client.Parked``), for a workload of ``num_requests`` (None: unknown);
    None where parking could change a decision (other policies reorder or scan the whole
    queue; several replicas route by queue length; LoRA's waiting loop skips past requests
    whose adapter cannot join) or cannot happen (a workload of at most :data:`PARK_AFTER`
    requests never queues that many)."""
    s = cfg.scheduler
    if s.policy != "fcfs" or cfg.parallel.data_parallel_size != 1 or cfg.lora.enable_lora:
        return None
    if num_requests is not None and num_requests <= PARK_AFTER:
        return None  # its queue never holds PARK_AFTER: no park (nor its checks every step)
    return PARK_AFTER_SEQS * s.max_num_seqs + 64


class StepSampler:
    """Step rows → ``timeseries.csv`` rows, streaming. Every step is kept while there are at
    most :data:`MAX_STEP_ROWS` and ``interval`` is None; otherwise each interval keeps its
    last step (gauges: running, waiting, KV usage, counters) with the per-step columns
    (seconds, tokens, decodes, prefill tokens) summed over the interval, and ``time_s`` =
    the interval's end. The open interval is carried across chunks as one pre-summed row.

    Sampled rows cannot place a step's tokens in its own second (``max_output_tokens_per_s``
    buckets them by ``floor(t − t0)``, t0 known only at the end), so while sampling it also
    keeps the time and sampled tokens of every step that sampled one (12 bytes a step;
    ``keep_tokens``): :meth:`token_steps`."""

    SUMS = ("step_seconds", "step_tokens", "num_decode", "prefill_tokens", "generated",
            CHUNKS_COLUMN)

    def __init__(self, interval: float | None, keep_tokens: bool = True):
        self.interval = interval
        self.keep_tokens = keep_tokens
        self._raw: list[dict[str, np.ndarray]] = []
        self._num_raw = 0
        self._rows: list[dict[str, np.ndarray]] = []
        self._carry: dict[str, np.ndarray] | None = None
        self._tokens: list[tuple[np.ndarray, np.ndarray]] = []  # (time_s, generated) chunks

    def add(self, chunk: dict[str, np.ndarray]) -> None:
        if self.interval is None:
            self._raw.append(chunk)
            self._num_raw += len(chunk["time_s"])
            if self._num_raw <= MAX_STEP_ROWS:
                return
            self.interval = 1.0
            raw, self._raw = self._raw, []
            for c in raw:
                self._keep_tokens(c)
                self._sample(c)
            return
        self._keep_tokens(chunk)
        self._sample(chunk)

    def _keep_tokens(self, chunk: dict[str, np.ndarray]) -> None:
        if self.keep_tokens and "generated" in chunk:  # (steps that sampled a token)
            k = chunk.get(CHUNKS_COLUMN, chunk["generated"])  # (what vLLM's peak counts)
            some = k > 0
            self._tokens.append((chunk["time_s"][some], k[some].astype(np.float32)))

    def token_steps(self) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """(``time_s``, tokens) chunks of every step that sampled a token, when the step rows
        are sampled (None when :meth:`columns` holds every step); kept as chunks, since
        per-second buckets need no order (a 10M-request run has ~5.6M steps)."""
        if self.interval is None:
            return None
        return self._tokens

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
        # STEP, then extra columns (spec decode, LoRA)
        keys = list(self._raw[0] if self._raw else self._rows[0] if self._rows else
                    self._carry if self._carry is not None else Recorder.STEP)
        if self.interval is None:
            s = {k: np.concatenate([c[k] for c in self._raw]) if self._raw else np.zeros(0)
                 for k in keys}
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
                 for k in keys}
        names = dict(zip(Recorder.STEP, STEP_COLUMNS))
        return {names.get(k, k): v for k, v in s.items()}
