"""Other benchmark clients' result files (inference-perf, GuideLLM, AIPerf) read as measurements.

``simulate compare`` and ``simulate fit`` read a measurement as vLLM-bench keys (``mean_ttft_ms``,
``request_throughput``, ...); :func:`load_measured` turns each client's result into a list of
such dicts (one per stage / benchmark, with ``stage``, ``label`` and ``request_rate``).
``simulate run --format inference-perf|guidellm|aiperf`` writes a run in those clients'
formats (``client_export.write_client_results``, by the definitions below). Units: the vLLM
keys are in ms and per second.

Metric definitions and the conversions applied (``vLLM`` = ``vllm bench serve``'s
``calculate_metrics``; per request: TTFT = first token − send, E2EL = last token − send,
TPOT = (E2EL − TTFT)/(output tokens − 1); ITL = every gap between streamed tokens, pooled):

inference-perf (``<stage>_lifecycle_metrics.json``, ``summary_lifecycle_metrics.json``; seconds)
    ``successes.latency.time_to_first_token`` = TTFT, ``request_latency`` = E2EL,
    ``time_per_output_token`` = (last − first token)/(output tokens − 1) = vLLM TPOT,
    ``inter_token_latency`` = pooled gaps between token timestamps = vLLM ITL,
    ``normalized_time_per_output_token`` = latency / output tokens (no vLLM equivalent).
    Percentile keys: ``median``, ``p{p:g}`` (``p90``, ``p99``, ``p99.9``), ``np.percentile``.
    Throughputs are over ``benchmark_time_seconds`` = last end − first start of the stage.
    SSE-line timestamps: inference-perf up to 0.4 appended a timestamp per SSE *event* before
    parsing it, and versions that re-tokenized each streamed chunk with special tokens counted
    a BOS per chunk (fixed in #564); either way the token count doubles at one token per chunk
    and the per-token ITL is half the real one. ``--itl-scale 2`` (``itl_scale``) multiplies
    the measured ITL back when comparing against such a file. Output lengths are what the
    client re-tokenized from the streamed text (``use_server_output_tokens: false``, the
    default), which can differ from the server's count by a token or two.
GuideLLM (``benchmarks.json``; ``metrics.<name>.successful`` distributions, ms unless named)
    ``time_to_first_token_ms`` = TTFT; ``request_latency`` (s) = E2EL;
    ``inter_token_latency_ms`` = (last − first token)/(output − 1) per request = vLLM TPOT per
    request, but the distribution is weighted by output − 1 tokens, so its *mean* equals the
    pooled vLLM ITL mean exactly; it is compared as ``mean_itl_ms`` and as TPOT
    (``median_tpot_ms`` / ``p99_tpot_ms``: exact when output lengths are equal);
    ``time_per_output_token_ms`` = (last token − start)/output tokens (TTFT included, weighted
    by output tokens; no vLLM equivalent, not compared). ``requests_per_second`` /
    ``output_tokens_per_second`` / ``tokens_per_second``: means of rate-over-time
    distributions ≈ completed / duration. With ``requests.successful`` present the vLLM metrics
    are recomputed per request from ``info.timings`` (``request_start``,
    ``first_token_iteration``, ``request_end``) instead; ITL then repeats each request's mean
    gap output − 1 times (mean exact, percentiles approximate).
AIPerf / genai-perf (``profile_export_aiperf.json`` / ``profile_export_genai_perf.json``;
    ``{unit, avg, p50, p99, ...}`` per metric, ms)
    ``time_to_first_token`` = TTFT; ``request_latency`` = E2EL; ``inter_token_latency`` =
    (latency − TTFT)/(output − 1) per request = vLLM TPOT (compared as TPOT; the distribution
    is over requests, as vLLM's); ``request_throughput``, ``output_token_throughput``,
    ``total_token_throughput`` per s over the profiling phase (warm-up excluded, as AIPerf
    reports steady state). With ``profile_export.jsonl`` beside it, the per-record values of the
    ``profiling`` phase give exact medians / p99 (``np.percentile``); p50 is AIPerf's median.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from servesim.simulator.errors import ServesimError

MS = 1000.0


# ---------------------------------------------------------------------------------------------
# Reading measurements


def _read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ServesimError(f"{p}: not valid JSON ({e})") from None


def detect_result(path: str | Path) -> str | None:
    """``inference-perf`` | ``guidellm`` | ``aiperf`` for a client's result (file or folder),
    None for anything else (e.g. a vLLM bench result)."""
    p = Path(path)
    if p.is_dir():
        names = {q.name for q in p.iterdir()}
        if "result.json" in names:  # a servesim run folder (maybe with --format files)
            return None
        if any(n.endswith("_lifecycle_metrics.json") for n in names):
            return "inference-perf"
        if "benchmarks.json" in names:
            return "guidellm"
        if names & {"profile_export_aiperf.json", "profile_export_genai_perf.json"}:
            return "aiperf"
        return None
    if p.name.endswith("_lifecycle_metrics.json"):
        return "inference-perf"
    if p.suffix != ".json" or not p.is_file():
        return None
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except ValueError:
        return None
    if isinstance(d, dict):
        if isinstance(d.get("benchmarks"), list) and all(
                isinstance(b, dict) and "metrics" in b for b in d["benchmarks"]):
            return "guidellm"
        if isinstance(d.get("time_to_first_token"), dict) or isinstance(
                d.get("request_latency"), dict) and "unit" in d["request_latency"]:
            return "aiperf"
        if "successes" in d and "load_summary" in d:
            return "inference-perf"
    return None


def load_measured(path: str | Path, fmt: str | None = None, *,
                  itl_scale: float = 1.0) -> list[dict]:
    """A client's result as vLLM-bench-keyed dicts, one per stage / benchmark (see module
    doc). Each has ``_file``, ``stage`` (index or None for a run summary), ``label``,
    ``request_rate`` and ``measured_format``."""
    p = Path(path)
    fmt = fmt or detect_result(p)
    if fmt == "inference-perf":
        docs = _ip_load(p)
    elif fmt == "guidellm":
        docs = _gl_load(p)
    elif fmt == "aiperf":
        docs = _ap_load(p)
    else:
        raise ServesimError(f"{path}: not an inference-perf, GuideLLM or AIPerf result")
    for d in docs:
        d["measured_format"] = fmt
        if itl_scale != 1.0:
            for k in ("mean_itl_ms", "median_itl_ms", "p99_itl_ms", "std_itl_ms"):
                if isinstance(d.get(k), (int, float)):
                    d[k] *= itl_scale
    return docs


def _pct(summary: dict | None, key: str, scale: float) -> float | None:
    if not isinstance(summary, dict):
        return None
    v = summary.get(key)
    return float(v) * scale if isinstance(v, (int, float)) else None


def _ip_doc(d: dict, name: str) -> dict:
    succ = d.get("successes") or {}
    lat = succ.get("latency") or {}
    thr = succ.get("throughput") or {}
    load = d.get("load_summary") or {}
    fail = d.get("failures") or {}
    out: dict = {"completed": succ.get("count"), "failed": fail.get("count"),
                 "duration": d.get("benchmark_time_seconds")}
    for ours, theirs in (("ttft", "time_to_first_token"), ("tpot", "time_per_output_token"),
                         ("itl", "inter_token_latency"), ("e2el", "request_latency")):
        s = lat.get(theirs)
        out[f"mean_{ours}_ms"] = _pct(s, "mean", MS)
        out[f"median_{ours}_ms"] = _pct(s, "median", MS)
        out[f"p99_{ours}_ms"] = _pct(s, "p99", MS)
    out["request_throughput"] = thr.get("requests_per_sec")
    out["output_throughput"] = thr.get("output_tokens_per_sec")
    out["total_token_throughput"] = thr.get("total_tokens_per_sec")
    rate = load.get("requested_rate")
    out["request_rate"] = rate if rate is not None else "inf"
    if load.get("concurrency") is not None:
        out["max_concurrency"] = load["concurrency"]
    out["label"] = name
    return out


def _ip_load(p: Path) -> list[dict]:
    files = []
    if p.is_dir():
        stages = sorted(p.glob("stage_*_lifecycle_metrics.json"),
                        key=lambda q: int(q.name.split("_")[1]) if q.name.split("_")[1].isdigit()
                        else 0)
        files = stages or sorted(p.glob("summary_lifecycle_metrics.json"))
        if not files:
            raise ServesimError(f"{p}: no stage_*_lifecycle_metrics.json or "
                                "summary_lifecycle_metrics.json in it")
    else:
        files = [p]
    out = []
    for f in files:
        d = _read_json(f)
        if not isinstance(d, dict) or "successes" not in d:
            raise ServesimError(f"{f}: expected inference-perf lifecycle metrics "
                                "(successes, failures, load_summary)")
        doc = _ip_doc(d, f.stem.replace("_lifecycle_metrics", ""))
        parts = f.name.split("_")
        doc["stage"] = int(parts[1]) if parts[0] == "stage" and parts[1].isdigit() else None
        doc["_file"] = str(f)
        out.append(doc)
    return out


def _gl_dist(m: dict, name: str) -> dict | None:
    v = m.get(name)
    if isinstance(v, dict):
        v = v.get("successful", v)
    return v if isinstance(v, dict) else None


def _gl_pick(ds: dict | None, key: str, scale: float) -> float | None:
    if ds is None:
        return None
    if key in ("mean", "median"):
        v = ds.get(key)
    else:
        v = (ds.get("percentiles") or {}).get(key)
    return float(v) * scale if isinstance(v, (int, float)) else None


def _gl_strategy(b: dict) -> tuple[str, Any]:
    cfg = b.get("config") or b.get("args") or {}
    st = cfg.get("strategy") or {}
    kind = st.get("type_") or st.get("type") or "unknown"
    if kind in ("constant", "poisson", "async"):
        return f"{kind}@{st.get('rate'):g}" if isinstance(st.get("rate"), (int, float)) \
            else kind, st.get("rate")
    if kind == "concurrent":
        return f"concurrent@{st.get('streams')}", "inf"
    return kind, "inf"


def _gl_load(p: Path) -> list[dict]:
    f = p / "benchmarks.json" if p.is_dir() else p
    d = _read_json(f)
    benches = d.get("benchmarks") if isinstance(d, dict) else None
    if not isinstance(benches, list):
        raise ServesimError(f"{f}: expected a GuideLLM report with a benchmarks list")
    out = []
    for i, b in enumerate(benches):
        m = b.get("metrics") or {}
        label, rate = _gl_strategy(b)
        doc: dict = {"_file": str(f), "stage": i, "label": label,
                     "request_rate": rate if rate is not None else "inf"}
        reqs = (b.get("requests") or {}).get("successful")
        tot = m.get("request_totals") or {}
        doc["completed"] = tot.get("successful")
        doc["failed"] = ((tot.get("errored") or 0) + (tot.get("incomplete") or 0)
                         if tot else None)
        ttft = _gl_dist(m, "time_to_first_token_ms")
        itl = _gl_dist(m, "inter_token_latency_ms")
        lat = _gl_dist(m, "request_latency")
        for k, src, sc in (("ttft", ttft, 1.0), ("e2el", lat, MS)):
            doc[f"mean_{k}_ms"] = _gl_pick(src, "mean", sc)
            doc[f"median_{k}_ms"] = _gl_pick(src, "median", sc)
            doc[f"p99_{k}_ms"] = _gl_pick(src, "p99", sc)
        doc["mean_itl_ms"] = _gl_pick(itl, "mean", 1.0)
        doc["median_tpot_ms"] = _gl_pick(itl, "median", 1.0)
        doc["p99_tpot_ms"] = _gl_pick(itl, "p99", 1.0)
        for k, name in (("request_throughput", "requests_per_second"),
                        ("output_throughput", "output_tokens_per_second"),
                        ("total_token_throughput", "tokens_per_second")):
            doc[k] = _gl_pick(_gl_dist(m, name), "mean", 1.0)
        if isinstance(reqs, list) and reqs and isinstance(reqs[0], dict) and "info" in reqs[0]:
            doc.update(_gl_per_request(reqs))
        out.append(doc)
    return out


def _stats3(x: np.ndarray, key: str) -> dict:
    if not len(x):
        return {}
    return {f"mean_{key}_ms": float(np.mean(x)) * MS, f"median_{key}_ms":
            float(np.median(x)) * MS, f"p99_{key}_ms": float(np.percentile(x, 99)) * MS}


def _gl_per_request(reqs: list[dict]) -> dict:
    ttft, e2el, tpot, itl_v, itl_w = [], [], [], [], []
    for r in reqs:
        t = (r.get("info") or {}).get("timings") or {}
        start, first, end = t.get("request_start"), t.get("first_token_iteration"), \
            t.get("request_end")
        last = t.get("last_token_iteration") or end
        n = (r.get("output_metrics") or {}).get("total_tokens") or t.get("token_iterations")
        if start is None or first is None or end is None:
            continue
        ttft.append(first - start)
        e2el.append(end - start)
        if n and n > 1:
            tpot.append((end - first) / (n - 1))
            itl_v.append((last - first) / (n - 1))
            itl_w.append(n - 1)
    out = _stats3(np.asarray(ttft), "ttft") | _stats3(np.asarray(e2el), "e2el") | \
        _stats3(np.asarray(tpot), "tpot")
    if itl_v:
        out |= _stats3(np.repeat(np.asarray(itl_v), np.asarray(itl_w, dtype=np.int64)), "itl")
    return out


def _ap_metric(d: dict, name: str, key: str) -> float | None:
    m = d.get(name)
    if not isinstance(m, dict):
        return None
    v = m.get(key)
    if not isinstance(v, (int, float)):
        return None
    unit = str(m.get("unit", "ms")).lower()
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3}.get(unit, 1.0)
    return float(v) * scale


def _ap_load(p: Path) -> list[dict]:
    if p.is_dir():
        cands = [p / "profile_export_aiperf.json", p / "profile_export_genai_perf.json"]
        f = next((c for c in cands if c.is_file()), None)
        if f is None:
            raise ServesimError(f"{p}: no profile_export_aiperf.json in it")
    else:
        f = p
    d = _read_json(f)
    if not isinstance(d, dict):
        raise ServesimError(f"{f}: expected an AIPerf / genai-perf profile export")
    doc: dict = {"_file": str(f), "stage": None, "label": "profiling"}
    for ours, theirs in (("ttft", "time_to_first_token"), ("tpot", "inter_token_latency"),
                         ("e2el", "request_latency")):
        doc[f"mean_{ours}_ms"] = _ap_metric(d, theirs, "avg")
        doc[f"median_{ours}_ms"] = _ap_metric(d, theirs, "p50")
        doc[f"p99_{ours}_ms"] = _ap_metric(d, theirs, "p99")
    for ours, theirs in (("request_throughput", "request_throughput"),
                         ("output_throughput", "output_token_throughput"),
                         ("total_token_throughput", "total_token_throughput")):
        m = d.get(theirs)
        doc[ours] = float(m["avg"]) if isinstance(m, dict) and isinstance(
            m.get("avg"), (int, float)) else None
    cnt = d.get("request_count")
    doc["completed"] = int(cnt["avg"]) if isinstance(cnt, dict) and cnt.get("avg") is not None \
        else None
    err = d.get("error_request_count")
    doc["failed"] = int(err["avg"]) if isinstance(err, dict) and err.get("avg") is not None \
        else 0
    cfg = d.get("input_config") or {}
    rate = None
    if isinstance(cfg, dict):
        lg = cfg.get("loadgen") or {}
        rate = lg.get("request_rate", cfg.get("request_rate"))
    doc["request_rate"] = rate if rate is not None else "inf"
    jl = f.parent / "profile_export.jsonl"
    if jl.is_file():
        doc.update(_ap_records(jl))
    return [doc]


def _ap_records(path: Path) -> dict:
    ttft, e2el, tpot = [], [], []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            r = json.loads(line)
            md = r.get("metadata") or {}
            if str(md.get("benchmark_phase", "profiling")) != "profiling" or r.get("error"):
                continue
            m = r.get("metrics") or {}
            for dst, key in ((ttft, "time_to_first_token"), (e2el, "request_latency"),
                             (tpot, "inter_token_latency")):
                v = _ap_metric(m, key, "value")
                if v is not None:
                    dst.append(v / MS)
    return _stats3(np.asarray(ttft), "ttft") | _stats3(np.asarray(e2el), "e2el") | \
        _stats3(np.asarray(tpot), "tpot")
