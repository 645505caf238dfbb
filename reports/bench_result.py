"""``result.json``: a :class:`RunResult` as ``vllm bench serve --save-result`` would write it.

Key set, order and units follow vLLM's ``vllm/benchmarks/serve.py`` (reference:
``ecosystem-formats.md`` §2.2–2.3); metric definitions follow its ``calculate_metrics``:

- completed = requests with ``finished_reason`` stop/length; failed = every other request
  (rejected, aborted, still in flight at the end), so ``completed + failed == num_prompts``.
- TTFT = first token − send; E2EL = finish − send (both from ``send_s`` like the bench client).
- TPOT = (E2EL − TTFT) / (output_len − 1), only for output_len > 1 (0 for goodput otherwise).
- ITL = the pooled inter-token gaps of the run (``itl_values`` × ``itl_counts``), pooled per
  step, not per request: unlike vLLM's (successful requests only) they include the gaps of
  requests that failed later (client timeouts) and of warm-up requests (stages with
  ``warmup: true`` are left out: their gaps are pooled per stage). With ``save_detailed``
  each request's gaps are recorded (``request_itls``), and ITL and ``max_output_tokens_per_s``
  are vLLM's exactly: the successful requests' gaps, and their chunk times.
- mean / median / std (population) / ``np.percentile`` (linear) in **ms**; empty → 0 like
  vLLM's ``np.mean(x or 0)``.
- goodput = requests meeting every configured SLO (``metric <= slo``) / duration.
- throughputs over ``RunResult.duration_s`` (until the last request ended, completed or
  failed, as vLLM's ``asyncio.gather``); token totals count completed requests only.

Values chosen where vLLM's come from the client's command line (a vLLM user reading a
servesim file sees what the default ``vllm bench serve`` writes):

- ``endpoint_type`` = ``backend`` = ``"openai"`` (vLLM's default ``--backend``; vLLM writes
  ``endpoint_type = args.backend`` for backward compatibility).
- ``model_id`` = ``tokenizer_id`` = ``cfg.model.name`` (vLLM's tokenizer defaults to the model).
- ``request_rate`` / ``burstiness``: float, or the string ``"inf"`` (vLLM's spelling for the rate;
  the same for burstiness so the file stays valid JSON).
- ``label`` = ``cfg.output.label`` (null when unset, like vLLM without ``--label``).
- ``date``: UTC (vLLM uses local time) so files do not depend on the host's timezone.
- ``queue_times`` (per request, s): the client-side wait before sending
  (``send_s − arrival_s``; non-zero only under ``max_concurrency``); the server-side queue time
  is ``queue_s`` in ``requests.csv``.
- ``max_output_tokens_per_s``: vLLM buckets the successful requests' chunk timestamps
  (``start + ttft + cumsum(itl)``: one per SSE chunk) by 1 s; 0.0 without a successful
  request. servesim has no per-request token timestamps, so tokens are counted per engine
  step at the step's end time
  (``num_generated_tokens``: the tokens the step sampled, first tokens and a recompute's
  first token after a preemption included; timeseries of older runs: the differences of
  ``vllm:generation_tokens_total`` when present, else ``num_decode_reqs`` per step plus one
  first token per completed request at ``first_token_s``) and bucketed by ``floor(t − t0)``
  with ``t0`` the first send of a completed request (from every step, also when the
  timeseries rows are sampled: ``RunResult.token_steps``). Exact for runs without failed
  requests and without a frontend; a failed request's tokens are counted too, and with a
  frontend the client sees a step's tokens ``ipc_s`` + the output work later, so a step
  ending that close before a second boundary is counted one bucket early. Where a chunk may
  hold several tokens (speculative decoding, ``stream_interval`` > 1) the steps' chunks are
  counted instead (``num_output_chunks``), as vLLM counts them.
- ``max_concurrent_requests``: vLLM's per-second count: each completed request counts in every
  1-s bucket (since the first send) from its send to its finish, both included; the peak
  bucket (so it can exceed ``max_concurrency`` when a slot changes hands within a second).
- Detailed arrays (``save_detailed``): seconds; ``latencies`` are 0.0 for failed requests and
  ``ttfts`` for requests that failed before their first token (vLLM's defaults), ``generated_texts`` are ``""`` (no text is simulated), ``itls``
  per request are the client-side gaps the run recorded for each request
  (``result.request_itls``: single-engine runs record them with ``save_detailed``, which takes
  the exact per-request loop), else ``null`` (runs on the cluster engine: ``cluster:`` or
  ``cache.kv_offload``).

Speculative decoding: vLLM's ``spec_decode_*`` keys (:data:`SPEC_DECODE_KEYS`) after ``rtfx``
as ``vllm bench serve`` writes them from the server's counters (acceptance rate in %,
acceptance length = 1 + accepted / drafts), and extras ``speculative_method``,
``num_speculative_tokens``, ``spec_decode_mean_accepted_length`` (= the acceptance length:
tokens per verification step, bonus included) and ``spec_decode_mean_accepted_tokens``
(accepted drafts per step). LoRA extras: ``max_loras``, ``max_cpu_loras``, adapters seen, the
most adapters in one batch, GPU-slot hits and loads from CPU / disk.

The statistics are computed in ``bench_stats.py``; the per-request arrays, per-request lists and
the views of the measured / one stage's requests come from ``bench_requests.py``.

Extras after vLLM's keys: see :data:`EXTRA_KEYS`. ``wall_seconds`` and ``sim_speed`` are host
timings (:data:`VOLATILE_KEYS`); ``write_run`` keeps them out of ``result.json``.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Any

import numpy as np
from servesim.reports.bench_requests import (
    _ALWAYS,
    _DETAILED,
    PerRequest,
    _col,
    _floats,
    _View,
    _Window,
    measured_view,
)
from servesim.reports.bench_stats import (
    MILLISECONDS_PER_SECOND,
    _itl_stats,
    _max_concurrent,
    _max_output_tokens_per_s,
    _sketch_stats,
    _stats,
    percentile_word,
)
from servesim.simulator.metrics import (
    EXACT_SAMPLES,
    SKETCH_RELATIVE_ACCURACY,
    Distribution,
    RunResult,
)

# (attribute name, console name, console section header) in vLLM's fixed print/save order
METRIC_INFO = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
    ("client_queue_time", "Client Queue Time", "Client Queue Time"),
    ("e2el_including_client_queue", "E2EL incl. Client Queue", "E2EL incl. Client Queue"),
)
_CLIENT_QUEUE_METRICS = ("client_queue_time", "e2el_including_client_queue")


def _metric_keys(metric: str, percentiles: list[float]) -> list[str]:
    return [f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms"] + [
        f"p{percentile_word(p)}_{metric}_ms" for p in percentiles
    ]


# vLLM's keys for the default metric set (ttft,tpot,itl,e2el at p99), without --save-detailed,
# --metadata, ramp-up, --max-concurrency extras or speculative decoding — in written order.
VLLM_BENCH_KEYS: list[str] = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency",
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "latencies", "queue_times",
    "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
    *(k for m in ("ttft", "tpot", "itl", "e2el") for k in _metric_keys(m, [99.0])),
]  # fmt: skip
RAMP_UP_KEYS = ["ramp_up_strategy", "ramp_up_start_rps", "ramp_up_end_rps"]
# vLLM's speculative-decoding keys (written after rtfx when the server reports drafts)
SPEC_DECODE_KEYS = [
    "spec_decode_acceptance_rate", "spec_decode_acceptance_length", "spec_decode_num_drafts",
    "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
    "spec_decode_per_position_acceptance_rates",
]  # fmt: skip
DETAILED_KEYS = [
    "input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors",
]  # fmt: skip
# servesim's own keys, written after vLLM's
EXTRA_KEYS = [
    "simulated", "servesim_version", "config_hash", "seed", "dataset_name", "gpu", "num_gpus",
    # runs with stages / warm-up / timeouts: failures by reason, warm-up rows left out, stages
    "failed_reasons", "num_warmup_requests", "stages",
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "num_gpu_blocks",
    "num_preemptions", "prefix_cache_hit_rate", "prefix_cache_queries", "prefix_cache_hits",
    "num_steps", "frontend", "ttft_breakdown_ms", "engine_metrics",
    "wall_seconds", "sim_speed",
]  # fmt: skip
# Engine-side latencies (extras ``<stat>_engine_<metric>_ms`` in result.json, with
# ``engine_metrics``: metric → Prometheus name), as vLLM's Prometheus histograms measure them
# (``simulator/metrics.py`` ENGINE_COLUMNS; the server's view, not the client's); exact or
# DDSketch percentiles by the same rule as the client's: metric → (requests column, name)
ENGINE_METRICS = {
    "ttft": ("engine_ttft_s", "vllm:time_to_first_token_seconds"),
    "tpot": ("engine_tpot_s", "vllm:request_time_per_output_token_seconds"),
    "itl": (None, "vllm:inter_token_latency_seconds"),
    "e2el": ("engine_e2el_s", "vllm:e2e_request_latency_seconds"),
    "queue_time": ("queue_s", "vllm:request_queue_time_seconds"),
    "prefill_time": ("prefill_s", "vllm:request_prefill_time_seconds"),
    "decode_time": ("decode_s", "vllm:request_decode_time_seconds"),
}
# Client TTFT = the sum of these per-request terms (``ttft_breakdown_ms``: means over the
# completed requests, ms): term → (end column, start column, what)
TTFT_TERMS = (
    ("api_server", "frontend_arrival_s", "send_s",
     "API server asyncio thread: queue + request work (HTTP, validation)"),
    ("tokenizer", "tokenized_s", "frontend_arrival_s",
     "tokenizer thread: micro-batch window + queue + tokenization"),
    ("ipc_in", "queued_s", "tokenized_s",
     "API server -> engine core hop + input queue until the engine loop takes it in"),
    ("engine_queue", "first_scheduled_s", "queued_s", "engine waiting queue"),
    ("engine_prefill", "engine_first_token_s", "first_scheduled_s",
     "engine: first scheduled -> first token (prefill steps)"),
    ("output", "first_token_s", "engine_first_token_s",
     "engine core -> API server hop + output queue + detokenize/SSE"),
)
# host-timing facts: not reproducible, kept out of result.json by write_run
VOLATILE_KEYS = ("wall_seconds", "sim_speed")


# ---------------------------------------------------------------------------------------------
# helpers


def _num(x: Any) -> Any:
    """numpy scalar → Python; NaN/inf → None (JSON has neither)."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    x = float(x)
    return x if math.isfinite(x) else None


def _take(parts: list[np.ndarray]) -> np.ndarray:
    """Concatenate and empty ``parts`` (so the pieces are freed as the whole appears)."""
    out = np.concatenate(parts) if parts else np.zeros(0)
    parts.clear()
    return out


def _traffic(result: RunResult, key: str, default: Any = None) -> Any:
    meta = result.workload_meta or {}
    if key in meta:
        return meta[key]
    return getattr(getattr(result.config, "workload", None), key, default)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("servesim")
    except metadata.PackageNotFoundError:  # pragma: no cover - source checkout without install
        return "unknown"


def parse_list(text: str | None) -> list[str]:
    """``"ttft, tpot,itl"`` → ``["ttft", "tpot", "itl"]``."""
    return [s.strip() for s in (text or "").split(",") if s.strip()]


def compute_bench_result(result: RunResult, *, date: str | None = None) -> dict:
    """See :func:`_bench`; for runs with load stages or warm-up (``result.client_columns``)
    the metrics leave warm-up requests out and ``stages`` lists each stage's metrics (see
    :func:`stage_results`)."""
    view = measured_view(result)
    if view is result:
        return _bench(result, date=date)
    bench = _bench(view, date=date)
    stages = stage_results(result)
    if stages:
        bench["stages"] = stages
    n_warm = view.num_warmup
    if n_warm:
        bench["num_warmup_requests"] = n_warm
    return bench


def _from_request_itls(itls: list, starts: np.ndarray, t0: float) -> tuple[np.ndarray, float]:
    """(ITL pool, ``max_output_tokens_per_s``) from each request's client-side gaps, as
    ``calculate_metrics`` has them: the gaps of the successful requests (``starts``: each
    one's first-chunk time, NaN for the others), and the peak 1-s bucket (from ``t0``, the
    first send of a successful request) of their chunk times: first chunk, then one per gap."""
    pool, times = [], []
    for gaps, s in zip(itls, starts.tolist()):
        if not math.isnan(s):  # (NaN: not successful)
            g = np.asarray(gaps, dtype=float)
            g = g[np.isfinite(g)]
            pool.append(g)
            times.append(s + np.concatenate(([0.0], np.cumsum(g))))
    if not pool:
        return np.zeros(0), 0.0
    b = np.floor(np.concatenate(times) - t0).astype(np.int64)
    return np.concatenate(pool), float(np.unique(b, return_counts=True)[1].max())


def _bench(result: RunResult, *, date: str | None = None) -> dict:
    """The ``vllm bench serve --save-result`` dict of a run, plus servesim's extras.

    ``date``: "%Y%m%d-%H%M%S" (default: UTC now). Latencies in ms, per-request arrays in s,
    throughputs per second of ``result.duration_s``; JSON-safe (no NaN/inf; undefined → None).

    One pass over ``result.iter_requests()``: in memory (runs of up to
    ``metrics.EXACT_REQUESTS`` requests) that is one window and every value is what numpy
    gives on the whole arrays. For a streamed run the per-request lists are
    :class:`PerRequest` objects (written window by window by ``dumps_result``), and a metric
    with more than ``metrics.EXACT_SAMPLES`` samples has DDSketch median/percentiles (exact
    count/mean/std), listed under ``approximate_percentiles``.
    """
    cfg = result.config
    out_cfg = getattr(cfg, "output", None)
    selected = parse_list(getattr(out_cfg, "percentile_metrics", "ttft,tpot,itl,e2el"))
    percentiles = [float(p) for p in parse_list(getattr(out_cfg, "metric_percentiles", "99"))]
    save_detailed = bool(getattr(out_cfg, "save_detailed", False))
    max_concurrency = _traffic(result, "max_concurrency")
    if max_concurrency is not None:
        selected += [m for m in _CLIENT_QUEUE_METRICS if m not in selected]
    slo = getattr(cfg, "slo", None)
    slo_s = [(name, ms / MILLISECONDS_PER_SECOND) for name, ms in (
        ("ttft", getattr(slo, "ttft_ms", None)), ("tpot", getattr(slo, "tpot_ms", None)),
        ("e2el", getattr(slo, "e2el_ms", None))) if ms is not None]
    streamed = result.streamed

    series = {m: Distribution() for m, _, _ in METRIC_INFO if m != "itl"}
    engine = {m: Distribution() for m, (col, _) in ENGINE_METRICS.items() if col}
    breakdown = {t[0]: 0 for t in TTFT_TERMS}  # ns
    has_engine = False
    n = completed = total_input = total_output = good = 0
    t0 = math.inf
    lists: dict[str, list] = {k: [] for k in (*_DETAILED, *_ALWAYS)}
    sends, finishes, firsts = [], [], []
    req_itls = getattr(result, "request_itls", None)
    chunk_starts = []  # per completed request: its first chunk's client time (request_itls)
    reasons_count: dict[str, int] = {}
    for req in result.iter_requests():
        w = _Window(req)
        done = w.done
        if req_itls is not None:
            chunk_starts.append(np.where(done, w.send + w.ttft_all, np.nan))
        n += w.n
        if not done.all():
            r, c = np.unique(w.reasons[~done], return_counts=True)
            for a, b in zip(r.tolist(), c.tolist()):
                reasons_count[a] = reasons_count.get(a, 0) + b
        completed += int(done.sum())
        ttfts = w.ttft_all[done]
        e2els = w.e2el_all[done]
        out_done = w.output_len[done]
        multi = out_done > 1
        tpots = (e2els[multi] - ttfts[multi]) / (out_done[multi] - 1)
        all_tpots = np.zeros(len(out_done))
        all_tpots[multi] = tpots
        total_input += int(w.prompt_len[done].sum())
        total_output += int(out_done.sum())
        if slo_s:
            ok = np.ones(len(out_done), dtype=bool)
            for name, limit in slo_s:
                ok &= limit >= {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}[name]
            good += int(ok.sum())
        if "engine_ttft_s" in req:
            has_engine = True
            for m, dist in engine.items():
                v = np.asarray(req[ENGINE_METRICS[m][0]], dtype=float)[done]
                dist.add(v[np.isfinite(v)])
            for name, end, start, _ in TTFT_TERMS:
                d = (np.asarray(req[end], dtype=float)[done]
                     - np.asarray(req[start], dtype=float)[done])
                # whole nanoseconds, summed exactly: the same total however the rows are
                # windowed (streamed runs)
                ns = np.rint(np.nan_to_num(d) * 1e9).astype(np.int64)
                breakdown[name] += int(ns.sum())
        cq = w.client_queue[done]
        for m, v in (("ttft", ttfts), ("tpot", tpots), ("e2el", e2els),
                     ("client_queue_time", cq), ("e2el_including_client_queue", None)):
            if m in selected:
                series[m].add(e2els + cq if v is None else v)
        if done.any():
            t0 = min(t0, float(np.min(w.send[done])))
        sends.append(w.send[done])
        finishes.append(w.finish[done])
        if not streamed:
            firsts.append(_col(req, "first_token_s", w.n).astype(float)[done])
            for k, fn in (*_DETAILED.items(), *_ALWAYS.items()):
                if k in _ALWAYS or save_detailed:
                    lists[k] += fn(w)
    if not streamed:
        per_request: dict[str, Any] = lists
    else:
        per_request = {k: PerRequest(result, fn) for k, fn in (*_DETAILED.items(),
                                                               *_ALWAYS.items())}
    failed = n - completed
    duration = float(result.duration_s)
    t0 = t0 if completed else 0.0

    def per_s(x: float) -> float | None:
        return x / duration if duration > 0 else None

    # --- vLLM's keys, in vLLM's order
    rate = _traffic(result, "request_rate", math.inf)
    rate = "inf" if rate is None or float(rate) == math.inf else float(rate)
    name = cfg.model.name
    bench: dict[str, Any] = {
        "date": date or datetime.now(UTC).strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai",
        "backend": "openai",
        "label": getattr(out_cfg, "label", None),
        "model_id": name,
        "tokenizer_id": name,
        "num_prompts": int(_traffic(result, "num_prompts", n) or n),
    }
    for k, v in (getattr(out_cfg, "metadata", None) or {}).items():  # vllm bench --metadata
        bench[str(k)] = v
    bench["request_rate"] = rate
    burst = _traffic(result, "burstiness", 1.0)
    bench["burstiness"] = "inf" if burst is not None and float(burst) == math.inf else _num(burst)
    bench["max_concurrency"] = _num(max_concurrency)
    if _traffic(result, "ramp_up_strategy") is not None:
        for k in RAMP_UP_KEYS:
            bench[k] = _traffic(result, k)
    bench.update(
        duration=duration,
        completed=completed,
        failed=failed,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=per_s(completed),
        request_goodput=per_s(float(good)) if slo_s else None,
        output_throughput=per_s(total_output),
        total_token_throughput=per_s(total_input + total_output),
    )
    failed_reasons = {k: reasons_count[k] for k in sorted(reasons_count)}
    if save_detailed:
        itls = getattr(result, "request_itls", None)
        bench.update(
            input_lens=per_request["input_lens"],
            output_lens=per_request["output_lens"],
            ttfts=per_request["ttfts"],
            itls=([_floats(x) for x in itls] if itls is not None else
                  PerRequest(result, lambda w: [None] * w.n) if streamed else [None] * n),
            start_times=per_request["start_times"],
            generated_texts=per_request["generated_texts"],
            errors=per_request["errors"],
        )
    bench["latencies"] = per_request["latencies"]
    bench["queue_times"] = per_request["queue_times"]
    if not streamed:
        first = np.concatenate(firsts)
    else:  # a second pass, now that t0 is known: only the bucket counts are kept
        first = None
    # (vLLM: 0.0 without a successful request)
    bench["max_output_tokens_per_s"] = _max_output_tokens_per_s(result, first, t0) \
        if completed else 0.0
    itl_pool = None
    if req_itls is not None:  # each request's gaps: vLLM's own definitions, exactly
        itl_pool, bench["max_output_tokens_per_s"] = _from_request_itls(
            req_itls, np.concatenate(chunk_starts) if chunk_starts else np.zeros(0), t0)
    starts, ends = _take(sends), _take(finishes)
    starts.sort()  # in place: 16 bytes per completed request, the one O(n) step here
    ends.sort()
    bench["max_concurrent_requests"] = _max_concurrent(starts, ends, t0, presorted=True)
    del starts, ends
    bench["rtfx"] = 0.0
    counters0 = result.counters or {}
    if counters0.get("spec_decode_num_draft_tokens"):  # vllm bench: only when drafts > 0
        drafts = counters0["spec_decode_num_drafts"]
        accepted = counters0["spec_decode_num_accepted_tokens"]
        bench.update(
            spec_decode_acceptance_rate=100.0 * accepted
            / counters0["spec_decode_num_draft_tokens"],
            spec_decode_acceptance_length=1 + accepted / drafts if drafts else 0.0,
            spec_decode_num_drafts=int(drafts),
            spec_decode_draft_tokens=int(counters0["spec_decode_num_draft_tokens"]),
            spec_decode_accepted_tokens=int(accepted),
            spec_decode_per_position_acceptance_rates=[
                v / drafts for v in counters0["spec_decode_num_accepted_tokens_per_pos"]],
        )

    approximate = []
    bench_itl: dict = {}
    for metric, _, _ in METRIC_INFO:
        if metric not in selected:
            continue
        if metric == "itl":
            if itl_pool is not None:
                st = _itl_stats(itl_pool, np.ones(len(itl_pool), dtype=np.int64), percentiles)
            elif result.itl_stream is not None:
                st = _sketch_stats(result.itl_stream, percentiles)
                approximate.append(metric)
            else:
                st = _itl_stats(result.itl_values, result.itl_counts, percentiles)
            bench_itl = st
        elif series[metric].exact:
            st = _stats(series[metric].values(), percentiles)
        else:
            st = _sketch_stats(series[metric], percentiles)
            approximate.append(metric)
        for stat, value in st.items():
            bench[f"{stat}_{metric}_ms"] = _num(value)

    # --- servesim extras
    counters = result.counters or {}
    steps = result.steps or {}

    def counter(key: str, step_col: str | None = None) -> Any:
        if key in counters:
            return _num(counters[key])
        if step_col and len(steps.get(step_col, ())):
            return _num(np.asarray(steps[step_col])[-1])
        if key in (result.capacity or {}):
            return _num(result.capacity[key])
        return None

    par = cfg.parallel
    queries = counter("prefix_cache_queries", "vllm:prefix_cache_queries_total")
    hits = counter("prefix_cache_hits", "vllm:prefix_cache_hits_total")
    wall = counter("wall_seconds")
    bench.update(
        simulated=True,
        servesim_version=_version(),
        config_hash=cfg.config_hash(),
        seed=_num(_traffic(result, "seed", None)),
        dataset_name=_traffic(result, "dataset_name", getattr(cfg.workload, "kind", None)),
        gpu=cfg.hardware.name,
        num_gpus=par.tensor_parallel_size * par.pipeline_parallel_size * par.data_parallel_size,
        tensor_parallel_size=par.tensor_parallel_size,
        pipeline_parallel_size=par.pipeline_parallel_size,
        data_parallel_size=par.data_parallel_size,
        num_gpu_blocks=counter("num_gpu_blocks"),
        num_preemptions=counter("num_preemptions", "vllm:num_preemptions_total"),
        prefix_cache_hit_rate=_num(hits / queries) if queries and hits is not None else None,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_steps=counter("num_steps"),
    )
    if getattr(result, "client_columns", False) or isinstance(result, _View):
        bench["failed_reasons"] = failed_reasons
    if getattr(result, "extras", None):  # cluster runs: num_gpus, tiers, router, instances
        bench.update(result.extras)
    sc = getattr(cfg, "speculative_config", None)
    if sc is not None:  # speculative decoding extras (vLLM's keys are above, after rtfx)
        length = bench.get("spec_decode_acceptance_length")
        bench.update(
            speculative_method=sc.method,
            num_speculative_tokens=sc.num_speculative_tokens,
            # tokens per verification step, bonus token included (= vLLM's acceptance
            # length, (1 - α^(k+1)) / (1 - α) for geometric α), and drafts accepted per step
            spec_decode_mean_accepted_length=length,
            spec_decode_mean_accepted_tokens=None if length is None else length - 1.0,
        )
    lc = getattr(cfg, "lora", None)
    if lc is not None and lc.enable_lora:
        bench.update(max_loras=lc.max_loras, max_cpu_loras=lc.max_cpu_loras,
                     **{k: counter(k) for k in (
                         "lora_adapters_seen", "lora_max_active_adapters", "lora_slot_hits",
                         "lora_loads_from_cpu", "lora_loads_from_disk")})
    fe = getattr(result, "frontend", None) or {}
    if fe:
        bench["frontend"] = fe
    if has_engine:
        bench["ttft_breakdown_ms"] = {
            k: (v / completed / 1e6 if completed else 0.0) for k, v in breakdown.items()}
        bench["engine_metrics"] = {m: prom for m, (_, prom) in ENGINE_METRICS.items()}
        for m in ENGINE_METRICS:
            if m == "itl":
                eitl = getattr(result, "engine_itl", None)
                if eitl is None:  # no frontend: the engine's gaps are the client's
                    st = bench_itl
                elif eitl.exact:
                    st = _itl_stats(*eitl.exact_sample(), percentiles)
                else:
                    st = _sketch_stats(eitl, percentiles)
            elif engine[m].exact:
                st = _stats(engine[m].values(), percentiles)
            else:
                st = _sketch_stats(engine[m], percentiles)
            for k, v in st.items():  # like the client's keys: mean_engine_ttft_ms, ...
                bench[f"{k}_engine_{m}_ms"] = _num(v)
    if approximate:
        bench["approximate_percentiles"] = {
            "metrics": approximate, "method": "ddsketch",
            "relative_accuracy": SKETCH_RELATIVE_ACCURACY,
            "exact_up_to_samples": EXACT_SAMPLES}
    bench.update(wall_seconds=wall, sim_speed=_num(duration / wall) if wall else None)
    return bench


def metrics_in(bench: dict) -> list[tuple[str, str, str, list[str]]]:
    """Metrics present in a bench dict: (attr, console name, header, percentile words)."""
    found = []
    for metric, label, header in METRIC_INFO:
        if f"mean_{metric}_ms" not in bench:
            continue
        pat = re.compile(rf"^p([0-9.]+)_{metric}_ms$")
        words = [m.group(1) for k in bench if (m := pat.match(k))]
        found.append((metric, label, header, words))
    return found


# ---------------------------------------------------------------------------------------------
# Stages and warm-up (runs with a client control, ``simulator/client_control.py``)

# keys of each ``stages`` entry, after ``stage``, ``label``, ``warmup``: vLLM's aggregate keys
STAGE_KEYS = (
    "request_rate", "max_concurrency", "num_prompts", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
    "max_concurrent_requests",
)


def stage_results(result: RunResult) -> list[dict]:
    """One dict per load stage: ``stage``, ``label``, ``warmup``, then vLLM's aggregate keys
    (:data:`STAGE_KEYS`), ``failed_reasons`` and the latency metric keys
    (``mean_ttft_ms``, ...), computed as for the whole run over the stage's non-warm-up
    requests (all of them for a warm-up stage), ITL from the samples emitted during the
    stage, ``duration`` from the stage's first send to its last completion."""
    meta = result.workload_meta or {}
    plan = meta.get("stages") or []
    stage_itl = getattr(result, "stage_itl", None) or {}
    out = []
    for st in plan:
        k = st["index"]
        if st["warmup"]:
            def keep(w, k=k):
                return np.asarray(w["stage"]) == k
        else:
            def keep(w, k=k):
                return (np.asarray(w["stage"]) == k) & ~np.asarray(w["warmup"], dtype=bool)
        rate = st["rate"]
        view = _View(result, keep, stage_itl.get(k) or Distribution(),
                     {"request_rate": math.inf if rate is None else rate,
                      "max_concurrency": st["concurrency"], "num_prompts": None,
                      "ramp_up_strategy": None})
        view.workload_meta["num_prompts"] = view.num_requests
        b = _bench(view, date="-")
        row: dict = {"stage": k, "label": st["label"], "warmup": st["warmup"]}
        for key in STAGE_KEYS:
            row[key] = b.get(key)
        row["failed_reasons"] = b.get("failed_reasons", {})
        for key, v in b.items():
            if key.endswith("_ms") and (key.startswith(("mean_", "median_", "std_", "p"))):
                row[key] = v
        out.append(row)
    return out
