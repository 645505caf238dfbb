"""One probe of the plan: a candidate's config at one offered rate and seed, simulated.

:func:`evaluate_point` runs in a worker (any backend) and returns the point's record: the
``vllm bench serve`` dict with the planner's metrics under ``plan_point``. The driver adds the
candidate, seed and :func:`point_hash`, and writes it as
``points/SERVE-<candidate>-BENCH-<rate>/run=<seed>.json``.
"""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
from servesim.simulator.experiments import content_hash
from servesim.simulator.experiments.points import inputs_hash
from servesim.simulator.experiments.store import HOST_TIMING_KEYS
from servesim.simulator.plan.slo import point_metrics
from servesim.simulator.plan.spec import PlanSLO, get_path, set_path


def point_hash(tree: dict, rate: float, seed: int, slo: dict) -> str:
    """Identity of a simulated point for ``--resume``: config tree, rate, seed, SLO and
    :func:`inputs_hash` of the tree it runs (the code, defaults, specs and files it resolves
    to)."""
    return content_hash(tree, float(rate), int(seed), slo,
                        inputs_hash(point_tree(tree, rate, seed)))


def point_tree(tree: dict, rate: float, seed: int) -> dict:
    """The tree a point runs: ``tree`` at offered ``rate`` (:func:`rate_key`) and ``seed``."""
    t = copy.deepcopy(tree)
    set_path(t, rate_key(t), float(rate))
    set_path(t, "workload.seed", int(seed))
    return t


def resolve_tree(tree: dict, source: str):
    """Validate + resolve a config tree and plan its memory (raises when it does not fit)."""
    from servesim.costmodels import plan_memory
    from servesim.simulator.config import resolve_config, validate_tree

    cfg = resolve_config(validate_tree(copy.deepcopy(tree), source))
    return cfg, plan_memory(cfg)


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


def evaluate_point(tree: dict, rate: float, seed: int, slo: dict, cand: str) -> dict:
    """Simulate one (candidate, rate, seed) point; return its record (bench dict +
    ``plan_point``: :func:`point_metrics` plus peaks, the rate, seed and simulator warnings)."""
    from servesim.reports.bench_result import compute_bench_result
    from servesim.simulator.config import resolve_config, validate_tree
    from servesim.simulator.runner import run_experiment

    t = point_tree(tree, rate, seed)
    cfg = resolve_config(validate_tree(t, f"plan point {cand} @ {rate} req/s"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run_experiment(cfg)
    m = point_metrics(res.requests, PlanSLO.model_validate(slo), duration_s=res.duration_s,
                      num_preemptions=res.counters.get("num_preemptions", 0.0))
    m["max_kv_cache_usage_perc"] = _max_of(res.steps.get("vllm:kv_cache_usage_perc"))
    m["max_num_requests_running"] = _max_of(res.steps.get("vllm:num_requests_running"))
    m["num_gpu_blocks"] = res.counters.get("num_gpu_blocks", math.nan)
    m.update(request_rate=float(rate), seed=int(seed), candidate=cand,
             warnings=sorted({f"{w.category.__name__}: {w.message}" for w in caught}))
    bench = {k: v for k, v in compute_bench_result(res).items() if k not in HOST_TIMING_KEYS}
    if bench.get("max_concurrent_requests") is not None:
        m["max_concurrent_requests"] = float(bench["max_concurrent_requests"])
    return {**bench, "plan_point": m}


def _max_of(a) -> float:
    if a is None or len(a) == 0:
        return math.nan
    return float(np.nanmax(np.asarray(a, dtype=float)))
