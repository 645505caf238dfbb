"""The rate search: the highest request rate (req/s) one replica sustains within the SLO.

Per seed, :class:`RateSearch` brackets the knee by doubling/halving from an analytic first
guess (:func:`first_guess_rps`), then bisects until the bracket's relative width is ≤
``rel_tol``; the capacity is where the SLO ratio crosses 1 inside the final bracket. Over seeds
the capacity is the mean with a Student-t 95% interval (:func:`capacity_interval`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from servesim.simulator.plan.slo import slo_passed, slo_ratio
from servesim.simulator.plan.spec import PlanSLO, PlanTolerance


def round_rate(r: float) -> float:
    """Round a rate to 4 significant digits (stable point names for --resume)."""
    if r <= 0 or not math.isfinite(r):
        return r
    return float(f"{r:.4g}")


@dataclass
class RateSearch:
    """Highest request rate (req/s) whose run meets the SLO, for one seed.

    Bracketing: start at ``rate0``; double while passing, halve while failing; then bisect
    between the highest passing rate ``lo`` and the lowest failing rate ``hi`` until
    ``(hi - lo) / hi ≤ rel_tol``. Assumes "passes" is monotone (decreasing) in the rate; a
    non-monotone answer only moves the bracket. ``capacity`` is ``lo`` (0 if nothing passed).
    """

    rate0: float
    rel_tol: float = 0.05
    max_evals: int = 14
    min_rate: float = 0.01
    max_rate: float = 1e5
    lo: float | None = None
    hi: float | None = None
    history: list[tuple[float, bool, float | None]] = field(default_factory=list)
    pending: float | None = None

    @property
    def done(self) -> bool:
        return self.propose() is None

    @property
    def converged(self) -> bool:
        return (self.lo is not None and self.hi is not None
                and (self.hi - self.lo) / self.hi <= self.rel_tol)

    @property
    def capacity(self) -> float:
        """Capacity estimate (req/s) in [lo, hi]: where the SLO ratio (metric / threshold,
        worst metric) crosses 1 by linear interpolation between the bracket ends; ``lo``
        when no ratio is known or nothing failed; 0 when nothing passed."""
        if self.lo is None:
            return 0.0
        if self.hi is None:
            return self.lo
        ratios = {r: q for r, _, q in self.history if q is not None and math.isfinite(q)}
        q_lo, q_hi = ratios.get(self.lo), ratios.get(self.hi)
        if q_lo is None or q_hi is None or not (q_hi > q_lo):
            return self.lo
        f = min(1.0, max(0.0, (1.0 - q_lo) / (q_hi - q_lo)))
        return self.lo + f * (self.hi - self.lo)

    def propose(self) -> float | None:
        """The next rate to simulate, or None when finished."""
        if len(self.history) >= self.max_evals:
            return None
        if self.lo is None and self.hi is None:
            return round_rate(self.rate0)
        if self.lo is None:  # everything failed so far: halve
            r = self.hi / 2
            return round_rate(r) if r >= self.min_rate else None
        if self.hi is None:  # everything passed so far: double
            r = self.lo * 2
            return round_rate(r) if r <= self.max_rate else None
        if self.converged:
            return None
        r = round_rate((self.lo + self.hi) / 2)
        if r <= self.lo or r >= self.hi:  # rounding cannot split further
            return None
        return r

    def update(self, rate: float, passed: bool, ratio: float | None = None) -> None:
        """Record a simulated rate; ``ratio`` is its :func:`slo_ratio` (≤ 1 passes)."""
        self.history.append((rate, bool(passed), ratio))
        if passed:
            self.lo = rate if self.lo is None else max(self.lo, rate)
            if self.hi is not None and self.hi <= self.lo:
                self.hi = None
        else:
            self.hi = rate if self.hi is None else min(self.hi, rate)
            if self.lo is not None and self.lo >= self.hi:
                self.lo = None


def capacity_interval(per_seed: list[float], brackets: list[tuple[float, float]] | None = None,
                      level: float = 0.95) -> tuple[float, float, float]:
    """(mean, ci_low, ci_high) of per-seed capacities (req/s), Student-t interval.

    With one seed the interval is that seed's final bracket [lo, hi] (or [lo, lo])."""
    x = np.asarray(per_seed, dtype=float)
    if len(x) == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if len(x) == 1:
        lo, hi = (brackets[0] if brackets else (mean, mean))
        return mean, float(lo), float(hi if hi is not None and math.isfinite(hi) else lo)
    half = float(t_quantile(0.5 + level / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return mean, max(0.0, mean - half), mean + half


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile(q: float, df: int) -> float:
    """Student-t quantile (scipy when installed; else a table for q = 0.975)."""
    try:
        from scipy import stats

        return float(stats.t.ppf(q, df))
    except ImportError:
        if abs(q - 0.975) > 1e-9:
            raise ValueError("without scipy only 95% intervals are available") from None
        return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.4 / df


EvalFn = Callable[[float, int], dict]


def search_capacity(evaluate: EvalFn, slo: PlanSLO, seeds: Iterable[int], rate0: float,
                    tol: PlanTolerance | None = None) -> dict[str, Any]:
    """Serial capacity search with an injected ``evaluate(rate, seed) -> metrics`` (metrics
    must contain the keys :func:`slo_passed` reads, or ``passed``). Returns
    ``{capacity_rps, ci_low, ci_high, per_seed, searches, points}``."""
    tol = tol or PlanTolerance()
    searches = {s: new_search(rate0, tol) for s in seeds}
    points = []
    for s, srch in searches.items():
        while (r := srch.propose()) is not None:
            m = dict(evaluate(r, s))
            passed = m["passed"] if "passed" in m else slo_passed(m, slo)
            m.update(request_rate=r, seed=s, passed=passed)
            points.append(m)
            srch.update(r, passed, slo_ratio(m, slo))
    return summarize_searches(searches) | {"points": points}


def new_search(rate0: float, tol: PlanTolerance) -> RateSearch:
    return RateSearch(rate0=rate0, rel_tol=tol.rel_width, max_evals=tol.max_evals,
                      min_rate=tol.min_rps, max_rate=tol.max_rps)


def summarize_searches(searches: dict[int, RateSearch]) -> dict[str, Any]:
    """Capacity (req/s) of one candidate over its seeds: mean, 95% CI, convergence, evals."""
    per_seed = [s.capacity for s in searches.values()]
    brackets = [(s.lo or 0.0, s.hi if s.hi is not None else s.capacity)
                for s in searches.values()]
    mean, lo, hi = capacity_interval(per_seed, brackets)
    return {"capacity_rps": mean, "ci_low": lo, "ci_high": hi, "per_seed": per_seed,
            "converged": all(s.converged for s in searches.values()),
            "n_evals": sum(len(s.history) for s in searches.values()), "searches": searches}


# ---------------------------------------------------------------------------------------------
# Analytic first guess


def mean_lengths(wl: Any) -> tuple[float, float]:
    """Mean (prompt, output) tokens of a workload section (random or synthetic); fallbacks
    1024 / 128 for kinds whose lengths are only known after reading a trace."""
    def dist_mean(d: Any, default: float) -> float:
        kind = getattr(d, "dist", None)
        if kind == "fixed":
            return float(d.value)
        if kind == "uniform":
            return (float(d.low) + float(d.high)) / 2
        if kind == "lognormal":
            m = float(d.median) * math.exp(float(d.sigma) ** 2 / 2)
            return min(m, float(d.max)) if d.max else m
        if kind == "exponential":
            return float(d.mean)
        return default

    if getattr(wl, "kind", None) == "random":
        return float(wl.input_len + wl.prefix_len), float(wl.output_len)
    if getattr(wl, "kind", None) == "synthetic":
        return dist_mean(wl.input, 1024.0), dist_mean(wl.output, 128.0)
    return 1024.0, 128.0


def first_guess_rps(cfg: Any, mem: Any = None) -> float:
    """A rough per-replica capacity (req/s) to start bracketing from (roofline, no queueing).

    Per request: prefill = 2 · active params · prompt tokens FLOPs at 50% of peak; decode in a
    batch of 64 = one weight read per step (at 80% of HBM bandwidth, plus what
    ``cpu_offload_gb`` offloaded per GPU, over the host link) shared by 64 requests, for each
    output token. Both share the GPUs, so times add; the guess is 70% of 1 / total.
    Any missing ingredient falls back to 1 req/s: the doubling/halving bracket fixes the rest.
    """
    try:
        from servesim.costmodels import load_hardware_spec, load_model_spec

        hw = load_hardware_spec(cfg.hardware)
        spec = load_model_spec(cfg.model)
        gpus = cfg.parallel.tensor_parallel_size * cfg.parallel.pipeline_parallel_size
        prompt, out = mean_lengths(cfg.workload)
        params = float(spec.num_active_params)
        prefill_s = 2 * params * prompt / (hw.peak_flops("bf16") * gpus * 0.5)
        weight_read_s = params * spec.dtype_bytes / (hw.mem_bw * gpus * 0.8)
        # --cpu-offload-gb: every step also reads what each GPU offloaded over its host link
        off = (getattr(mem, "cpu_offload_bytes", 0) if mem is not None
               else min(getattr(cfg, "cpu_offload_gb", 0.0) * 2**30,
                        params * spec.dtype_bytes / gpus))
        weight_read_s += off / (hw.pcie_bw_gbps * 1e9)
        decode_s = out * (weight_read_s + 0.003) / 64
        guess = 0.7 / (prefill_s + decode_s)
        return guess if math.isfinite(guess) and guess > 0 else 1.0
    except Exception:  # noqa: BLE001 - only a starting point
        return 1.0

