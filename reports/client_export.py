"""Our runs in other benchmark clients' result formats: ``simulate run --format
inference-perf|guidellm|aiperf`` (:func:`write_client_results`). The metric definitions and
conversions are listed in ``clients.py``, which reads those files back as measurements."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from servesim.reports.clients import MS
from servesim.simulator.errors import ServesimError

FORMATS = ("inference-perf", "guidellm", "aiperf")
IP_PERCENTILES = (0.1, 1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9)  # inference-perf's default
GL_PERCENTILES = (("p001", 0.1), ("p01", 1), ("p05", 5), ("p10", 10), ("p25", 25), ("p50", 50),
                  ("p75", 75), ("p90", 90), ("p95", 95), ("p99", 99), ("p999", 99.9))
AP_PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)


class _Req:
    """The completed / failed requests of one stage (or the measured run), as arrays (s)."""

    def __init__(self, req: dict, mask: np.ndarray):
        g = {k: np.asarray(v)[mask] for k, v in req.items()}
        reason = np.asarray(g["finished_reason"]).astype(str)
        self.ok = np.isin(reason, ("stop", "length"))
        self.reason = reason
        self.send = np.asarray(g["send_s"], dtype=float)
        self.first = np.asarray(g["first_token_s"], dtype=float)
        self.finish = np.asarray(g["finish_s"], dtype=float)
        self.arrival = np.asarray(g["arrival_s"], dtype=float)
        self.prompt = np.asarray(g["prompt_len"], dtype=np.int64)
        self.out = np.asarray(g["output_len"], dtype=np.int64)
        self.ids = np.asarray(g["request_id"]).astype(str)
        self.err = np.asarray(g.get("error", np.full(len(reason), ""))).astype(str)
        self.stage = np.asarray(g["stage"]) if "stage" in g else np.zeros(len(reason), int)
        self.warm = np.asarray(g["warmup"], dtype=bool) if "warmup" in g else \
            np.zeros(len(reason), bool)
        ok = self.ok
        self.ttft = (self.first - self.send)[ok]
        self.e2el = (self.finish - self.send)[ok]
        n = self.out[ok]
        multi = n > 1
        self.tpot = ((self.e2el - self.ttft)[multi] / (n[multi] - 1))
        self.n_ok = n
        # a failed request ends when the client gave it up (its error time), else unknown
        self.t0 = float(np.nanmin(self.send)) if len(self.send) and np.isfinite(
            self.send).any() else 0.0
        ends = self.finish[ok]
        self.t1 = float(ends.max()) if len(ends) else self.t0

    @property
    def duration(self) -> float:
        return max(self.t1 - self.t0, 0.0)


def _groups(result) -> list[tuple[dict | None, np.ndarray, Any]]:
    """(stage plan entry or None, row mask, ITL Distribution or None) per stage of a run
    (one group for a run without stages); warm-up rows left out of measured stages."""
    req = result.requests
    n = len(req["finished_reason"])
    plan = (result.workload_meta or {}).get("stages") or []
    warm = np.asarray(req["warmup"], dtype=bool) if "warmup" in req else np.zeros(n, bool)
    if not plan:
        return [(None, ~warm, None)]
    stage = np.asarray(req["stage"])
    stage_itl = getattr(result, "stage_itl", None) or {}
    return [(st, (stage == st["index"]) & (~warm | st["warmup"]), stage_itl.get(st["index"]))
            for st in plan]


def _itl_samples(result, dist) -> np.ndarray:
    """Pooled ITL samples (s) of a stage's Distribution, or of the whole run."""
    if dist is not None and dist.exact:
        v, c = dist.exact_sample()
    elif dist is None and len(result.itl_values):
        v, c = result.itl_values, result.itl_counts
    else:
        return np.zeros(0)
    v = np.asarray(v, dtype=float)
    c = np.asarray(c, dtype=np.int64)
    if c.sum() > 5_000_000:  # keep memory bounded: a weighted quantile sample
        c = np.maximum((c * (5_000_000 / c.sum())).astype(np.int64), 1)
    return np.repeat(v, c)


def _ip_summarize(x: np.ndarray) -> dict | None:
    """inference-perf ``summarize``: mean/min/max, ``median``, ``p{p:g}`` (seconds)."""
    if not len(x):
        return None
    out = {"mean": float(np.mean(x)), "min": float(np.min(x)), "max": float(np.max(x))}
    for p in IP_PERCENTILES:
        out["median" if p == 50 else f"p{p:g}"] = float(np.percentile(x, p))
    return out


def _ip_stage(r: _Req, itl: np.ndarray, rate: float | None, conc: int | None) -> dict:
    ok = r.ok
    total = r.duration
    n_ok = int(ok.sum())
    sends = r.send[np.isfinite(r.send)]
    send_dur = float(sends.max() - sends.min()) if len(sends) else 0.0
    load: dict = {"count": len(r.ok), "schedule_delay": _ip_summarize(
        np.zeros(len(sends)))}
    if rate is not None:
        load.update(send_duration=send_dur, requested_rate=rate,
                    achieved_rate=len(sends) / send_dur if send_dur > 0 else 0.0)
        if conc is not None:
            load["concurrency"] = conc
    inp, out = r.prompt[ok].sum(), r.out[ok].sum()

    def per_s(x):
        return float(x) / total if total > 0 else 0.0
    lat = r.e2el
    fails = ~ok
    fail_lat = (r.finish - r.send)[fails]
    fail_lat = fail_lat[np.isfinite(fail_lat)]
    labels: dict[str, int] = {}
    for reason in r.reason[fails].tolist():
        labels[reason] = labels.get(reason, 0) + 1
    return {
        "load_summary": load,
        "successes": {
            "count": n_ok,
            "latency": {
                "request_latency": _ip_summarize(lat),
                "normalized_time_per_output_token": _ip_summarize(
                    lat / np.maximum(r.n_ok, 1)),
                "time_per_output_token": _ip_summarize(r.tpot),
                "time_to_first_token": _ip_summarize(r.ttft),
                "inter_token_latency": _ip_summarize(itl),
            },
            "throughput": {"input_tokens_per_sec": per_s(inp), "output_tokens_per_sec":
                           per_s(out), "total_tokens_per_sec": per_s(inp + out),
                           "requests_per_sec": per_s(n_ok)},
            "prompt_len": _ip_summarize(r.prompt[ok].astype(float)),
            "output_len": _ip_summarize(r.out[ok].astype(float)),
        },
        "failures": {"count": int(fails.sum()), "request_latency": _ip_summarize(fail_lat),
                     "by_label": labels},
        "benchmark_time_seconds": total,
    }


def _gl_ds(x: np.ndarray, w: np.ndarray | None = None) -> dict:
    """GuideLLM ``DistributionSummary`` of values (optionally weighted)."""
    x = np.asarray(x, dtype=float)
    if not len(x):
        z = {"mean": 0.0, "median": 0.0, "mode": 0.0, "variance": 0.0, "std_dev": 0.0,
             "min": 0.0, "max": 0.0, "count": 0, "total_sum": 0.0}
        return z | {"percentiles": {k: 0.0 for k, _ in GL_PERCENTILES}}
    w = np.ones(len(x)) if w is None else np.asarray(w, dtype=float)
    order = np.argsort(x, kind="stable")
    xs, ws = x[order], w[order]
    cum = np.cumsum(ws)
    tot = cum[-1]

    def q(p):
        return float(xs[min(np.searchsorted(cum, p / 100.0 * tot, side="left"), len(xs) - 1)])
    mean = float(np.sum(xs * ws) / tot)
    var = float(np.sum(ws * (xs - mean) ** 2) / tot)
    return {"mean": mean, "median": q(50), "mode": q(50), "variance": var,
            "std_dev": math.sqrt(var), "min": float(xs[0]), "max": float(xs[-1]),
            "count": len(x), "total_sum": float(np.sum(xs * ws)),
            "percentiles": {k: q(p) for k, p in GL_PERCENTILES}}


def _gl_sds(x, w=None) -> dict:
    ds = _gl_ds(x, w)
    empty = _gl_ds(np.zeros(0))
    return {"successful": ds, "errored": empty, "incomplete": empty, "total": ds}


def _gl_strategy_of(st: dict | None, meta: dict) -> dict:
    if st is None:
        rate = meta.get("request_rate")
        mc = meta.get("max_concurrency")
        if rate is None or (isinstance(rate, float) and math.isinf(rate)):
            return {"type_": "concurrent", "streams": mc} if mc else {"type_": "throughput"}
        return {"type_": "poisson", "rate": rate}
    if st["rate"] is None:
        c = st["concurrency"]
        if c == 1:
            return {"type_": "synchronous"}
        if st["label"] == "throughput":
            return {"type_": "throughput", "max_concurrency": c}
        return {"type_": "concurrent", "streams": c}
    kind = "poisson" if st["arrivals"] == "poisson" else "constant"
    return {"type_": kind, "rate": st["rate"], "max_concurrency": st["concurrency"]}


def _gl_benchmark(r: _Req, st: dict | None, meta: dict) -> dict:
    ok = r.ok
    n = r.n_ok
    dur = r.duration
    itl_ms = np.where(n > 1, (r.finish[ok] - r.first[ok]) / np.maximum(n - 1, 1), 0.0) * MS
    tpot_ms = (r.finish[ok] - r.send[ok]) / np.maximum(n, 1) * MS
    reqs = []
    for i in np.flatnonzero(ok).tolist():
        reqs.append({
            "request_id": r.ids[i], "info": {"timings": {
                "request_start": float(r.send[i]), "first_token_iteration": float(r.first[i]),
                "last_token_iteration": float(r.finish[i]), "request_end": float(r.finish[i]),
                "token_iterations": int(r.out[i])}},
            "input_metrics": {"total_tokens": int(r.prompt[i])},
            "output_metrics": {"total_tokens": int(r.out[i])}})
    errored = [{"request_id": r.ids[i], "error": r.err[i] or r.reason[i]}
               for i in np.flatnonzero(~ok).tolist()]
    per_s = (lambda x: float(x) / dur if dur > 0 else 0.0)
    counts = {"successful": int(ok.sum()), "errored": int((~ok).sum()), "incomplete": 0,
              "total": len(ok)}
    rate_ds = _gl_sds(np.asarray([per_s(ok.sum())]))
    return {
        "type_": "generative_benchmark",
        "config": {"strategy": _gl_strategy_of(st, meta),
                   "constraints": {}, "simulated": True},
        "scheduler_metrics": {"start_time": r.t0, "end_time": r.t1,
                              "requests_made": counts},
        "metrics": {
            "request_totals": counts,
            "requests_per_second": rate_ds,
            "request_latency": _gl_sds(r.e2el),
            "prompt_token_count": _gl_sds(r.prompt[ok]),
            "output_token_count": _gl_sds(n),
            "total_token_count": _gl_sds(r.prompt[ok] + n),
            "time_to_first_token_ms": _gl_sds(r.ttft * MS),
            "time_per_output_token_ms": _gl_sds(tpot_ms, n),
            "inter_token_latency_ms": _gl_sds(itl_ms[n > 1], (n - 1)[n > 1]),
            "output_tokens_per_second": _gl_sds(np.asarray([per_s(n.sum())])),
            "tokens_per_second": _gl_sds(np.asarray([per_s(n.sum() + r.prompt[ok].sum())])),
        },
        "requests": {"successful": reqs, "errored": errored, "incomplete": []},
    }


def _ap_stat(x: np.ndarray, unit: str, scale: float = 1.0) -> dict:
    x = np.asarray(x, dtype=float) * scale
    if not len(x):
        return {"unit": unit}
    out = {"unit": unit, "avg": float(np.mean(x))}
    for p in AP_PERCENTILES:
        out[f"p{p}"] = float(np.percentile(x, p))
    out.update(min=float(np.min(x)), max=float(np.max(x)), std=float(np.std(x)),
               count=len(x))
    return out


def write_client_results(result, bench: dict, outdir: str | Path, formats: list[str]) -> list[str]:
    """Write ``result`` in the given clients' formats into ``outdir``; returns file names.

    - ``inference-perf``: ``stage_<k>_lifecycle_metrics.json`` per stage (the whole measured
      run as stage 0 without stages), ``summary_lifecycle_metrics.json`` (measured requests),
      ``per_request_lifecycle_metrics.json``.
    - ``guidellm``: ``benchmarks.json``, one benchmark per stage (warm-up stages left out).
    - ``aiperf``: ``profile_export_aiperf.json`` (measured requests: the profiling phase)
      and ``profile_export.jsonl`` (one record per request, warm-up as phase ``warmup``).

    Runs with more than ``metrics.EXACT_REQUESTS`` requests (streamed) are refused."""
    from servesim.reports.writers import atomic_write_text

    if result.streamed:
        raise ServesimError("--format: client result files are written for runs of up to "
                            "1M requests (this run streamed its requests to disk)")
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise ServesimError(f"--format: {bad[0]!r} is not one of {', '.join(FORMATS)}")
    out = Path(outdir)
    req = {k: np.asarray(v) for k, v in result.requests.items()}
    meta = result.workload_meta or {}
    groups = _groups(result)
    written: list[str] = []

    def dump(name: str, obj) -> None:
        atomic_write_text(out / name, json.dumps(obj, indent=2, allow_nan=False,
                                                 default=_jsonable) + "\n")
        written.append(name)

    if "inference-perf" in formats:
        all_ok = np.zeros(len(req["finished_reason"]), bool)
        for k, (st, mask, dist) in enumerate(groups):
            r = _Req(req, mask)
            if st is None or not st["warmup"]:
                all_ok |= mask
            rate = (st["rate"] if st is not None else meta.get("request_rate"))
            rate = rate if rate is not None else (float(len(r.ok)) if st is not None and
                                                  st["closed"] else None)
            if isinstance(rate, float) and math.isinf(rate):
                rate = float(len(r.ok))
            dump(f"stage_{k}_lifecycle_metrics.json",
                 _ip_stage(r, _itl_samples(result, dist), rate,
                           st["concurrency"] if st is not None else meta.get("max_concurrency")))
        r = _Req(req, all_ok)
        dump("summary_lifecycle_metrics.json",
             _ip_stage(r, _itl_samples(result, None if len(groups) == 1 else _ItlUnion(
                 result, groups)), None, None))
        rows = []
        for i in range(len(req["finished_reason"])):
            ok = str(req["finished_reason"][i]) in ("stop", "length")
            rows.append({"start_time": float(req["send_s"][i]),
                         "end_time": float(req["finish_s"][i]) if ok else None,
                         "stage_id": int(req["stage"][i]) if "stage" in req else 0,
                         "computed_metrics": {
                             "request_latency": float(req["e2el_s"][i]) if ok else None,
                             "time_to_first_token": float(req["ttft_s"][i]) if ok else None,
                             "time_per_output_token": _f(req["tpot_s"][i]) if ok else None,
                             "input_tokens": int(req["prompt_len"][i]),
                             "output_tokens": int(req["output_len"][i])} if ok else None,
                         "error": None if ok else {"error_type": str(req["finished_reason"][i]),
                                                   "error_msg": str(req["error"][i])}})
        dump("per_request_lifecycle_metrics.json", rows)
    if "guidellm" in formats:
        benches = [_gl_benchmark(_Req(req, mask), st, meta)
                   for st, mask, _ in groups if st is None or not st["warmup"]]
        dump("benchmarks.json", {
            "metadata": {"version": 2, "guidellm_version": "servesim-export",
                         "simulated": True, "servesim_version": bench.get("servesim_version")},
            "benchmarks": benches})
    if "aiperf" in formats:
        measured = np.zeros(len(req["finished_reason"]), bool)
        for st, mask, _ in groups:
            if st is None or not st["warmup"]:
                measured |= mask
        r = _Req(req, measured)
        ok = r.ok
        dur = r.duration
        n = r.n_ok
        itl = (r.e2el - r.ttft)[n > 1] / (n[n > 1] - 1)
        per_s = (lambda x: float(x) / dur if dur > 0 else 0.0)
        doc = {
            "schema_version": "1.1", "aiperf_version": "servesim-export", "simulated": True,
            "input_config": {"loadgen": {"request_rate": _rate_json(meta.get("request_rate")),
                                         "concurrency": meta.get("max_concurrency")}},
            "request_throughput": {"unit": "requests/sec", "avg": per_s(ok.sum())},
            "request_latency": _ap_stat(r.e2el, "ms", MS),
            "time_to_first_token": _ap_stat(r.ttft, "ms", MS),
            "inter_token_latency": _ap_stat(itl, "ms", MS),
            "output_token_throughput": {"unit": "tokens/sec", "avg": per_s(n.sum())},
            "output_token_throughput_per_user": _ap_stat(1.0 / itl[itl > 0], "tokens/sec/user"),
            "total_token_throughput": {"unit": "tokens/sec",
                                       "avg": per_s(n.sum() + r.prompt[ok].sum())},
            "input_sequence_length": _ap_stat(r.prompt[ok], "tokens"),
            "output_sequence_length": _ap_stat(n, "tokens"),
            "request_count": {"unit": "requests", "avg": int(ok.sum())},
            "error_request_count": {"unit": "requests", "avg": int((~ok).sum())},
            "benchmark_duration": {"unit": "sec", "avg": dur},
        }
        dump("profile_export_aiperf.json", doc)
        lines = []
        for i in range(len(req["finished_reason"])):
            ok_i = str(req["finished_reason"][i]) in ("stop", "length")
            warm = bool(req["warmup"][i]) if "warmup" in req else False
            send = float(req["send_s"][i]) if np.isfinite(req["send_s"][i]) else 0.0
            end = float(req["finish_s"][i]) if ok_i else send
            m = {"input_sequence_length": {"value": int(req["prompt_len"][i]), "unit": "tokens"}}
            if ok_i:
                o = int(req["output_len"][i])
                m.update(request_latency={"value": float(req["e2el_s"][i]) * MS, "unit": "ms"},
                         time_to_first_token={"value": float(req["ttft_s"][i]) * MS,
                                              "unit": "ms"},
                         output_sequence_length={"value": o, "unit": "tokens"})
                if o > 1:
                    m["inter_token_latency"] = {"value": float(req["tpot_s"][i]) * MS,
                                                "unit": "ms"}
            lines.append(json.dumps({
                "metadata": {"x_request_id": str(req["request_id"][i]),
                             "request_start_ns": round(send * 1e9),
                             "request_end_ns": round(end * 1e9),
                             "benchmark_phase": "warmup" if warm else "profiling",
                             "phase_index": int(req["stage"][i]) if "stage" in req else 0},
                "metrics": m,
                "error": None if ok_i else {"type": str(req["finished_reason"][i]),
                                            "message": str(req["error"][i])}}))
        atomic_write_text(out / "profile_export.jsonl", "\n".join(lines) + "\n")
        written.append("profile_export.jsonl")
    return written


class _ItlUnion:
    """The measured stages' ITL samples as one exact Distribution-like object."""

    def __init__(self, result, groups):
        self.parts = [d for st, _, d in groups if d is not None and not st["warmup"]]
        self.exact = all(d.exact for d in self.parts) and bool(self.parts)

    def exact_sample(self):
        vs, cs = zip(*(d.exact_sample() for d in self.parts)) if self.parts else ((), ())
        return (np.concatenate(vs) if vs else np.zeros(0),
                np.concatenate(cs) if cs else np.zeros(0, np.int64))


def _f(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _rate_json(r):
    if r is None:
        return None
    return "inf" if isinstance(r, float) and math.isinf(r) else r


def _jsonable(x):
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x) if math.isfinite(float(x)) else None
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(type(x).__name__)
