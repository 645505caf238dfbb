"""Capacity planning: ``simulate plan PLAN.yaml -o DIR``.

For every candidate deployment of the search space (GPU × TP × PP × scheduler knobs ...):

1. check it fits (``resolve_config`` + ``costmodels.plan_memory``; a ``CapacityError`` or
   ``ConfigError`` skips it with the reason);
2. find, per seed, the maximum sustainable request rate of one replica that meets the SLOs
   (:class:`RateSearch`: bracket by doubling/halving from an analytic first guess, then bisect
   until the bracket's relative width is ≤ ``rel_tol``); the capacity is the mean of the
   per-seed capacities with a Student-t 95% confidence interval;
3. size it: replicas = ceil(target / capacity) independent data-parallel replicas,
   GPUs = replicas × tp × pp, ``$/h = GPUs × price``,
   ``$/1M output tokens = $/h / (output tokens/s × 3600) × 1e6`` (ecosystem-formats §5);
4. optionally simulate the operating point (target / replicas per replica) to report the
   margin to the SLO there;
5. rank by $/h, mark the Pareto set (tokens/s/GPU vs tokens/s/user) and warn when the
   recommended deployment runs above ``knee_warn`` (0.85) of its capacity.

Units: request rates in requests/s, latencies in ms (as in the vLLM bench schema), money in USD.
Every simulated point is written as ``DIR/points/SERVE-<candidate>-BENCH-<rate>/run=<seed>.json``
(the ``vllm bench sweep`` layout) and reused by ``--resume``.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, field_validator
from servesim.simulator.errors import ConfigError, ServesimError

# ---------------------------------------------------------------------------------------------
# Plan file schema


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlanSLO(_Section):
    """Per-request SLO thresholds (ms) and how many requests must meet them.

    A rate *meets the SLO* when, for every threshold given, the ``percentile``-th percentile of
    that metric over the requests is ≤ the threshold, and (when ``min_goodput_pct`` is given)
    at least that percentage of all requests meet every threshold at once (vLLM's
    ``--goodput`` definition; TPOT of 1-token requests counts as 0).
    """

    ttft_ms: PositiveFloat | None = None
    tpot_ms: PositiveFloat | None = None
    e2el_ms: PositiveFloat | None = None
    percentile: float = Field(99.0, gt=0, le=100)
    min_goodput_pct: float | None = Field(None, gt=0, le=100)
    max_queue_growth: float | None = Field(
        0.1, gt=0, description="Stability: requests in the system may grow by at most this "
        "fraction of the arrivals over the second half of the arrival window (None: no check)")

    def describe(self) -> str:
        p = _fmt_pct(self.percentile)
        parts = [f"P{p} {name.upper()} ≤ {_fmt_num(v)} ms"
                 for name, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms),
                                 ("e2el", self.e2el_ms)) if v is not None]
        if self.min_goodput_pct is not None:
            parts.append(f"goodput ≥ {_fmt_num(self.min_goodput_pct)}%")
        return ", ".join(parts) or "no SLO"


class PlanTolerance(_Section):
    rel_width: float = Field(0.05, gt=0, lt=1,
                             description="Stop bisecting when (hi - lo) / hi ≤ this")
    max_evals: PositiveInt = Field(14, description="Simulations per (candidate, seed) at most")
    first_guess_rps: PositiveFloat | None = Field(
        None, description="Start of the bracketing (default: an analytic roofline guess)")
    min_rps: PositiveFloat = Field(0.01, description="Below this the SLO is deemed unreachable")
    max_rps: PositiveFloat = Field(1e5, description="Stop doubling above this")


AXIS_ALIASES = {
    "hardware": "hardware.name",
    "gpu": "hardware.name",
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "tp": "parallel.tensor_parallel_size",
    "pipeline_parallel_size": "parallel.pipeline_parallel_size",
    "pp": "parallel.pipeline_parallel_size",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "policy": "scheduler.policy",
    "scheduler_policy": "scheduler.policy",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "gpu_memory_utilization": "cache.gpu_memory_utilization",
    "cache_dtype": "cache.cache_dtype",
    "quantization": "model.quantization",
    "async_scheduling": "scheduler.async_scheduling",
}

AXIS_SHORT = {
    "hardware.name": "", "parallel.tensor_parallel_size": "tp",
    "parallel.pipeline_parallel_size": "pp", "scheduler.max_num_seqs": "mns", "model.name": "",
    "scheduler.max_num_batched_tokens": "mbt", "scheduler.policy": "",
}


class PlanSpec(_Section):
    """A capacity plan (``configs/plans/*.yaml``)."""

    name: str = "plan"
    base: str | dict | None = Field(
        None, description="Experiment config: a path (relative to the plan file) or a mapping")
    set: list[str] = Field(default_factory=list, description="--set overrides on the base")
    workload: dict | None = Field(None, description="Replaces the base's workload section")
    slo: PlanSLO
    target_request_rate: PositiveFloat = Field(description="Total traffic to serve, req/s")
    search: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="Axis → values; axes are config key paths or aliases (hardware, "
        "tensor_parallel_size, pipeline_parallel_size, max_num_seqs, max_num_batched_tokens, "
        "policy ...). null keeps the base / vLLM default.")
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])
    tolerance: PlanTolerance = PlanTolerance()
    min_duration_s: float | None = Field(
        60.0, gt=0, description="Raise num_prompts (num_sessions) to rate × this, so every "
        "point offers a sustained load and not a short burst (random/synthetic/sessions)")
    max_prompts: PositiveInt = Field(20000, description="Cap of that raise")
    confirm: bool = Field(True, description="Simulate each candidate at its operating point")
    knee_warn: float = Field(0.85, gt=0, le=1,
                             description="Warn when operating rate / capacity exceeds this")
    prices: str | None = Field(None, description="Price file (default configs/prices.yaml)")

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v):
        if not v:
            raise ValueError("at least one seed is needed")
        return v

    def axes(self) -> dict[str, list[Any]]:
        return {AXIS_ALIASES.get(k, k): list(v) for k, v in self.search.items()}


def load_plan(path: str | Path) -> tuple[PlanSpec, Path]:
    """Read and validate a plan YAML; return it and the folder relative paths resolve from."""
    from pydantic import ValidationError
    from servesim.simulator.config import load_yaml

    p = Path(path)
    tree = load_yaml(p)
    try:
        return PlanSpec.model_validate(tree), p.resolve().parent
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise ConfigError(f"{p}: {loc}: {err['msg']}") from None


# ---------------------------------------------------------------------------------------------
# SLO check on one simulated point


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


# ---------------------------------------------------------------------------------------------
# Rate search (one per candidate and seed)


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
    searches = {s: _new_search(rate0, tol) for s in seeds}
    points = []
    for s, srch in searches.items():
        while (r := srch.propose()) is not None:
            m = dict(evaluate(r, s))
            passed = m["passed"] if "passed" in m else slo_passed(m, slo)
            m.update(request_rate=r, seed=s, passed=passed)
            points.append(m)
            srch.update(r, passed, slo_ratio(m, slo))
    return _summarize(searches) | {"points": points}


def _new_search(rate0: float, tol: PlanTolerance) -> RateSearch:
    return RateSearch(rate0=rate0, rel_tol=tol.rel_width, max_evals=tol.max_evals,
                      min_rate=tol.min_rps, max_rate=tol.max_rps)


def _summarize(searches: dict[int, RateSearch]) -> dict[str, Any]:
    per_seed = [s.capacity for s in searches.values()]
    brackets = [(s.lo or 0.0, s.hi if s.hi is not None else s.capacity)
                for s in searches.values()]
    mean, lo, hi = capacity_interval(per_seed, brackets)
    return {"capacity_rps": mean, "ci_low": lo, "ci_high": hi, "per_seed": per_seed,
            "converged": all(s.converged for s in searches.values()),
            "n_evals": sum(len(s.history) for s in searches.values()), "searches": searches}


# ---------------------------------------------------------------------------------------------
# Cost


def load_prices(path: str | Path | None = None) -> dict[str, dict]:
    """GPU name → {usd_per_gpu_hour, source, as_of} from a price YAML (configs/prices.yaml)."""
    import yaml

    p = Path(path) if path else Path(__file__).resolve().parent.parent / "configs" / "prices.yaml"
    if not p.is_file():
        from importlib import resources

        try:
            p = Path(str(resources.files("servesim.configs").joinpath("prices.yaml")))
        except (ModuleNotFoundError, FileNotFoundError):
            raise ConfigError(f"{path or 'prices.yaml'}: price file not found") from None
    tree = yaml.safe_load(p.read_text()) or {}
    gpus = tree.get("gpus")
    if not isinstance(gpus, dict):
        raise ConfigError(f"{p}: expected a 'gpus:' mapping of name → {{usd_per_gpu_hour, ...}}")
    out = {}
    for name, v in gpus.items():
        if not isinstance(v, dict) or "usd_per_gpu_hour" not in v:
            raise ConfigError(f"{p}: gpus.{name}: expected usd_per_gpu_hour, source, as_of")
        out[str(name)] = {"usd_per_gpu_hour": float(v["usd_per_gpu_hour"]),
                          "source": str(v.get("source", "")), "as_of": str(v.get("as_of", ""))}
    return out


def deployment_cost(target_rps: float, capacity_rps: float, gpus_per_replica: int,
                    usd_per_gpu_hour: float, mean_output_len: float) -> dict[str, float]:
    """Size and price a deployment of independent replicas (ecosystem-formats §5).

    replicas = ceil(target / capacity); GPUs = replicas × gpus_per_replica;
    $/h = GPUs × price; output tokens/s = target × mean output length;
    $/1M output tokens = $/h / (output tokens/s × 3600) × 1e6;
    utilization_of_knee = (target / replicas) / capacity.
    """
    if not (capacity_rps > 0):
        return {"replicas": math.nan, "gpus": math.nan, "usd_per_hour": math.nan,
                "usd_per_1m_output_tokens": math.nan, "operating_rps_per_replica": math.nan,
                "utilization_of_knee": math.nan}
    replicas = math.ceil(target_rps / capacity_rps - 1e-9)
    gpus = replicas * gpus_per_replica
    usd_h = gpus * usd_per_gpu_hour
    out_tps = target_rps * mean_output_len
    per_1m = usd_h / (out_tps * 3600.0) * 1e6 if out_tps > 0 else math.nan
    op = target_rps / replicas
    return {"replicas": replicas, "gpus": gpus, "usd_per_hour": usd_h,
            "usd_per_1m_output_tokens": per_1m, "operating_rps_per_replica": op,
            "utilization_of_knee": op / capacity_rps}


def pareto_mask(x: Iterable[float], y: Iterable[float]) -> np.ndarray:
    """Points not dominated when maximizing both x and y (NaNs never on the front)."""
    x = np.asarray(list(x), dtype=float)
    y = np.asarray(list(y), dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    mask = np.zeros(len(x), dtype=bool)
    for i in np.flatnonzero(ok):
        dom = ok & (x >= x[i]) & (y >= y[i]) & ((x > x[i]) | (y > y[i]))
        mask[i] = not dom.any()
    return mask


# ---------------------------------------------------------------------------------------------
# Candidates


def _fmt_num(v: float) -> str:
    return f"{v:g}"


def _fmt_pct(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else f"{p:g}"


def set_path(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = node[p] = {}
        node = nxt
    if value is None:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value


def get_path(tree: dict, dotted: str, default: Any = None) -> Any:
    node: Any = tree
    for p in dotted.split("."):
        if not isinstance(node, dict) or p not in node:
            return default
        node = node[p]
    return node


def candidate_name(assign: dict[str, Any]) -> str:
    """Short, file-safe name: ``h100-sxm_tp1_pp1_mns256``; null values are omitted."""
    parts = []
    for k, v in assign.items():
        if v is None:
            continue
        short = AXIS_SHORT.get(k, k.split(".")[-1])
        s = f"{short}{v}" if short else str(v)
        parts.append("".join(c if c.isalnum() or c in "-." else "-" for c in s))
    return "_".join(parts) or "base"


def base_tree(spec: PlanSpec, plan_dir: Path) -> dict:
    """The experiment config tree every candidate starts from (base + set + workload)."""
    from servesim.simulator.config import apply_overrides, load_yaml

    if spec.base is None:
        tree: dict = {}
    elif isinstance(spec.base, dict):
        tree = copy.deepcopy(spec.base)
    else:
        p = Path(spec.base)
        if not p.is_absolute():
            cands = [plan_dir / p, Path.cwd() / p]
            p = next((c for c in cands if c.is_file()), cands[0])
        tree = load_yaml(p)
    if spec.set:
        tree = apply_overrides(tree, spec.set)
    if spec.workload is not None:
        tree["workload"] = copy.deepcopy(spec.workload)
    set_path(tree, "parallel.data_parallel_size", 1)  # capacity is per replica
    # plan SLO → config SLO (so result.json carries request_goodput)
    slo = {k: getattr(spec.slo, k) for k in ("ttft_ms", "tpot_ms", "e2el_ms")
           if getattr(spec.slo, k) is not None}
    if slo:
        tree["slo"] = {**(tree.get("slo") or {}), **slo}
    return tree


def expand_candidates(spec: PlanSpec, tree: dict) -> list[tuple[str, dict[str, Any], dict]]:
    """Cartesian product of the search axes → [(name, assignment, config tree)]."""
    axes = spec.axes()
    keys = list(axes)
    out = []
    seen = set()
    for values in itertools.product(*(axes[k] for k in keys)) if keys else [()]:
        assign = dict(zip(keys, values))
        t = copy.deepcopy(tree)
        for k, v in assign.items():
            set_path(t, k, v)
        name = candidate_name(assign)
        while name in seen:
            name += "_"
        seen.add(name)
        out.append((name, assign, t))
    return out


# ---------------------------------------------------------------------------------------------
# Evaluation of one point by the real simulator (picklable; runs in worker processes)


def _point_path(points_dir: Path, cand: str, rate: float, seed: int) -> Path:
    """``points/SERVE-<candidate>-BENCH-<rate>/run=<seed>.json`` (the sweep layout)."""
    try:
        from servesim.simulator.sweep import fmt_rate
    except ImportError:  # pragma: no cover
        fmt_rate = _fmt_num
    return points_dir / f"SERVE-{cand}-BENCH-{fmt_rate(rate)}" / f"run={seed}.json"


def write_points_summary(points_dir: Path) -> None:
    """``points/summary.csv``: one row per run file (arm = candidate), like a sweep's."""
    import pandas as pd

    rows = []
    for p in sorted(points_dir.glob("SERVE-*/run=*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        rows.append({k: v for k, v in d.items() if not isinstance(v, (list, dict))})
    if not rows:
        return
    df = pd.DataFrame(rows)
    lead = [c for c in ("arm", "request_rate", "seed", "run_number") if c in df]
    df = df[lead + [c for c in df.columns if c not in lead]]
    df = df.sort_values([c for c in ("arm", "request_rate", "seed") if c in df])
    tmp = points_dir / ".summary.csv.tmp"
    df.to_csv(tmp, index=False)
    os.replace(tmp, points_dir / "summary.csv")


def _atomic_write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default, allow_nan=True))
    os.replace(tmp, path)


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, np.bool_):
        return bool(o)
    return str(o)


def point_hash(tree: dict, rate: float, seed: int, slo: dict) -> str:
    """Identity of a simulated point (config tree, rate, seed, SLO) for ``--resume``."""
    import hashlib

    blob = json.dumps([tree, float(rate), int(seed), slo], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def read_point(path: Path, expect_hash: str | None = None) -> dict | None:
    """The ``plan_point`` metrics stored in a finished point file (None when missing, or
    written for another definition of the point)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if expect_hash is not None and d.get("plan_point_hash") != expect_hash:
        return None
    return d.get("plan_point")


def resolve_tree(tree: dict, source: str):
    """Validate + resolve a config tree; the memory plan is computed (may raise)."""
    from servesim.simulator.config import validate_tree

    cfg = validate_tree(copy.deepcopy(tree), source)
    try:
        from servesim.simulator.config import resolve_config
    except ImportError:  # engine not there yet
        return cfg, None
    cfg = resolve_config(cfg)
    mem = None
    try:
        from servesim.costmodels import plan_memory
    except ImportError:
        plan_memory = None
    if plan_memory is not None:
        mem = plan_memory(cfg)
    return cfg, mem


def rate_key(tree: dict) -> str:
    """The config key that sets the offered rate: ``workload.session_rate`` for sessions
    (sessions/s), else ``workload.request_rate`` (req/s; trace workloads are rescaled)."""
    kind = get_path(tree, "workload.kind", "random")
    return "workload.session_rate" if kind == "sessions" else "workload.request_rate"


def sustained_tree(tree: dict, rate: float, min_duration_s: float | None,
                   max_prompts: int) -> dict:
    """``tree`` with num_prompts (num_sessions) raised to ceil(rate × min_duration_s), capped at
    ``max_prompts``, so the arrival window lasts at least ``min_duration_s`` seconds."""
    if not min_duration_s:
        return tree
    kind = get_path(tree, "workload.kind", "random")
    key = {"random": "workload.num_prompts", "synthetic": "workload.num_prompts",
           "sessions": "workload.num_sessions"}.get(kind)
    if key is None:
        return tree
    n0 = int(get_path(tree, key, 1000))
    n = min(max(n0, math.ceil(rate * min_duration_s)), max(max_prompts, n0))
    if n == n0:
        return tree
    t = copy.deepcopy(tree)
    set_path(t, key, n)
    return t


def evaluate_point(tree: dict, rate: float, seed: int, slo: dict, cand: str,
                   points_dir: str) -> dict:
    """Simulate one (candidate, rate, seed) point; write its run file; return its metrics."""
    from servesim.simulator.config import validate_tree
    from servesim.simulator.runner import run_experiment

    t = copy.deepcopy(tree)
    set_path(t, rate_key(t), float(rate))
    set_path(t, "workload.seed", int(seed))
    cfg = validate_tree(t, f"plan point {cand} @ {rate} req/s")
    try:
        from servesim.simulator.config import resolve_config

        cfg = resolve_config(cfg)
    except ImportError:
        pass
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_experiment(cfg)
    plan_slo = PlanSLO.model_validate(slo)
    m = point_metrics(res.requests, plan_slo, duration_s=res.duration_s,
                      num_preemptions=res.counters.get("num_preemptions", 0.0))
    m["max_kv_cache_usage_perc"] = _max_of(res.steps.get("vllm:kv_cache_usage_perc"))
    m["max_num_requests_running"] = _max_of(res.steps.get("vllm:num_requests_running"))
    m["num_gpu_blocks"] = res.counters.get("num_gpu_blocks", math.nan)
    m.update(request_rate=float(rate), seed=int(seed), candidate=cand,
             warnings=sorted({f"{w.category.__name__}: {w.message}" for w in caught}))
    try:
        from servesim.reports.bench_result import compute_bench_result

        bench = dict(compute_bench_result(res))
    except ImportError:
        bench = {"request_rate": float(rate)}
    for k in ("wall_seconds", "sim_speed"):  # host timings: keep point files deterministic
        bench.pop(k, None)
    if "max_concurrent_requests" in bench and bench["max_concurrent_requests"] is not None:
        m["max_concurrent_requests"] = float(bench["max_concurrent_requests"])
    bench.update(arm=cand, seed=int(seed), run_number=int(seed), plan_candidate=cand,
                 plan_point_hash=point_hash(tree, rate, seed, slo), plan_point=m)
    _atomic_write_json(_point_path(Path(points_dir), cand, rate, seed), bench)
    return m


def _max_of(a) -> float:
    if a is None or len(a) == 0:
        return math.nan
    return float(np.nanmax(np.asarray(a, dtype=float)))


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
    batch of 64 = one weight read per step (at 80% of HBM bandwidth) shared by 64 requests, for
    each output token. Both share the GPUs, so times add; the guess is 70% of 1 / total.
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
        decode_s = out * (weight_read_s + 0.003) / 64
        guess = 0.7 / (prefill_s + decode_s)
        return guess if math.isfinite(guess) and guess > 0 else 1.0
    except Exception:  # noqa: BLE001 - only a starting point
        return 1.0


# ---------------------------------------------------------------------------------------------
# Executors (inline / local processes / ray) for adaptive, dynamic submission


class _DoneFuture:
    def __init__(self, fn, args):
        try:
            self._v, self._e = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._v, self._e = None, e

    def result(self):
        if self._e is not None:
            raise self._e
        return self._v


class _Pool:
    """submit(fn, *args) → handle; wait_any() → list of finished handles."""

    def __init__(self, jobs: int, backend: str):
        self.kind = "inline" if jobs == 1 and backend == "local" else backend
        self.pending: list = []
        if self.kind == "local":
            from joblib.externals.loky import get_reusable_executor

            self.ex = get_reusable_executor(max_workers=jobs, timeout=60)
        elif self.kind == "ray":
            try:
                import ray
            except ImportError:
                raise ConfigError("--backend ray: ray is not installed "
                                  "(pip install 'servesim[cluster]')") from None
            if not ray.is_initialized():
                ray.init(num_cpus=jobs if jobs > 0 else None, ignore_reinit_error=True,
                         log_to_driver=False)
            self.ray = ray
            self._remote = {}
        elif self.kind != "inline":
            raise ConfigError(f"--backend {backend}: expected local or ray")

    def submit(self, fn, *args):
        if self.kind == "inline":
            h = _DoneFuture(fn, args)
        elif self.kind == "local":
            h = self.ex.submit(fn, *args)
        else:
            rf = self._remote.get(fn)
            if rf is None:
                rf = self._remote[fn] = self.ray.remote(fn)
            h = rf.remote(*args)
        self.pending.append(h)
        return h

    def result(self, h):
        if self.kind == "ray":
            return self.ray.get(h)
        return h.result()

    def wait_any(self) -> list:
        if not self.pending:
            return []
        if self.kind == "inline":
            done = list(self.pending)
        elif self.kind == "local":
            from concurrent.futures import FIRST_COMPLETED, wait

            done = list(wait(self.pending, return_when=FIRST_COMPLETED).done)
        else:
            done, _ = self.ray.wait(self.pending, num_returns=1)
        for h in done:
            self.pending.remove(h)
        return done


# ---------------------------------------------------------------------------------------------
# The plan driver


@dataclass
class Candidate:
    name: str
    assign: dict[str, Any]
    tree: dict
    fits: bool = False
    reason: str = ""
    hardware: str = ""
    tp: int = 1
    pp: int = 1
    num_gpu_blocks: float = math.nan
    rate0: float = 1.0
    searches: dict[int, RateSearch] = field(default_factory=dict)
    points: list[dict] = field(default_factory=list)
    confirm: dict | None = None


def run_plan(spec: PlanSpec, plan_dir: Path, outdir: str | Path, *, jobs: int = 1,
             backend: str = "local", resume: bool = False, quiet: bool = False,
             evaluate: Callable[..., dict] | None = None, fit_check: Callable | None = None,
             write_report: bool = True,
             log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run a capacity plan; write plan.csv, plan.json, points/, report.md, report.html.

    ``evaluate`` (default :func:`evaluate_point`) has :func:`evaluate_point`'s signature and
    ``fit_check`` (default :func:`resolve_tree`) maps (tree, source) → (cfg, memory plan) or
    raises; tests inject fast synthetic ones. Returns the plan.json dict.
    """
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    points_dir = outdir / "points"
    evaluate = evaluate or evaluate_point
    log = log or (lambda s: None)
    wall0 = time.perf_counter()
    tree = base_tree(spec, plan_dir)
    prices = load_prices(_resolve_rel(spec.prices, plan_dir) if spec.prices else None)
    slo_d = spec.slo.model_dump()

    cands = [Candidate(n, a, t) for n, a, t in expand_candidates(spec, tree)]
    for c in cands:
        _check_fit(c, spec, fit_check or resolve_tree)
        if not c.fits:
            log(f"skip {c.name}: {c.reason}")
            continue
        c.searches = {s: _new_search(c.rate0, spec.tolerance) for s in spec.seeds}

    pool = _Pool(max(1, jobs if jobs > 0 else (os.cpu_count() or 1)), backend)
    inflight: dict[Any, tuple[Candidate, int, float, str]] = {}

    def submit_next(c: Candidate, seed: int) -> None:
        srch = c.searches[seed]
        r = srch.propose()
        if r is None:
            return
        tree = sustained_tree(c.tree, r, spec.min_duration_s, spec.max_prompts)
        path = _point_path(points_dir, c.name, r, seed)
        cached = read_point(path, point_hash(tree, r, seed, slo_d)) if resume else None
        if cached is not None:
            cached["passed"] = slo_passed(cached, spec.slo)
            _record(c, seed, r, cached, progress_cb, spec.slo)
            submit_next(c, seed)
            return
        h = pool.submit(evaluate, tree, r, seed, slo_d, c.name, str(points_dir))
        inflight[h] = (c, seed, r, "search")

    def submit_confirm(c: Candidate) -> None:
        cap, _, _ = capacity_interval([s.capacity for s in c.searches.values()])
        if not (cap > 0) or not spec.confirm:
            return
        replicas = math.ceil(spec.target_request_rate / cap - 1e-9)
        r = round_rate(spec.target_request_rate / replicas)
        seed = spec.seeds[0]
        tree = sustained_tree(c.tree, r, spec.min_duration_s, spec.max_prompts)
        path = _point_path(points_dir, c.name, r, seed)
        cached = read_point(path, point_hash(tree, r, seed, slo_d)) if resume else None
        if cached is not None:
            cached["passed"] = slo_passed(cached, spec.slo)
            c.confirm = cached
            return
        h = pool.submit(evaluate, tree, r, seed, slo_d, c.name, str(points_dir))
        inflight[h] = (c, seed, r, "confirm")

    progress, task = _progress(quiet, sum(len(c.searches) for c in cands) * 6)

    def progress_cb() -> None:
        if progress is not None:
            done = sum(len(s.history) for c in cands for s in c.searches.values())
            left = sum(0 if s.done else 3 for c in cands for s in c.searches.values())
            progress.update(task, completed=done, total=done + left + len(inflight))

    try:
        for c in cands:
            for seed in c.searches:
                submit_next(c, seed)
            if c.searches and all(s.done for s in c.searches.values()):
                submit_confirm(c)
        while pool.pending:
            for h in pool.wait_any():
                c, seed, r, what = inflight.pop(h)
                try:
                    m = pool.result(h)
                except ServesimError as e:  # e.g. the engine rejects the config at run time
                    c.fits, c.reason = False, f"{type(e).__name__}: {e}"
                    log(f"skip {c.name}: {c.reason}")
                    for s in c.searches.values():
                        s.max_evals = len(s.history)
                    continue
                m["passed"] = slo_passed(m, spec.slo)
                if what == "confirm":
                    c.confirm = m
                    continue
                _record(c, seed, r, m, progress_cb, spec.slo)
                submit_next(c, seed)
                if all(s.done for s in c.searches.values()) and not any(
                        v[0] is c for v in inflight.values()):
                    submit_confirm(c)
            progress_cb()
    finally:
        if progress is not None:
            progress.stop()

    result = summarize_plan(spec, cands, prices)
    result["wall_seconds"] = time.perf_counter() - wall0
    result["jobs"] = jobs
    result["backend"] = backend
    write_plan_outputs(result, outdir)
    if points_dir.is_dir():
        write_points_summary(points_dir)
    if write_report:
        from servesim.reports.render import write_report as _write_report

        _write_report(outdir)
    return result


def _resolve_rel(p: str, plan_dir: Path) -> Path:
    q = Path(p)
    if q.is_absolute() or q.is_file():
        return q
    return plan_dir / q


def _record(c: Candidate, seed: int, r: float, m: dict, progress_cb, slo: PlanSLO) -> None:
    m = dict(m)
    m.update(request_rate=r, seed=seed, candidate=c.name, slo_ratio=slo_ratio(m, slo))
    c.points.append(m)
    c.searches[seed].update(r, bool(m["passed"]), m["slo_ratio"])
    progress_cb()


def _progress(quiet: bool, total: int):
    if quiet:
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    p = Progress(TextColumn("plan: simulated points"), BarColumn(), MofNCompleteColumn(),
                 TimeElapsedColumn(), transient=False)
    p.start()
    return p, p.add_task("plan", total=max(1, total))


def _check_fit(c: Candidate, spec: PlanSpec, fit_check: Callable) -> None:
    c.hardware = str(get_path(c.tree, "hardware.name", "a100-sxm4-80gb"))
    c.tp = int(get_path(c.tree, "parallel.tensor_parallel_size", 1) or 1)
    c.pp = int(get_path(c.tree, "parallel.pipeline_parallel_size", 1) or 1)
    try:
        cfg, mem = fit_check(c.tree, f"plan candidate {c.name}")
    except ServesimError as e:
        c.fits, c.reason = False, f"{type(e).__name__}: {e}"
        return
    if cfg is not None:
        c.hardware = str(cfg.hardware.name)
        c.tp = int(cfg.parallel.tensor_parallel_size)
        c.pp = int(cfg.parallel.pipeline_parallel_size)
    c.num_gpu_blocks = float(getattr(mem, "num_gpu_blocks", math.nan) or math.nan)
    c.fits, c.reason = True, ""
    c.rate0 = float(spec.tolerance.first_guess_rps or first_guess_rps(cfg, mem))


def summarize_plan(spec: PlanSpec, cands: list[Candidate], prices: dict[str, dict]) -> dict:
    """Capacities, sizing, cost, Pareto flags, ranking and the recommendation."""
    rows = []
    for c in cands:  # completion order varies with --jobs: sort for deterministic outputs
        c.points.sort(key=lambda p: (p["seed"], p["request_rate"]))
    for c in cands:
        row: dict[str, Any] = {
            "candidate": c.name, "hardware": c.hardware, "tensor_parallel_size": c.tp,
            "pipeline_parallel_size": c.pp}
        for k, v in c.assign.items():
            if k not in ("hardware.name", "parallel.tensor_parallel_size",
                         "parallel.pipeline_parallel_size"):
                row[k.split(".")[-1]] = v
        row.update(fits=c.fits, reason=c.reason, num_gpu_blocks=c.num_gpu_blocks)
        gpr = c.tp * c.pp
        price = prices.get(c.hardware)
        row["gpus_per_replica"] = gpr
        row["usd_per_gpu_hour"] = price["usd_per_gpu_hour"] if price else math.nan
        row["price_source"] = f"{price['source']} (as of {price['as_of']})" if price else ""
        if not c.fits:
            rows.append(row)
            continue
        summ = _summarize(c.searches)
        cap = summ["capacity_rps"]
        row.update(capacity_rps=cap, ci_low=summ["ci_low"], ci_high=summ["ci_high"],
                   capacity_per_seed=" ".join(f"{x:g}" for x in summ["per_seed"]),
                   converged=summ["converged"], n_evals=summ["n_evals"],
                   first_guess_rps=c.rate0)
        knee_pts = [p for p in c.points if p["passed"]]
        ref = max(knee_pts, key=lambda p: p["request_rate"]) if knee_pts else None
        mean_out = _nanmean([p.get("mean_output_len", math.nan) for p in c.points])
        row["mean_output_len"] = mean_out
        if cap > 0:
            cost = deployment_cost(spec.target_request_rate, cap, gpr,
                                   row["usd_per_gpu_hour"], mean_out)
        else:
            cost = deployment_cost(spec.target_request_rate, 0.0, gpr, math.nan, mean_out)
            row["reason"] = (f"SLO not met even at {spec.tolerance.min_rps:g} req/s"
                             if c.points else "no point simulated")
        row.update(cost)
        row["replicas_at_ci_low"] = (math.ceil(spec.target_request_rate / row["ci_low"] - 1e-9)
                                     if row["ci_low"] and row["ci_low"] > 0 else math.nan)
        op = c.confirm or ref
        if ref is not None:
            row["knee_p99_ttft_ms"] = ref.get("p99_ttft_ms")
            row["knee_p99_tpot_ms"] = ref.get("p99_tpot_ms")
        if op is not None:
            row["op_simulated"] = c.confirm is not None
            for k in ("slo_p_ttft_ms", "slo_p_tpot_ms", "slo_p_e2el_ms", "p99_ttft_ms",
                      "p99_tpot_ms", "p99_e2el_ms", "goodput_pct", "num_preemptions"):
                row[f"op_{k}"] = op.get(k, math.nan)
            row["op_meets_slo"] = bool(op.get("passed", False))
            row["slo_margin_pct"] = _slo_margin(op, spec.slo)
            # vLLM plot_pareto: tokens/s/GPU = output_throughput / (tp·pp·dp);
            # tokens/s/user = output_throughput / user_count, user_count = concurrent requests
            otp = op.get("output_throughput", math.nan)
            users = op.get("max_concurrent_requests") or (
                op.get("request_rate", math.nan) * op.get("mean_e2el_ms", math.nan) / 1e3)
            row["output_throughput_per_replica"] = otp
            row["tokens_per_s_per_gpu"] = otp / gpr
            row["tokens_per_s_per_user"] = otp / users if users and users > 0 else math.nan
        rows.append(row)

    x = [r.get("tokens_per_s_per_user", math.nan) for r in rows]
    y = [r.get("tokens_per_s_per_gpu", math.nan) for r in rows]
    pm = pareto_mask(x, y)
    for r, p in zip(rows, pm):
        r["pareto"] = bool(p)
    ranked = sorted((r for r in rows if _usable(r)),
                    key=lambda r: (round(r["usd_per_hour"], 6), r["utilization_of_knee"],
                                   -r["capacity_rps"]))
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    for r in rows:
        r.setdefault("rank", math.nan)
        r["recommended"] = False
        r["warning"] = _warning(r, spec) if _usable(r) else ""
    rec = ranked[0] if ranked else None
    if rec is not None:
        rec["recommended"] = True
    rows.sort(key=lambda r: (not _usable(r), r["rank"] if _usable(r) else 0,
                             not r["fits"], r["candidate"]))
    notes = sorted({w for c in cands for p in c.points for w in (p.get("warnings") or [])})
    points = [{k: v for k, v in p.items() if k != "warnings"} for c in cands for p in c.points]
    for c in cands:
        if c.confirm is not None:
            points.append({**{k: v for k, v in c.confirm.items() if k != "warnings"},
                           "candidate": c.name, "operating_point": True})
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


def _usable(r: dict) -> bool:
    return bool(r.get("fits")) and (r.get("capacity_rps") or 0) > 0 and math.isfinite(
        r.get("usd_per_hour", math.nan))


def _nanmean(xs: list[float]) -> float:
    a = np.asarray([x for x in xs if x is not None], dtype=float)
    a = a[np.isfinite(a)]
    return float(a.mean()) if len(a) else math.nan


def _slo_margin(m: dict, slo: PlanSLO) -> float:
    """Smallest relative headroom (%) of the SLO percentiles under their thresholds."""
    margins = []
    for name, thr in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms), ("e2el", slo.e2el_ms)):
        v = m.get(f"slo_p_{name}_ms", math.nan)
        if thr is not None and v is not None and math.isfinite(v):
            margins.append(100.0 * (thr - v) / thr)
    return min(margins) if margins else math.nan


def _warning(r: dict, spec: PlanSpec) -> str:
    w = []
    u = r.get("utilization_of_knee", math.nan)
    if math.isfinite(u) and u > spec.knee_warn:
        nxt = r["replicas"] + 1
        w.append(f"runs at {u:.0%} of its capacity (> {spec.knee_warn:.0%}): little headroom "
                 f"for bursts; {nxt} replicas would run at "
                 f"{spec.target_request_rate / nxt / r['capacity_rps']:.0%}")
    if r.get("replicas_at_ci_low") and r["replicas_at_ci_low"] > r.get("replicas", 0):
        w.append(f"at the CI's low end ({r['ci_low']:.3g} req/s) "
                 f"{r['replicas_at_ci_low']} replicas are needed")
    if r.get("op_simulated") and not r.get("op_meets_slo", True):
        w.append("the simulated operating point misses the SLO")
    if r.get("converged") is False:
        w.append("search hit max_evals before converging")
    return "; ".join(w)


PLAN_COLUMNS = [
    "rank", "recommended", "candidate", "hardware", "tensor_parallel_size",
    "pipeline_parallel_size", "fits", "reason", "num_gpu_blocks", "capacity_rps", "ci_low",
    "ci_high", "capacity_per_seed", "converged", "n_evals", "replicas", "gpus_per_replica",
    "gpus", "usd_per_gpu_hour", "usd_per_hour", "usd_per_1m_output_tokens",
    "operating_rps_per_replica", "utilization_of_knee", "op_slo_p_ttft_ms", "op_slo_p_tpot_ms",
    "op_goodput_pct", "slo_margin_pct", "tokens_per_s_per_gpu", "tokens_per_s_per_user",
    "pareto", "warning",
]


def write_plan_outputs(result: dict, outdir: Path) -> None:
    """plan.csv (one row per candidate) and plan.json (everything)."""
    import pandas as pd

    rows = result["candidates"]
    df = pd.DataFrame(rows)
    cols = [c for c in PLAN_COLUMNS if c in df.columns]
    cols += [c for c in df.columns if c not in cols]
    df = df.reindex(columns=cols)
    tmp = outdir / ".plan.csv.tmp"
    df.to_csv(tmp, index=False)
    os.replace(tmp, outdir / "plan.csv")
    _atomic_write_json(outdir / "plan.json", result)
