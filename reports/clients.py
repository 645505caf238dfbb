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
    ``first_token_iteration``, ``request_end``) instead; the ITL mean is then the mean gap
    weighted by output − 1 tokens (exact), and ITL percentiles are not given (a request's
    single mean gap says nothing about the spread of its gaps).
AIPerf / genai-perf (``profile_export_aiperf.json`` / ``profile_export_genai_perf.json``;
    ``{unit, avg, p50, p99, ...}`` per metric, ms)
    ``time_to_first_token`` = TTFT; ``request_latency`` = E2EL; ``inter_token_latency`` =
    (latency − TTFT)/(output − 1) per request = vLLM TPOT (compared as TPOT; the distribution
    is over requests, as vLLM's); ``request_throughput``, ``output_token_throughput``,
    ``total_token_throughput`` per s over the profiling phase (warm-up excluded, as AIPerf
    reports steady state). With ``profile_export.jsonl`` beside it, the per-record values of the
    ``profiling`` phase give exact medians / p99 (``np.percentile``); p50 is AIPerf's median.
    Units: ``ns``, ``us``, ``ms``, ``s`` (and their long spellings); any other is refused.

Every value read is checked: a metric, count or rate that is there but is not a number (a
string, a boolean, an object), or is negative or infinite, is an error naming the file and the
key; NaN and absent values are "not measured".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from servesim.simulator.errors import ServesimError, short_repr

MS = 1000.0


# ---------------------------------------------------------------------------------------------
# Reading measurements


def _read_json(p: Path) -> Any:
    if not p.is_file():
        raise ServesimError(f"{p}: not a file")
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ServesimError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise ServesimError(f"{p}: not valid JSON ({e})") from None
    except OSError as e:
        raise ServesimError(f"{p}: cannot read ({e.strerror or e})") from None


def _obj(v: Any, f: Any, key: str) -> dict:
    """``v`` when an object, ``{}`` when absent (None); anything else is an error."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ServesimError(f"{f}: {key}: expected an object, got {short_repr(v)}")
    return v


def value(v: Any, f: Any, key: str) -> float | None:
    """A measured number: None when absent or NaN (not measured); a finite number >= 0 as a
    float; anything else (a string, a boolean, a negative or infinite number) is an error
    naming the file ``f`` and the ``key``."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ServesimError(f"{f}: {key}: expected a number, got {short_repr(v)}")
    if math.isnan(v):
        return None
    if not math.isfinite(v) or v < 0:
        raise ServesimError(f"{f}: {key}: expected a finite non-negative number, got {v!r}")
    return float(v)


def _rate_value(v: Any, f: Any, key: str) -> Any:
    """A request rate: a positive number, or ``"inf"`` when absent or infinite."""
    if v is None or isinstance(v, str) and v.strip().lower() in ("inf", "+inf", "infinity"):
        return "inf"
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
        return "inf" if math.isinf(v) else v
    raise ServesimError(f"{f}: {key}: expected a positive number or 'inf', got {short_repr(v)}")


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


def _scaled(v: float | None, scale: float) -> float | None:
    return None if v is None else v * scale


def _ip_doc(d: dict, name: str, f: Path) -> dict:
    succ = _obj(d.get("successes"), f, "successes")
    lat = _obj(succ.get("latency"), f, "successes.latency")
    thr = _obj(succ.get("throughput"), f, "successes.throughput")
    load = _obj(d.get("load_summary"), f, "load_summary")
    fail = _obj(d.get("failures"), f, "failures")
    out: dict = {"completed": value(succ.get("count"), f, "successes.count"),
                 "failed": value(fail.get("count"), f, "failures.count"),
                 "duration": d.get("benchmark_time_seconds")}
    for ours, theirs in (("ttft", "time_to_first_token"), ("tpot", "time_per_output_token"),
                         ("itl", "inter_token_latency"), ("e2el", "request_latency")):
        where = f"successes.latency.{theirs}"
        s = _obj(lat.get(theirs), f, where)
        for stat, key in (("mean", "mean"), ("median", "median"), ("p99", "p99")):
            out[f"{stat}_{ours}_ms"] = _scaled(value(s.get(key), f, f"{where}.{key}"), MS)
    for ours, theirs in (("request_throughput", "requests_per_sec"),
                         ("output_throughput", "output_tokens_per_sec"),
                         ("total_token_throughput", "total_tokens_per_sec")):
        out[ours] = value(thr.get(theirs), f, f"successes.throughput.{theirs}")
    out["request_rate"] = _rate_value(load.get("requested_rate"), f,
                                      "load_summary.requested_rate")
    conc = value(load.get("concurrency"), f, "load_summary.concurrency")
    if conc is not None:
        out["max_concurrency"] = conc
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
        doc = _ip_doc(d, f.stem.replace("_lifecycle_metrics", ""), f)
        parts = f.name.split("_")
        doc["stage"] = int(parts[1]) if parts[0] == "stage" and parts[1].isdigit() else None
        doc["_file"] = str(f)
        out.append(doc)
    return out


def _gl_dist(m: dict, name: str, f: Path, where: str) -> tuple[dict, str]:
    """A metric's ``successful`` distribution ({} when absent) and its key path."""
    where = f"{where}.{name}"
    v = _obj(m.get(name), f, where)
    if "successful" in v:
        where += ".successful"
        v = _obj(v["successful"], f, where)
    return v, where


def _gl_pick(dist: tuple[dict, str], key: str, scale: float, f: Path) -> float | None:
    ds, where = dist
    if key not in ("mean", "median"):
        where += ".percentiles"
        ds = _obj(ds.get("percentiles"), f, where)
    return _scaled(value(ds.get(key), f, f"{where}.{key}"), scale)


def _gl_strategy(b: dict, f: Path, where: str) -> tuple[str, Any, float | None]:
    """(label, request_rate, max_concurrency) of a benchmark."""
    key = "config" if b.get("config") is not None else "args"
    cfg = _obj(b.get(key), f, f"{where}.{key}")
    where = f"{where}.{key}.strategy"
    st = _obj(cfg.get("strategy"), f, where)
    kind = st.get("type_") or st.get("type") or "unknown"
    if not isinstance(kind, str):
        raise ServesimError(f"{f}: {where}.type_: expected a string, got {short_repr(kind)}")
    conc = value(st.get("max_concurrency"), f, f"{where}.max_concurrency")
    if kind in ("constant", "poisson", "async"):
        rate = _rate_value(st.get("rate"), f, f"{where}.rate")
        return (f"{kind}@{rate:g}" if rate != "inf" else kind), rate, conc
    if kind == "concurrent":
        streams = value(st.get("streams"), f, f"{where}.streams")
        return f"concurrent@{streams:g}" if streams is not None else kind, "inf", streams
    return kind, "inf", 1.0 if kind == "synchronous" else conc


def _gl_load(p: Path) -> list[dict]:
    f = p / "benchmarks.json" if p.is_dir() else p
    d = _read_json(f)
    benches = d.get("benchmarks") if isinstance(d, dict) else None
    if not isinstance(benches, list):
        raise ServesimError(f"{f}: expected a GuideLLM report with a benchmarks list")
    out = []
    for i, b in enumerate(benches):
        where = f"benchmarks[{i}]"
        b = _obj(b, f, where)
        m = _obj(b.get("metrics"), f, f"{where}.metrics")
        label, rate, conc = _gl_strategy(b, f, where)
        doc: dict = {"_file": str(f), "stage": i, "label": label, "request_rate": rate}
        if conc is not None:
            doc["max_concurrency"] = conc
        reqs = _obj(b.get("requests"), f, f"{where}.requests").get("successful")
        w = f"{where}.metrics.request_totals"
        tot = _obj(m.get("request_totals"), f, w)
        doc["completed"] = value(tot.get("successful"), f, f"{w}.successful")
        doc["failed"] = (sum(value(tot.get(k), f, f"{w}.{k}") or 0
                             for k in ("errored", "incomplete")) if tot else None)
        mw = f"{where}.metrics"
        ttft = _gl_dist(m, "time_to_first_token_ms", f, mw)
        itl = _gl_dist(m, "inter_token_latency_ms", f, mw)
        lat = _gl_dist(m, "request_latency", f, mw)
        for k, src, sc in (("ttft", ttft, 1.0), ("e2el", lat, MS)):
            doc[f"mean_{k}_ms"] = _gl_pick(src, "mean", sc, f)
            doc[f"median_{k}_ms"] = _gl_pick(src, "median", sc, f)
            doc[f"p99_{k}_ms"] = _gl_pick(src, "p99", sc, f)
        doc["mean_itl_ms"] = _gl_pick(itl, "mean", 1.0, f)
        doc["median_tpot_ms"] = _gl_pick(itl, "median", 1.0, f)
        doc["p99_tpot_ms"] = _gl_pick(itl, "p99", 1.0, f)
        for k, name in (("request_throughput", "requests_per_second"),
                        ("output_throughput", "output_tokens_per_second"),
                        ("total_token_throughput", "tokens_per_second")):
            doc[k] = _gl_pick(_gl_dist(m, name, f, mw), "mean", 1.0, f)
        if reqs is not None and not isinstance(reqs, list):
            raise ServesimError(f"{f}: {where}.requests.successful: expected a list, got "
                                f"{short_repr(reqs)}")
        if reqs and isinstance(reqs[0], dict) and "info" in reqs[0]:
            doc.update(_gl_per_request(reqs, f, f"{where}.requests.successful"))
        out.append(doc)
    return out


def _stats3(x: np.ndarray, key: str) -> dict:
    if not len(x):
        return {}
    return {f"mean_{key}_ms": float(np.mean(x)) * MS, f"median_{key}_ms":
            float(np.median(x)) * MS, f"p99_{key}_ms": float(np.percentile(x, 99)) * MS}


def _gl_per_request(reqs: list, f: Path, where: str) -> dict:
    """TTFT, E2EL and TPOT per request; the ITL mean as the gaps' total over their count
    (no per-token array: the token counts come from the file)."""
    ttft, e2el, tpot = [], [], []
    gaps = n_gaps = 0.0
    for j, r in enumerate(reqs):
        w = f"{where}[{j}]"
        r = _obj(r, f, w)
        t = _obj(_obj(r.get("info"), f, f"{w}.info").get("timings"), f, f"{w}.info.timings")
        tw = f"{w}.info.timings"
        start, first, end = (value(t.get(k), f, f"{tw}.{k}") for k in (
            "request_start", "first_token_iteration", "request_end"))
        last = value(t.get("last_token_iteration"), f, f"{tw}.last_token_iteration") or end
        n = value(_obj(r.get("output_metrics"), f, f"{w}.output_metrics").get("total_tokens"),
                  f, f"{w}.output_metrics.total_tokens") \
            or value(t.get("token_iterations"), f, f"{tw}.token_iterations")
        if start is None or first is None or end is None:
            continue
        ttft.append(first - start)
        e2el.append(end - start)
        if n and n > 1:
            tpot.append((end - first) / (n - 1))
            gaps += last - first
            n_gaps += n - 1
    out = _stats3(np.asarray(ttft), "ttft") | _stats3(np.asarray(e2el), "e2el") | \
        _stats3(np.asarray(tpot), "tpot")
    if n_gaps:
        out["mean_itl_ms"] = gaps / n_gaps * MS
    return out


AP_UNITS = {"ns": 1e-6, "nanoseconds": 1e-6, "us": 1e-3, "µs": 1e-3, "microseconds": 1e-3,
            "ms": 1.0, "milliseconds": 1.0, "s": 1e3, "sec": 1e3, "seconds": 1e3}


def _ap_metric(d: dict, name: str, key: str, f: Any, where: str = "") -> float | None:
    """``d[name][key]`` in ms (``unit`` ns, us, ms or s; ms when absent)."""
    where = f"{where}{name}"
    m = _obj(d.get(name), f, where)
    v = value(m.get(key), f, f"{where}.{key}")
    if v is None:
        return None
    unit = m.get("unit", "ms")
    scale = AP_UNITS.get(unit.strip().lower()) if isinstance(unit, str) else None
    if scale is None:
        raise ServesimError(f"{f}: {where}.unit: unknown unit {short_repr(unit)} "
                            "(expected ns, us, ms, s)")
    return v * scale


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
        doc[f"mean_{ours}_ms"] = _ap_metric(d, theirs, "avg", f)
        doc[f"median_{ours}_ms"] = _ap_metric(d, theirs, "p50", f)
        doc[f"p99_{ours}_ms"] = _ap_metric(d, theirs, "p99", f)
    for ours, theirs in (("request_throughput", "request_throughput"),
                         ("output_throughput", "output_token_throughput"),
                         ("total_token_throughput", "total_token_throughput"),
                         ("completed", "request_count"), ("failed", "error_request_count")):
        doc[ours] = value(_obj(d.get(theirs), f, theirs).get("avg"), f, f"{theirs}.avg")
    if doc["failed"] is None:
        doc["failed"] = 0
    cfg = _obj(d.get("input_config"), f, "input_config")
    lg = _obj(cfg.get("loadgen"), f, "input_config.loadgen")
    rate, where = lg.get("request_rate"), "input_config.loadgen.request_rate"
    if rate is None:
        rate, where = cfg.get("request_rate"), "input_config.request_rate"
    doc["request_rate"] = _rate_value(rate, f, where)
    jl = f.parent / "profile_export.jsonl"
    if jl.is_file():
        doc.update(_ap_records(jl))
    return [doc]


def _ap_records(path: Path) -> dict:
    vals: dict[str, list] = {"ttft": [], "e2el": [], "tpot": []}
    try:
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if line.strip():
                    _ap_record(line, f"{path}:{i}", vals)
    except UnicodeDecodeError as e:
        raise ServesimError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ServesimError(f"{path}: cannot read ({e.strerror or e})") from None
    return _stats3(np.asarray(vals["ttft"]), "ttft") | _stats3(np.asarray(vals["e2el"]), "e2el") \
        | _stats3(np.asarray(vals["tpot"]), "tpot")


def _ap_record(line: str, where: str, vals: dict[str, list]) -> None:
    """One ``profile_export.jsonl`` record's TTFT, E2EL and ITL (s) into ``vals``."""
    try:
        r = json.loads(line)
    except ValueError as e:
        raise ServesimError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(r, dict):
        raise ServesimError(f"{where}: expected a JSON object, got {short_repr(r)}")
    md = _obj(r.get("metadata"), where, "metadata")
    if str(md.get("benchmark_phase", "profiling")) != "profiling" or r.get("error"):
        return
    m = _obj(r.get("metrics"), where, "metrics")
    for ours, key in (("ttft", "time_to_first_token"), ("e2el", "request_latency"),
                      ("tpot", "inter_token_latency")):
        v = _ap_metric(m, key, "value", where, "metrics.")
        if v is not None:
            vals[ours].append(v / MS)
