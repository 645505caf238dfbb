"""``simulate compare SIM.json MEASURED.json [MORE.json ...]``: simulated vs measured metrics.

Inputs are vLLM bench result files: simulated ones (servesim ``result.json``, recognised by
``"simulated": true``, or a run folder containing one) and real ``vllm bench serve
--save-result`` JSONs. With one of each they are paired directly; with several, each measured
file is paired with the simulated file of the same load: the same ``request_rate`` (``inf``
matches ``inf``; otherwise the nearest rate within 1%) and, when both give one, the same
``max_concurrency`` (a closed loop, both ``max_concurrency`` equal, pairs whatever rate the
client reported). Two simulated files that fit a measured one equally well are refused as
ambiguous.

Measured results of other clients are read too (``reports/clients.py``, conversions there):
an inference-perf report folder or ``stage_<k>_lifecycle_metrics.json`` (one measurement per
stage), a GuideLLM ``benchmarks.json`` (one per benchmark), an AIPerf / genai-perf
``profile_export_*.json``. A staged simulation (``stages`` in its result.json) is compared
stage by stage: measured stage / benchmark k against the simulation's k-th non-warm-up stage,
which must be at the same load (as above), else the files are refused; a measurement of a whole
run against the simulation's totals. ``itl_scale`` (a finite number > 0) multiplies the
measured ITL (2 for inference-perf files with SSE-line timestamps).

Measured values are checked before anything is compared: a metric that is there but is not a
finite number >= 0 (a string, a boolean, a negative number, ``Infinity``) is an error naming
the file and key (NaN and null are "missing"), and a measured run that completed 0 requests is
refused. ``-o`` is checked first too: it may not be an input, lie in an input folder, be a
folder or sit where no file can be written.

Per metric: ``sim``, ``measured``, ``error = sim − measured``, ``abs_error = |error|`` (ms for
latencies, per s for throughputs) and ``rel_error_pct = 100 · error / measured`` (signed:
positive means the simulator over-predicts). A metric missing on either side is reported with
``status`` ``missing in sim`` / ``missing in measured``, never an error; GuideLLM results
carry no ITL percentiles (only per-request mean gaps, whose spread is not the gaps' spread), so
their ``median_itl_ms`` / ``p99_itl_ms`` rows say ``not in GuideLLM`` and are not compared.

Client side vs engine side (``side`` column): the vllm bench metrics are what the client saw
(HTTP, tokenization, the API server, the engine, the SSE stream). When both files also carry
engine-side latencies, as vLLM's Prometheus histograms measure them (``mean_engine_ttft_ms``-
style keys: servesim writes them; for a real server, take them from ``/metrics``), those are
compared in their own rows (``side`` = ``engine``:
``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``, ...), so a gap
can be placed in front of or inside the engine.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from servesim.simulator.errors import ServesimError

COMPARE_METRICS = (
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms",
    "request_throughput", "output_throughput", "total_token_throughput",
)
ENGINE_COMPARE = tuple(f"{s}_engine_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el",
                                                        "queue_time", "prefill_time")
                       for s in ("mean", "median", "p99"))
COMPARE_COLUMNS = ("request_rate", "sim_file", "measured_file", "metric", "sim", "measured",
                   "error", "abs_error", "rel_error_pct", "status", "stage", "side")


def engine_value(d: dict, key: str) -> float:
    """An engine-side value ``<stat>_engine_<metric>_ms`` of a result (servesim writes them;
    for a real server, add them from a scrape of ``/metrics``)."""
    return _num(d.get(key))


def load_result(path: str | Path) -> dict:
    """A bench result dict from a JSON file or a run folder (its ``result.json``)."""
    p = Path(path)
    if p.is_dir():
        p = p / "result.json"
    if not p.is_file():
        raise ServesimError(f"{path}: no such result file")
    try:
        d = json.loads(p.read_text())
    except ValueError as e:
        raise ServesimError(f"{p}: not valid JSON ({e})") from None
    if isinstance(d, list) and d and isinstance(d[-1], dict):  # --append-result files: last
        d = d[-1]
    if not isinstance(d, dict):
        raise ServesimError(f"{p}: expected a JSON object with vllm bench keys")
    d = dict(d)
    d["_file"] = str(p)
    return d


def is_simulated(d: dict) -> bool:
    return bool(d.get("simulated"))


def _rate(d: dict) -> float:
    r = d.get("request_rate")
    if isinstance(r, str):
        return math.inf if r.strip().lower() in ("inf", "+inf", "infinity") else _num(r)
    return _num(r)


def _num(v: Any) -> float:
    if v is None or isinstance(v, bool):
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _conc(d: dict) -> float | None:
    c = d.get("max_concurrency")
    return float(c) if isinstance(c, (int, float)) and not isinstance(c, bool) else None


def _load_distance(sim: dict, meas: dict) -> float:
    """How far apart two loads are: the relative request-rate gap (0 for ``inf`` and ``inf``),
    ``inf`` when the rates or the concurrency limits (when both give one) differ."""
    cs, cm = _conc(sim), _conc(meas)
    rs, rm = _rate(sim), _rate(meas)
    if cs is not None and cm is not None:
        if cs != cm:
            return math.inf
        if math.isinf(rs) or math.isinf(rm):  # a closed loop: the rate is what came of it
            return 0.0
    if math.isinf(rm) or math.isinf(rs):
        return 0.0 if (math.isinf(rm) and math.isinf(rs)) else math.inf
    if math.isnan(rm) or math.isnan(rs):
        return math.inf
    return abs(rs - rm) / max(abs(rm), 1e-12)


def _load_str(d: dict) -> str:
    c = _conc(d)
    return f"request_rate {_rate(d):g}" + (f", max_concurrency {c:g}" if c is not None else "")


def pair_results(sims: list[dict], measured: list[dict]) -> list[tuple[dict, dict]]:
    """Pairs (sim, measured): directly for one of each, else by matching load (module doc)."""
    if not sims or not measured:
        raise ServesimError("compare: need at least one simulated and one measured result "
                            "(simulated files carry \"simulated\": true)")
    if len(sims) == 1 and len(measured) == 1:
        return [(sims[0], measured[0])]
    pairs = []
    for m in measured:
        dist = [_load_distance(s, m) for s in sims]
        best_d = min(dist)
        if best_d > 0.01:
            raise ServesimError(f"{m['_file']}: no simulated result with {_load_str(m)} "
                                f"(have {', '.join(sorted({_load_str(s) for s in sims}))})")
        best = [s for s, d in zip(sims, dist) if d == best_d]
        if len(best) > 1:
            raise ServesimError(f"{m['_file']}: {len(best)} simulated results match its "
                                f"{_load_str(m)} ({best[0].get('_file')}, "
                                f"{best[1].get('_file')}); give one per load")
        pairs.append((best[0], m))
    return pairs


def compare_pair(sim: dict, meas: dict, metrics: tuple[str, ...] = COMPARE_METRICS) -> list[dict]:
    """One row per metric (see module docstring)."""
    rows = []
    rate = meas.get("request_rate", sim.get("request_rate"))
    stage = meas.get("label") if meas.get("stage") is not None else sim.get("label", "")
    engine = [k for k in ENGINE_COMPARE if metrics is COMPARE_METRICS]
    if not (any(math.isfinite(engine_value(sim, k)) for k in engine)
            and any(math.isfinite(engine_value(meas, k)) for k in engine)):
        engine = []  # engine side only when both files have it
    for k in (*metrics, *engine):
        side = "engine" if k in ENGINE_COMPARE else "client"
        if side == "engine":
            s, m = engine_value(sim, k), engine_value(meas, k)
        else:
            s, m = _num(sim.get(k)), _num(meas.get(k))
        row = {"request_rate": rate, "sim_file": sim.get("_file", ""),
               "measured_file": meas.get("_file", ""), "side": side, "metric": k, "sim": s,
               "measured": m, "error": math.nan, "abs_error": math.nan,
               "rel_error_pct": math.nan, "stage": stage or ""}
        if math.isnan(s) and math.isnan(m):
            row["status"] = "missing in both"
        elif math.isnan(s):
            row["status"] = "missing in sim"
        elif math.isnan(m):
            row["status"] = ("not in GuideLLM" if k in ("median_itl_ms", "p99_itl_ms") and
                             meas.get("measured_format") == "guidellm" else "missing in measured")
        else:
            err = s - m
            row.update(error=err, abs_error=abs(err),
                       rel_error_pct=100.0 * err / m if m != 0 else math.nan, status="ok")
        rows.append(row)
    return rows


def _sim_stages(sim: dict) -> list[dict]:
    """The measured (non-warm-up) stages of a staged simulation as compare documents."""
    out = []
    for st in sim.get("stages") or []:
        if st.get("warmup"):
            continue
        d = dict(st)
        d["_file"] = f"{sim.get('_file', '')}#stage{st.get('stage')}"
        out.append(d)
    return out


def _check_measured(m: dict) -> None:
    """Every compared metric of a measured document is absent, NaN or a finite number >= 0,
    and the run completed requests."""
    from servesim.reports.clients import value

    for k in (*COMPARE_METRICS, *ENGINE_COMPARE, "completed"):
        value(m.get(k), m["_file"], k)
    if m.get("completed") == 0:
        where = m["_file"] + (f" ({m.get('label')})" if m.get("stage") is not None else "")
        raise ServesimError(f"{where}: measured run completed 0 requests; nothing to compare")


def _stage_pairs(sim: dict, staged: list[dict]) -> list[tuple[dict, dict]]:
    """Measured stage k with the simulation's k-th measured stage, at the same load."""
    stages = _sim_stages(sim)
    idx = [m["stage"] for m in staged]
    if len(set(idx)) != len(idx) or max(idx) >= len(stages):
        raise ServesimError(
            f"{staged[0]['_file']}: {len(staged)} measured stages, but the simulation "
            f"has {len(stages)} measured stages; simulate the same profile")
    for m in staged:
        s = stages[m["stage"]]
        if _load_distance(s, m) > 0.01:
            raise ServesimError(
                f"{m['_file']}: measured stage {m['stage']} ({m.get('label')}) is at "
                f"{_load_str(m)} but simulated stage {m['stage']} ({s.get('label')}) is at "
                f"{_load_str(s)}; simulate the same profile")
    return [(stages[m["stage"]], m) for m in staged]


def compare_files(paths: list[str | Path], *, itl_scale: float = 1.0) -> list[dict]:
    """Load every file, split simulated/measured, check the measured values, pair them and
    compare."""
    from servesim.reports.clients import detect_result, load_measured

    if isinstance(itl_scale, bool) or not (math.isfinite(itl_scale) and itl_scale > 0):
        raise ServesimError(f"--itl-scale: expected a finite number > 0, got {itl_scale!r}")
    docs, client_docs = [], []
    for p in paths:
        if detect_result(p) is not None:
            client_docs.extend(load_measured(p, itl_scale=itl_scale))
        else:
            docs.append(load_result(p))
    sims = [d for d in docs if is_simulated(d)]
    meas = [d for d in docs if not is_simulated(d)]
    if not sims and len(docs) >= 2 and not client_docs:  # nothing flagged: the first is the sim
        sims, meas = docs[:1], docs[1:]
    for m in (*meas, *client_docs):
        _check_measured(m)
    if itl_scale != 1.0:
        for m in meas:
            for k in ("mean_itl_ms", "median_itl_ms", "p99_itl_ms"):
                if isinstance(m.get(k), (int, float)):
                    m[k] = m[k] * itl_scale
    pairs = []
    if client_docs:
        if len(sims) != 1:
            raise ServesimError("compare: give one simulated result.json with a client's "
                                "result (inference-perf, GuideLLM, AIPerf)")
        sim = sims[0]
        staged = [m for m in client_docs if m.get("stage") is not None]
        if staged and _sim_stages(sim):
            pairs += _stage_pairs(sim, staged)
        elif staged:
            pairs += pair_results([sim], staged) if len(staged) > 1 else [(sim, staged[0])]
        pairs += [(sim, m) for m in client_docs if m.get("stage") is None]
        if meas:
            pairs += pair_results(sims, meas)
    else:
        pairs = pair_results(sims, meas)
    rows = []
    for s, m in pairs:
        pair = compare_pair(s, m)
        if not any(r["status"] == "ok" for r in pair):  # nothing comparable: say which file
            bare = [d["_file"] for d in (m, s)
                    if not any(math.isfinite(_num(d.get(k))) for k in COMPARE_METRICS)]
            raise ServesimError(
                f"{bare[0] if bare else m['_file']}: no vllm bench metric keys in common "
                f"(expected some of {', '.join(COMPARE_METRICS[:3])}, ...)")
        rows.extend(pair)
    return rows


def mape(rows: list[dict]) -> float:
    """Mean absolute relative error (%) over the rows with both values."""
    v = [abs(r["rel_error_pct"]) for r in rows
         if r["status"] == "ok" and math.isfinite(r["rel_error_pct"])]
    return sum(v) / len(v) if v else math.nan


def check_output(output: str | Path, inputs: list[str | Path]) -> None:
    """Refuse an ``-o`` path that is one of the ``inputs`` (or a file an input folder holds,
    or the ``profile_export.jsonl`` read beside an AIPerf export), is a folder, or cannot be
    written; called before anything is compared, so a refusal writes nothing."""
    out = Path(output)
    if out.is_dir():
        raise ServesimError(f"-o {output}: is a directory; give a CSV file path")
    rout = out.resolve()
    for p in inputs:
        p = Path(p)
        read = [p] + ([p.parent / "profile_export.jsonl"]
                      if p.name.startswith("profile_export_") else [])
        for q in read:
            if rout == q.resolve() or (out.exists() and q.exists() and os.path.samefile(out, q)):
                raise ServesimError(f"-o {output}: is one of the inputs; choose another path")
        if p.is_dir() and rout.is_relative_to(p.resolve()):
            raise ServesimError(f"-o {output}: is inside the input folder {p}; choose "
                                "another path")
    if out.exists() and not out.is_file():
        raise ServesimError(f"-o {output}: not a regular file")
    parent = rout.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ServesimError(f"-o {output}: {parent} is not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".servesim-probe-"):
            pass
    except OSError as e:
        raise ServesimError(f"-o {output}: cannot write in {parent} "
                            f"({e.strerror or e})") from None


def write_csv(rows: list[dict], path: str | Path) -> None:
    import csv
    import io

    from servesim.reports.writers import atomic_write_text

    p = Path(path)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COMPARE_COLUMNS), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if isinstance(r.get(k), float) and math.isnan(r[k]) else r.get(k))
                    for k in COMPARE_COLUMNS})
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(p, buf.getvalue())
    except OSError as e:
        raise ServesimError(f"-o {path}: cannot write ({e.strerror or e})") from None


def rich_table(rows: list[dict]):
    from rich.table import Table

    multi = len({(r["sim_file"], r["measured_file"]) for r in rows}) > 1
    t = Table(title="simulated vs measured (error = sim − measured)")
    staged = any(r.get("stage") for r in rows)
    if multi:
        t.add_column("stage" if staged else "rate (req/s)", justify="right")
    sides = len({r.get("side", "client") for r in rows}) > 1
    if sides:
        t.add_column("side")
    for c in ("metric", "sim", "measured", "abs error", "rel error %", "status"):
        t.add_column(c, justify="left" if c in ("metric", "status") else "right")

    def f(v: float, nd: int = 2) -> str:
        return "" if not math.isfinite(v) else f"{v:,.{nd}f}"

    for r in rows:
        rel = r["rel_error_pct"]
        style = ("" if not math.isfinite(rel) else "green" if abs(rel) <= 10 else
                 "yellow" if abs(rel) <= 25 else "red")
        cells = [r["metric"], f(r["sim"]), f(r["measured"]), f(r["abs_error"]),
                 f"[{style}]{f(rel, 1)}[/]" if style else f(rel, 1), r["status"]]
        if sides:
            cells.insert(0, "engine (vLLM Prometheus)" if r.get("side") == "engine"
                         else "client (vllm bench)")
        if multi:
            cells.insert(0, str(r.get("stage") or r["request_rate"]) if staged
                         else str(r["request_rate"]))
        t.add_row(*cells)
    return t
