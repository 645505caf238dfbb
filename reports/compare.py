"""``simulate compare SIM.json MEASURED.json [MORE.json ...]``: simulated vs measured metrics.

Inputs are vLLM bench result files: simulated ones (servesim ``result.json``, recognised by
``"simulated": true``, or a run folder containing one) and real ``vllm bench serve
--save-result`` JSONs. With one of each they are paired directly; with several, each measured
file is paired with the simulated file of the same ``request_rate`` (``inf`` matches ``inf``;
otherwise the nearest rate within 1%).

Measured results of other clients are read too (``reports/clients.py``, conversions there):
an inference-perf report folder or ``stage_<k>_lifecycle_metrics.json`` (one measurement per
stage), a GuideLLM ``benchmarks.json`` (one per benchmark), an AIPerf / genai-perf
``profile_export_*.json``. A staged simulation (``stages`` in its result.json) is compared
stage by stage: measured stage / benchmark k against the simulation's k-th non-warm-up stage;
a measurement of a whole run against the simulation's totals. ``itl_scale`` multiplies the
measured ITL (2 for inference-perf files with SSE-line timestamps).

Per metric: ``sim``, ``measured``, ``error = sim − measured``, ``abs_error = |error|`` (ms for
latencies, per s for throughputs) and ``rel_error_pct = 100 · error / measured`` (signed:
positive means the simulator over-predicts). A metric missing on either side is reported with
``status`` ``missing in sim`` / ``missing in measured``, never an error.

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


def pair_results(sims: list[dict], measured: list[dict]) -> list[tuple[dict, dict]]:
    """Pairs (sim, measured): directly for one of each, else by matching request_rate."""
    if not sims or not measured:
        raise ServesimError("compare: need at least one simulated and one measured result "
                            "(simulated files carry \"simulated\": true)")
    if len(sims) == 1 and len(measured) == 1:
        return [(sims[0], measured[0])]
    pairs = []
    for m in measured:
        rm = _rate(m)
        best, best_d = None, math.inf
        for s in sims:
            rs = _rate(s)
            if math.isinf(rm) or math.isinf(rs):
                d = 0.0 if (math.isinf(rm) and math.isinf(rs)) else math.inf
            elif math.isnan(rm) or math.isnan(rs):
                d = math.inf
            else:
                d = abs(rs - rm) / max(abs(rm), 1e-12)
            if d < best_d:
                best, best_d = s, d
        if best is None or best_d > 0.01:
            raise ServesimError(f"{m['_file']}: no simulated result with request_rate "
                                f"{m.get('request_rate')} (have "
                                f"{sorted({str(s.get('request_rate')) for s in sims})})")
        pairs.append((best, m))
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
            row["status"] = "missing in measured"
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


def compare_files(paths: list[str | Path], *, itl_scale: float = 1.0) -> list[dict]:
    """Load every file, split simulated/measured, pair them and compare."""
    from servesim.reports.clients import detect_result, load_measured

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
        stages = _sim_stages(sim)
        staged = [m for m in client_docs if m.get("stage") is not None]
        if staged and stages:
            idx = [m["stage"] for m in staged]
            if len(set(idx)) != len(idx) or max(idx) >= len(stages):
                raise ServesimError(
                    f"{staged[0]['_file']}: {len(staged)} measured stages, but the simulation "
                    f"has {len(stages)} measured stages; simulate the same profile")
            pairs += [(stages[m["stage"]], m) for m in staged]
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


def write_csv(rows: list[dict], path: str | Path) -> None:
    import csv
    import io

    from servesim.reports.writers import atomic_write_text

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(COMPARE_COLUMNS), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if isinstance(r.get(k), float) and math.isnan(r[k]) else r.get(k))
                    for k in COMPARE_COLUMNS})
    atomic_write_text(p, buf.getvalue())


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
