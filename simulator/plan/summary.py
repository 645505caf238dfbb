"""From searched candidates to the plan's answer: capacity, sizing, cost, fit verdict, Pareto
set, ranking, warnings; written as ``plan.csv`` (one row per candidate) and ``plan.json``.

A candidate *fits* only when it can serve the target within every SLO: it fits in memory, some
rate meets the SLO, and (with ``confirm``) its simulated operating point meets every SLO, with
replicas added when needed (see :mod:`.runner`). Otherwise ``reason`` says why not.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
from servesim.reports.numbers import human
from servesim.simulator.experiments import write_json
from servesim.simulator.experiments.store import atomic_write_text
from servesim.simulator.plan.cost import deployment_cost, pareto_mask, replicas_for
from servesim.simulator.plan.runner import Candidate
from servesim.simulator.plan.search import summarize_searches
from servesim.simulator.plan.slo import slo_margin, slo_misses
from servesim.simulator.plan.spec import PlanSpec, get_path

PLAN_COLUMNS = [
    "rank", "recommended", "candidate", "hardware", "tensor_parallel_size",
    "pipeline_parallel_size", "fits", "reason", "num_gpu_blocks", "capacity_rps", "ci_low",
    "ci_high", "capacity_per_seed", "converged", "n_evals", "replicas", "gpus_per_replica",
    "gpus", "usd_per_gpu_hour", "usd_per_hour", "usd_per_1m_output_tokens",
    "operating_rps_per_replica", "utilization_of_knee", "op_slo_p_ttft_ms", "op_slo_p_tpot_ms",
    "op_goodput_pct", "slo_margin_pct", "tokens_per_s_per_gpu", "tokens_per_s_per_user",
    "pareto", "warning",
]
_OP_KEYS = ("slo_p_ttft_ms", "slo_p_tpot_ms", "slo_p_e2el_ms", "p99_ttft_ms", "p99_tpot_ms",
            "p99_e2el_ms", "goodput_pct", "num_preemptions")


def summarize_plan(spec: PlanSpec, cands: list[Candidate], prices: dict[str, dict]) -> dict:
    """Capacities, sizing, cost, fit verdicts, Pareto flags, ranking and the recommendation."""
    for c in cands:  # completion order varies with --jobs: sort for deterministic outputs
        c.points.sort(key=lambda p: (p["seed"], p["request_rate"]))
    sizing = {}
    rows = [_row(spec, c, prices, sizing) for c in cands]
    # the Pareto set is drawn from candidates that fit (meet the SLO at their operating point)
    x = [r.get("tokens_per_s_per_user", math.nan) if r["fits"] else math.nan for r in rows]
    y = [r.get("tokens_per_s_per_gpu", math.nan) for r in rows]
    for r, p in zip(rows, pareto_mask(x, y)):
        r["pareto"] = bool(p)
    ranked = sorted((r for r in rows if _usable(r)),
                    key=lambda r: (round(r["usd_per_hour"], 6), r["utilization_of_knee"],
                                   -r["capacity_rps"]))
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    for r in rows:
        r.setdefault("rank", math.nan)
        r["recommended"] = False
        r["warning"] = _warning(r, spec, sizing.get(r["candidate"])) if _usable(r) else ""
    rec = ranked[0] if ranked else None
    if rec is not None:
        rec["recommended"] = True
    rows.sort(key=lambda r: (not _usable(r), r["rank"] if _usable(r) else 0,
                             not r["fits"], r["candidate"]))
    notes = sorted({w for c in cands for p in c.points for w in (p.get("warnings") or [])})
    points = [{k: v for k, v in p.items() if k != "warnings"} for c in cands for p in c.points]
    for c in cands:
        points += [{**{k: v for k, v in m.items() if k != "warnings"},
                    "candidate": c.name, "operating_point": True} for m in c.confirms]
    return {
        "name": spec.name,
        "target_request_rate": spec.target_request_rate,
        "slo": spec.slo.model_dump(),
        "slo_text": spec.slo.describe(),
        "seeds": spec.seeds,
        "tolerance": spec.tolerance.model_dump(),
        "knee_warn": spec.knee_warn,
        "prices": prices,
        "candidates": rows,
        "recommended": rec["candidate"] if rec else None,
        "points": points,
        "notes": notes,
        "workload": get_path(cands[0].tree, "workload", {}) if cands else {},
    }


def _row(spec: PlanSpec, c: Candidate, prices: dict[str, dict], sizing: dict) -> dict:
    """One candidate's plan.csv row; ``sizing[name]`` gets the note on added replicas."""
    row: dict[str, Any] = {
        "candidate": c.name, "hardware": c.hardware, "tensor_parallel_size": c.tp,
        "pipeline_parallel_size": c.pp}
    for k, v in c.assign.items():
        if k not in ("hardware.name", "parallel.tensor_parallel_size",
                     "parallel.pipeline_parallel_size"):
            if isinstance(v, dict):  # a cluster shape: its name
                v = v.get("name") or "cluster"
            row[k.split(".")[-1]] = v
    row.update(fits=c.fits, reason=c.reason, num_gpu_blocks=c.num_gpu_blocks)
    gpr = c.gpus_per_replica or c.tp * c.pp
    price = prices.get(c.hardware)
    row["gpus_per_replica"] = gpr
    row["usd_per_gpu_hour"] = price["usd_per_gpu_hour"] if price else math.nan
    row["price_source"] = f"{price['source']} (as of {price['as_of']})" if price else ""
    mix = getattr(c, "cluster_gpus", None)
    if mix and len(mix) > 1:  # a cluster of several GPU kinds: the GPU-weighted price
        ps = [prices.get(h) for h in mix]
        row["usd_per_gpu_hour"] = (sum(p["usd_per_gpu_hour"] * n for p, n in zip(ps, mix.values()))
                                   / gpr if all(ps) else math.nan)
        row["price_source"] = "; ".join(f"{h}: {p['source']}" for h, p in zip(mix, ps) if p)
    if not c.fits:
        return row
    summ = summarize_searches(c.searches)
    cap = summ["capacity_rps"]
    row.update(capacity_rps=cap, ci_low=summ["ci_low"], ci_high=summ["ci_high"],
               capacity_per_seed=" ".join(f"{x:g}" for x in summ["per_seed"]),
               converged=summ["converged"], n_evals=summ["n_evals"], first_guess_rps=c.rate0)
    knee_pts = [p for p in c.points if p["passed"]]
    ref = max(knee_pts, key=lambda p: p["request_rate"]) if knee_pts else None
    mean_out = _nanmean([p.get("mean_output_len", math.nan) for p in c.points])
    row["mean_output_len"] = mean_out
    if cap > 0:
        cost = deployment_cost(spec.target_request_rate, cap, gpr, row["usd_per_gpu_hour"],
                               mean_out, replicas=c.replicas or None)
    else:
        cost = deployment_cost(spec.target_request_rate, 0.0, gpr, math.nan, mean_out)
        row["fits"] = False
        row["reason"] = _no_capacity(c, spec)
    row.update(cost)
    row["replicas_at_ci_low"] = (replicas_for(spec.target_request_rate, row["ci_low"])
                                 if row["ci_low"] and row["ci_low"] > 0 else math.nan)
    op = c.confirm or ref
    if ref is not None:
        row["knee_p99_ttft_ms"] = ref.get("p99_ttft_ms")
        row["knee_p99_tpot_ms"] = ref.get("p99_tpot_ms")
    if op is None:
        return row
    row["op_simulated"] = c.confirm is not None
    for k in _OP_KEYS:
        row[f"op_{k}"] = op.get(k, math.nan)
    row["op_meets_slo"] = bool(op.get("passed", False))
    row["slo_margin_pct"] = slo_margin(op, spec.slo)
    # vLLM plot_pareto: tokens/s/GPU = output_throughput / (tp·pp·dp);
    # tokens/s/user = output_throughput / user_count, user_count = concurrent requests
    otp = op.get("output_throughput", math.nan)
    users = op.get("max_concurrent_requests") or (
        op.get("request_rate", math.nan) * op.get("mean_e2el_ms", math.nan) / 1e3)
    row["output_throughput_per_replica"] = otp
    row["tokens_per_s_per_gpu"] = otp / gpr
    row["tokens_per_s_per_user"] = otp / users if users and users > 0 else math.nan
    if c.confirm is not None and not c.confirm["passed"]:
        row["fits"] = False
        row["reason"] = (f"its simulated operating point misses the SLO even with "
                         f"{_replicas(c.replicas)} ({human(op['request_rate'])} req/s each): "
                         + "; ".join(slo_misses(op, spec.slo)))
    elif c.replicas > c.min_replicas:
        missed = c.confirms[-2]
        sizing[c.name] = (
            f"{_replicas(c.replicas)}, not ceil(target / capacity) = {c.min_replicas}: with "
            f"{_replicas(c.replicas - 1)} ({human(missed['request_rate'])} req/s each) the "
            "simulated operating point missed " + "; ".join(slo_misses(missed, spec.slo)))
    return row


def _no_capacity(c: Candidate, spec: PlanSpec) -> str:
    """Why a candidate has no capacity: what the lowest rate simulated missed, and whether the
    search gave up at max_evals before reaching min_rps."""
    if not c.points:
        return "no point simulated"
    low = min(c.points, key=lambda p: p["request_rate"])
    misses = "; ".join(slo_misses(low, spec.slo)) or "the SLO"
    out = (f"SLO not met at the lowest rate simulated, {human(low['request_rate'])} req/s: "
           f"{misses}")
    if any(len(s.history) >= s.max_evals for s in c.searches.values()):
        out += f" (the search stopped at max_evals {spec.tolerance.max_evals})"
    return out


def _replicas(n: int) -> str:
    return f"{n} replica{'s' if n != 1 else ''}"


def _usable(r: dict) -> bool:
    return bool(r.get("fits")) and (r.get("capacity_rps") or 0) > 0 and math.isfinite(
        r.get("usd_per_hour", math.nan))


def _nanmean(xs: list[float]) -> float:
    a = np.asarray([x for x in xs if x is not None], dtype=float)
    a = a[np.isfinite(a)]
    return float(a.mean()) if len(a) else math.nan


def _warning(r: dict, spec: PlanSpec, sizing: str | None) -> str:
    w = [sizing] if sizing else []
    u = r.get("utilization_of_knee", math.nan)
    if math.isfinite(u) and u > spec.knee_warn:
        nxt = r["replicas"] + 1
        w.append(f"runs at {u:.0%} of its capacity (> {spec.knee_warn:.0%}): little headroom "
                 f"for bursts; {nxt} replicas would run at "
                 f"{spec.target_request_rate / nxt / r['capacity_rps']:.0%}")
    if r.get("replicas_at_ci_low") and r["replicas_at_ci_low"] > r.get("replicas", 0):
        w.append(f"at the CI's low end ({human(r['ci_low'])} req/s) "
                 f"{r['replicas_at_ci_low']} replicas are needed")
    if r.get("converged") is False:
        w.append("search hit max_evals before converging")
    return "; ".join(w)


def write_plan_outputs(result: dict, outdir: Path) -> None:
    """plan.csv (one row per candidate) and plan.json (everything), each written atomically."""
    import pandas as pd

    df = pd.DataFrame(result["candidates"])
    cols = [c for c in PLAN_COLUMNS if c in df.columns]
    cols += [c for c in df.columns if c not in cols]
    atomic_write_text(outdir / "plan.csv", df.reindex(columns=cols).to_csv(index=False))
    write_json(outdir / "plan.json", result)
