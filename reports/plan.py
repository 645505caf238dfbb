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
        more = (f" (+{100 * (r2['usd_per_hour'] / rec['usd_per_hour'] - 1):.0f}%)"
                if rec["usd_per_hour"] > 0 else "")
        s += (f"Runner-up: {int(r2['replicas'])} × {_cand_text(r2)} at "
              f"{_usd(r2['usd_per_hour'])}/h{more}. ")
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


# top-level plan.json keys the report reads, with their JSON types
_PLAN_TYPES = {"name": str, "slo": dict, "slo_text": str, "candidates": list, "points": list,
               "prices": dict, "tolerance": dict, "notes": list}
_PLAN_NUMBERS = ("target_request_rate", "knee_warn", "wall_seconds")
# candidate keys read as numbers; those the answer paragraph needs of the recommended one
_CAND_NUMBERS = ("rank", "capacity_rps", "ci_low", "ci_high", "replicas", "gpus",
                 "usd_per_hour", "usd_per_1m_output_tokens", "utilization_of_knee",
                 "slo_margin_pct", "operating_rps_per_replica", "tensor_parallel_size",
                 "pipeline_parallel_size", "gpus_per_replica", "op_slo_p_ttft_ms",
                 "op_slo_p_tpot_ms", "tokens_per_s_per_gpu", "tokens_per_s_per_user")
_RECOMMENDED_NEEDS = ("replicas", "gpus", "usd_per_hour", "usd_per_1m_output_tokens",
                      "capacity_rps", "ci_low", "ci_high", "operating_rps_per_replica",
                      "utilization_of_knee")


def check_plan(plan: dict, where: Path) -> dict:
    """``plan`` (from ``where``: plan.json, or plan.csv's rows) with the parts the report
    reads checked: ServesimError naming the file and the key otherwise."""
    from servesim.reports.render import check_numbers, number_keys
    from servesim.simulator.errors import ServesimError, short_repr

    if "candidates" not in plan:
        raise ServesimError(f"{where}: no candidates key (is this a plan.json of simulate "
                            "plan?)")
    for k, t in _PLAN_TYPES.items():
        if plan.get(k) is not None and not isinstance(plan[k], t):
            raise ServesimError(f"{where}: {k}: expected a JSON {_JSON_NAME[t]}, got "
                                f"{short_repr(plan[k])}")
    check_numbers(plan, _PLAN_NUMBERS, where)
    check_numbers(plan.get("slo") or {}, ("percentile",), f"{where}: slo")
    for k, default in (("slo_text", "the SLO"), ("target_request_rate", math.nan), ("slo", {})):
        if plan.get(k) is None:
            plan[k] = default
    cands = plan["candidates"]
    if not cands:
        raise ServesimError(f"{where}: no candidates (an empty plan)")
    for i, r in enumerate(cands):
        if not isinstance(r, dict) or "candidate" not in r:
            raise ServesimError(f"{where}: candidates[{i}]: expected an object with a "
                                f"candidate name, got {short_repr(r)}")
        check_numbers(r, _CAND_NUMBERS, f"{where}: candidates[{i}]")
        needs = list(_RECOMMENDED_NEEDS) if r.get("recommended") else []
        if r.get("recommended") or _num(r, "rank") >= 2:  # (named in the answer paragraph)
            needs += ["replicas", "usd_per_hour"]
            if not (isinstance(r.get("cluster"), str) and r.get("cluster")):
                needs += ["hardware", "tensor_parallel_size"]
        for k in needs:
            if r.get(k) is None or (k != "hardware" and not math.isfinite(_num(r, k))):
                raise ServesimError(f"{where}: candidates[{i}] ({r['candidate']}): {k}: "
                                    "missing (the plan's answer names this candidate)")
    for i, pt in enumerate(plan.get("points") or []):
        if not isinstance(pt, dict):
            raise ServesimError(f"{where}: points[{i}]: expected an object, got "
                                f"{short_repr(pt)}")
        check_numbers(pt, number_keys(pt), f"{where}: points[{i}]", allow_inf_text=True)
    for k, v in (plan.get("prices") or {}).items():
        if not isinstance(v, dict):
            raise ServesimError(f"{where}: prices.{k}: expected an object, got {short_repr(v)}")
    return plan


_JSON_NAME = {str: "string", dict: "object", list: "array"}


def plan_report(d: Path):
    """The report of a plan folder (``plan.json``, or only ``plan.csv``)."""
    from servesim.reports import figures as F
    from servesim.reports.render import Report, Section, Table, load_json, read_csv
    from servesim.simulator.errors import ServesimError

    if (d / "plan.json").is_file():
        plan = check_plan(load_json(d / "plan.json"), d / "plan.json")
    else:  # only plan.csv: rebuild a minimal plan dict
        df = read_csv(d / "plan.csv")
        if "candidate" not in df or "fits" not in df:
            raise ServesimError(f"{d / 'plan.csv'}: no plan columns (candidate, fits, ...); "
                                f"got {', '.join(map(str, df.columns))}")
        plan = {"candidates": df.to_dict("records"), "target_request_rate": float("nan"),
                "slo": {}, "slo_text": "the SLO", "points": [], "name": d.name}
        check_plan(plan, d / "plan.csv")
    cand = pd.DataFrame(plan["candidates"])
    pts = pd.DataFrame(plan.get("points") or [])
    slo = {k: v for k, v in (plan.get("slo") or {}).items()
           if str(k).endswith("_ms") and isinstance(v, (int, float)) and v}
    knees = {r["candidate"]: r.get("capacity_rps") for r in plan["candidates"]
             if r.get("fits")}
    table = Table(pd.DataFrame(plan_rows(plan)),
                  f"Target {human(_num(plan, 'target_request_rate'))} req/s; SLO "
                  f"{plan.get('slo_text') or 'the SLO'}; seeds {plan.get('seeds')}. "
                  f"{PLAN_TABLE_CAPTION}.")
    secs = [Section("Candidates ranked by cost", [table])]
    if plan.get("prices"):
        used = {r.get("hardware") for r in plan["candidates"]}
        secs[0].items.append("Prices ($/GPU-hour, editable in configs/prices.yaml): " + "; ".join(
            f"{k} {_usd(_num(v, 'usd_per_gpu_hour'))} ({v.get('source')}, {v.get('as_of')})"
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
    tol = 100 * _num(plan.get("tolerance") or {"rel_width": 0.05}, "rel_width")
    meta = (f"Search: bracketing by doubling from an analytic first guess, then bisection "
            f"until the bracket is within {tol:g}% per seed; capacity = mean of per-seed "
            f"capacities, 95% Student-t CI; replicas = ceil(target / capacity), plus one at a "
            f"time while the simulated operating point misses an SLO. {len(pts)} simulated "
            "points")
    if plan.get("wall_seconds"):
        meta += f" in {plan['wall_seconds']:.0f} s wall time ({plan.get('jobs')} jobs)"
    items: list = [meta + "."]
    if plan.get("notes"):
        items.append("Simulator notes: " + " | ".join(map(str, plan["notes"])))
    secs.append(Section("Method", items))
    return Report(f"servesim capacity plan: {plan.get('name', d.name)}", plan_summary(plan),
                  secs)
