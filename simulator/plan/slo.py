"""The SLO verdict of one simulated point: latency percentiles, goodput, queue growth.

Latencies in ms (the vLLM bench schema's unit), rates per second. A point *passes* when every
SLO percentile is within its threshold, goodput is high enough (when asked) and the queue does
not grow (the offered load is sustained, not just survived for the length of the run).
"""

from __future__ import annotations

import math

import numpy as np
from servesim.simulator.plan.spec import PlanSLO, fmt_num, fmt_pct


def _pct(a: np.ndarray, q: float) -> float:
    a = a[np.isfinite(a)]
    return float(np.percentile(a, q)) if len(a) else math.nan


def point_metrics(requests: dict[str, np.ndarray], slo: PlanSLO, *, duration_s: float,
                  num_preemptions: float = 0.0) -> dict[str, float]:
    """Latency percentiles (ms), throughputs (per s) and the SLO verdict of one run.

    ``requests`` holds ``ttft_s``, ``tpot_s``, ``e2el_s`` (NaN where undefined),
    ``output_len``, ``prompt_len`` and ``finished_reason`` (as in ``RunResult.requests``).
    """
    reason = np.asarray(requests.get("finished_reason", []), dtype=object)
    ttft = np.asarray(requests["ttft_s"], dtype=float)
    tpot = np.asarray(requests["tpot_s"], dtype=float)
    e2el = np.asarray(requests["e2el_s"], dtype=float)
    n = len(ttft)
    done = np.isin(reason, ["stop", "length"]) if len(reason) == n else np.isfinite(e2el)
    out_len = np.asarray(requests.get("output_len", np.zeros(n)), dtype=float)
    in_len = np.asarray(requests.get("prompt_len", np.zeros(n)), dtype=float)
    q = slo.percentile
    m: dict[str, float] = {"num_requests": n, "completed": int(done.sum()),
                           "failed": int(n - done.sum())}
    for name, arr in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el)):
        a = arr[done] * 1e3
        m[f"mean_{name}_ms"] = float(np.nanmean(a)) if np.isfinite(a).any() else math.nan
        for p in (50, 90, 99):
            m[f"p{p}_{name}_ms"] = _pct(a, p)
        m[f"slo_p_{name}_ms"] = _pct(a, q)
    ok = done.copy()
    for name, arr, thr in (("ttft", ttft, slo.ttft_ms), ("tpot", tpot, slo.tpot_ms),
                           ("e2el", e2el, slo.e2el_ms)):
        if thr is not None:
            v = np.where(np.isfinite(arr), arr * 1e3, 0.0 if name == "tpot" else np.inf)
            ok &= v <= thr
    m["queue_growth"] = queue_growth(requests)
    dur = duration_s if duration_s > 0 else math.nan
    m["goodput_pct"] = 100.0 * ok.sum() / n if n else math.nan
    m["request_throughput"] = done.sum() / dur
    m["request_goodput"] = ok.sum() / dur
    m["output_throughput"] = out_len[done].sum() / dur
    m["total_token_throughput"] = (out_len[done].sum() + in_len[done].sum()) / dur
    m["mean_output_len"] = float(out_len[done].mean()) if done.any() else math.nan
    m["num_preemptions"] = float(num_preemptions)
    m["passed"] = slo_passed(m, slo)
    return m


def queue_growth(requests: dict[str, np.ndarray]) -> float:
    """Growth of the number of requests in the system (arrived, not finished) from the middle
    to the end of the arrival window [0, T], as a fraction of the arrivals in (T/2, T].

    About 0 for a load the replica sustains; about the overload fraction ε for an arrival rate
    (1 + ε) × capacity (the queue grows by ε·rate·T/2). NaN with fewer than 20 requests."""
    arr = np.asarray(requests.get("arrival_s", []), dtype=float)
    fin = np.asarray(requests.get("finish_s", np.full(len(arr), np.nan)), dtype=float)
    if len(arr) < 20:
        return math.nan
    fin = np.where(np.isfinite(fin), fin, np.inf)
    t_end = float(arr.max())
    t_mid = t_end / 2
    late = int(((arr > t_mid) & (arr <= t_end)).sum())
    if late == 0:
        return math.nan

    def in_system(t: float) -> int:
        return int(((arr <= t) & (fin > t)).sum())

    return (in_system(t_end) - in_system(t_mid)) / late


def slo_ratio(m: dict[str, float], slo: PlanSLO) -> float:
    """Worst metric / threshold over the SLOs (≤ 1 meets them all); for goodput the ratio of
    missed fractions (100 − goodput) / (100 − min_goodput_pct). NaN if nothing applies."""
    q = []
    for name, thr in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms), ("e2el", slo.e2el_ms)):
        v = m.get(f"slo_p_{name}_ms", math.nan)
        if thr is not None and v is not None and math.isfinite(v):
            q.append(v / thr)
    g = m.get("goodput_pct")
    if slo.min_goodput_pct is not None and g is not None and math.isfinite(g):
        q.append((100.0 - g) / max(1e-9, 100.0 - slo.min_goodput_pct))
    qg = m.get("queue_growth")
    if slo.max_queue_growth is not None and qg is not None and math.isfinite(qg):
        q.append(max(qg, 0.0) / slo.max_queue_growth)
    return max(q) if q else math.nan


def slo_passed(m: dict[str, float], slo: PlanSLO) -> bool:
    """True when the point meets every SLO (a NaN metric or a failed request fails it)."""
    if m.get("completed", 1) == 0:
        return False
    for name, thr in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms), ("e2el", slo.e2el_ms)):
        if thr is None:
            continue
        v = m.get(f"slo_p_{name}_ms", math.nan)
        if name == "tpot" and not math.isfinite(v):  # all outputs 1 token: no TPOT
            continue
        if not (v <= thr):
            return False
    if slo.min_goodput_pct is not None and not m.get("goodput_pct", 0.0) >= slo.min_goodput_pct:
        return False
    qg = m.get("queue_growth")
    return not (slo.max_queue_growth is not None and qg is not None and math.isfinite(qg)
                and qg > slo.max_queue_growth)


def slo_margin(m: dict, slo: PlanSLO) -> float:
    """Smallest relative headroom (%) of the SLO percentiles under their thresholds."""
    margins = []
    for name, thr in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms), ("e2el", slo.e2el_ms)):
        v = m.get(f"slo_p_{name}_ms", math.nan)
        if thr is not None and v is not None and math.isfinite(v):
            margins.append(100.0 * (thr - v) / thr)
    return min(margins) if margins else math.nan



def slo_misses(m: dict, slo: PlanSLO) -> list[str]:
    """What a point misses, for people: ``["P99 TPOT 61.1 ms > 60 ms", ...]`` (empty: none)."""
    p = fmt_pct(slo.percentile)
    out = []
    if m.get("completed", 1) == 0:
        out.append("no request completed")
    for name, thr in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms), ("e2el", slo.e2el_ms)):
        v = m.get(f"slo_p_{name}_ms", math.nan)
        if thr is not None and v is not None and math.isfinite(v) and v > thr:
            out.append(f"P{p} {name.upper()} {v:,.1f} ms > {fmt_num(thr)} ms")
    g = m.get("goodput_pct", math.nan)
    if slo.min_goodput_pct is not None and not g >= slo.min_goodput_pct:
        out.append(f"goodput {g:.1f}% < {fmt_num(slo.min_goodput_pct)}%")
    qg = m.get("queue_growth")
    if (slo.max_queue_growth is not None and qg is not None and math.isfinite(qg)
            and qg > slo.max_queue_growth):
        out.append(f"queue grows by {qg:.0%} of arrivals > {slo.max_queue_growth:.0%}")
    return out
