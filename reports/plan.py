"""Rendering of plan results (``plan.json`` of ``simulate plan``): the answer paragraph, the
candidate table (console and report), and the plan section of ``report.md`` / ``report.html``.

Only reads results; the search itself lives in ``simulator/plan/``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
from servesim.reports.numbers import human


def _num(r: dict, k: str) -> float:
    v = r.get(k)
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _usd(v: float, digits: int = 2) -> str:
    return f"${v:,.{digits}f}" if math.isfinite(v) else ""


def _pct(frac: float) -> str:
    return f"{frac:.0%}" if math.isfinite(frac) else ""


PLAN_TABLE_CAPTION = ("req/s: what one replica sustains within the SLO (mean over seeds); "
                      "load: operating rate / that; * recommended")


def plan_rows(plan: dict) -> list[dict[str, str]]:
    """One row of display strings per candidate, in the plan's order (ranked first)."""
    out = []
    for r in plan["candidates"]:
        cap = _num(r, "capacity_rps")
        fits = bool(r.get("fits"))
        sized = fits and cap > 0
        rank = _num(r, "rank")
        out.append({
            "#": human(rank) if math.isfinite(rank) else "",
            "candidate": ("* " if r.get("recommended") else "") + str(r["candidate"]),
            "fits": "yes" if fits else "no",
            "req/s": human(cap) if cap > 0 else "",
            "95% CI": (f"{human(_num(r, 'ci_low'))}–{human(_num(r, 'ci_high'))}"
                       if cap > 0 else ""),
            "replicas": human(_num(r, "replicas")) if sized else "",
            "GPUs": human(_num(r, "gpus")) if sized else "",
            "$/h": _usd(_num(r, "usd_per_hour")) if sized else "",
            "$/1M tok": _usd(_num(r, "usd_per_1m_output_tokens"), 3) if sized else "",
            "load": _pct(_num(r, "utilization_of_knee")) if sized else "",
            "SLO margin": human(_num(r, "slo_margin_pct"), "%") if sized else "",
            "Pareto": "yes" if r.get("pareto") else "",
            "note": (str(r.get("reason") or "does not fit") if not fits
                     else str(r.get("warning") or "")),
        })
    return out


def print_plan(res: dict, output: Path, quiet: bool) -> None:
    """The plan table and the answer on stdout (only the answer with ``quiet``)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not quiet:
        t = Table(title=f"plan {res['name']}: {human(res['target_request_rate'])} req/s, "
                        f"{res['slo_text']}", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True, caption=PLAN_TABLE_CAPTION)
        rows = plan_rows(res)
        cols = [c for c in (rows[0] if rows else {}) if c not in ("fits", "SLO margin", "Pareto", "note")]
        for c in cols:  # numbers never cut; a long candidate name folds when narrow
            t.add_column(c, justify="left" if c == "candidate" else "right",
                         overflow="fold", no_wrap=c != "candidate")
        for row in rows:
            t.add_row(*(row[c] for c in cols))
        console.print(t)
        for row in rows:
            if row["note"]:
                console.print(f"  {row['candidate'].lstrip('* ')}: {row['note']}",
                              highlight=False)
    console.print(plan_summary(res).replace("**", ""), highlight=False)
    console.print(f"wrote {output}/plan.csv, plan.json, report.md, report.html "
                  f"({res['wall_seconds']:.0f} s)", highlight=False)


def plan_summary(plan: dict) -> str:
    """The answer paragraph of a plan report."""
    rows = plan["candidates"]
    rec = next((r for r in rows if r.get("recommended")), None)
    n_fit = sum(1 for r in rows if r.get("fits"))
    skipped = [r for r in rows if not r.get("fits")]
    target = human(plan["target_request_rate"])
    if rec is None:
        why = "; ".join(f"{r['candidate']} ({_short_reason(r.get('reason'))})"
                        for r in skipped[:4])
        more = f" and {len(skipped) - 4} more" if len(skipped) > 4 else ""
        head = (f"**None of the {len(rows)} candidates fits**" if n_fit == 0 else
                f"**No candidate meets {plan['slo_text']} at any rate**")
        return (f"{head}, so nothing can serve {target} req/s within {plan['slo_text']}. "
                f"Why: {why}{more}.")
    s = (f"**Recommended: {int(rec['replicas'])} × {_cand_text(rec)} "
         f"({int(rec['gpus'])} GPU{'s' if rec['gpus'] != 1 else ''}) serves {target} req/s "
         f"within {plan['slo_text']} for {_usd(rec['usd_per_hour'])}/h "
         f"({_usd(rec['usd_per_1m_output_tokens'], 3)} per 1M output tokens).** One replica "
         f"sustains {human(rec['capacity_rps'])} req/s (95% CI {human(rec['ci_low'])}–"
         f"{human(rec['ci_high'])}), so each runs at {human(rec['operating_rps_per_replica'])}"
         f" req/s = {rec['utilization_of_knee']:.0%} of its knee")
    kw = plan.get("knee_warn", 0.85)
    if kw - 0.05 <= rec["utilization_of_knee"] <= kw:
        s += f" (just under the {kw:.0%} headroom line)"
    if math.isfinite(_num(rec, "op_slo_p_ttft_ms")):
        p = plan["slo"].get("percentile", 99)
        p = int(p) if float(p).is_integer() else p
        where = "simulated there" if rec.get("op_simulated") else "at the knee"
        s += (f"; {where}, P{p} TTFT is {human(rec['op_slo_p_ttft_ms'], 'ms')} and P{p} TPOT "
              f"{human(_num(rec, 'op_slo_p_tpot_ms'), 'ms')}, a "
              f"{_num(rec, 'slo_margin_pct'):.0f}% margin to the tightest SLO")
    s += ". "
    others = sorted((r for r in rows if r is not rec and _num(r, "rank") >= 2),
                    key=lambda r: r["rank"])
    if others:
        r2 = others[0]
        s += (f"Runner-up: {int(r2['replicas'])} × {_cand_text(r2)} at "
              f"{_usd(r2['usd_per_hour'])}/h "
              f"(+{100 * (r2['usd_per_hour'] / rec['usd_per_hour'] - 1):.0f}%). ")
    s += f"{n_fit} of {len(rows)} candidates fit"
    if skipped:
        s += "; not fitting: " + "; ".join(f"{r['candidate']} ({_short_reason(r['reason'])})"
                                           for r in skipped[:3])
        if len(skipped) > 3:
            s += f" and {len(skipped) - 3} more"
    s += "."
    if rec.get("warning"):
        s += f" **Warning:** {rec['warning']}."
    return s


def _short_reason(r: Any, n: int = 110) -> str:
    r = str(r or "")
    return r if len(r) <= n else r[: n - 1] + "…"


def _cand_text(r: dict) -> str:
    if isinstance(r.get("cluster"), str) and r.get("cluster"):  # a cluster shape
        return f"{r['cluster']} cluster ({_num(r, 'gpus_per_replica'):g} × {r['hardware']})"
    tp, pp = int(r["tensor_parallel_size"]), int(r.get("pipeline_parallel_size", 1) or 1)
    s = f"{r['hardware']} TP{tp}" + (f" PP{pp}" if pp > 1 else "")
    extras = [t for t in str(r["candidate"]).split("_")
              if t not in (str(r["hardware"]), f"tp{tp}", f"pp{pp}")]
    return s + (f" ({', '.join(extras)})" if extras else "") + " replicas"


def plan_report(d: Path):
    """The report of a plan folder (``plan.json``, or only ``plan.csv``)."""
    from servesim.reports import figures as F
    from servesim.reports.render import Report, Section, Table, load_json

    if (d / "plan.json").is_file():
        plan = load_json(d / "plan.json")
    else:  # only plan.csv: rebuild a minimal plan dict
        df = pd.read_csv(d / "plan.csv")
        plan = {"candidates": df.to_dict("records"), "target_request_rate": float("nan"),
                "slo": {}, "slo_text": "the SLO", "points": [], "name": d.name}
    cand = pd.DataFrame(plan["candidates"])
    pts = pd.DataFrame(plan.get("points", []))
    slo = {k: v for k, v in plan.get("slo", {}).items() if k.endswith("_ms") and v}
    knees = {r["candidate"]: r.get("capacity_rps") for r in plan["candidates"]
             if r.get("fits")}
    table = Table(pd.DataFrame(plan_rows(plan)),
                  f"Target {human(plan['target_request_rate'])} req/s; SLO "
                  f"{plan['slo_text']}; seeds {plan.get('seeds')}. {PLAN_TABLE_CAPTION}.")
    secs = [Section("Candidates ranked by cost", [table])]
    if plan.get("prices"):
        used = {r.get("hardware") for r in plan["candidates"]}
        secs[0].items.append("Prices ($/GPU-hour, editable in configs/prices.yaml): " + "; ".join(
            f"{k} {_usd(v['usd_per_gpu_hour'])} ({v['source']}, {v['as_of']})"
            for k, v in plan["prices"].items() if k in used) + ".")
    fit = cand[cand["fits"].astype(bool)] if "fits" in cand else cand
    if "usd_per_1m_output_tokens" in cand:
        secs.append(Section("Cost", [F.cost_bars(fit, "candidate", plan.get("recommended"))]))
    if "capacity_rps" in cand:
        secs.append(Section("Capacity", [F.capacity_bars(fit, "candidate")]))
    if len(pts):
        search = pts[~pts.get("operating_point", pd.Series(False, index=pts.index))
                     .fillna(False).astype(bool)]
        secs.append(Section("Latency vs request rate (search points)",
                            [F.latency_vs_rate(search, "candidate", slo, knees,
                                               percentiles=(99,))]))
        secs.append(Section("Throughput and goodput vs rate",
                            [F.throughput_vs_rate(search, "candidate", knees)]))
    if "tokens_per_s_per_gpu" in cand:
        secs.append(Section("Pareto frontier", [F.pareto_front(fit, "candidate")]))
    tol = 100 * plan.get("tolerance", {}).get("rel_width", 0.05)
    meta = (f"Search: bracketing by doubling from an analytic first guess, then bisection "
            f"until the bracket is within {tol:g}% per seed; capacity = mean of per-seed "
            f"capacities, 95% Student-t CI; replicas = ceil(target / capacity), plus one at a "
            f"time while the simulated operating point misses an SLO. {len(pts)} simulated "
            "points")
    if plan.get("wall_seconds"):
        meta += f" in {plan['wall_seconds']:.0f} s wall time ({plan.get('jobs')} jobs)"
    items: list = [meta + "."]
    if plan.get("notes"):
        items.append("Simulator notes: " + " | ".join(plan["notes"]))
    secs.append(Section("Method", items))
    return Report(f"servesim capacity plan: {plan.get('name', d.name)}", plan_summary(plan),
                  secs)
