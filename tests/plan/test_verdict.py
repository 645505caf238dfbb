"""Planner verdicts agree with themselves: a candidate "fits" only if its simulated operating
point meets every SLO. The case is built to land just past the knee: per-seed knees of 10 and
12 req/s (P99 TPOT = 60 ms × rate / knee, exactly linear, so the search finds them exactly), a
capacity of their mean, 11 req/s, and a target of 11 req/s: one replica, run at 11 req/s with
seed 0, misses the 60 ms TPOT SLO (66 ms)."""

from __future__ import annotations

import math

import pytest
from servesim.simulator.plan import PlanSpec
from servesim.simulator.plan.runner import run_plan

from .synthetic import synthetic_fit

KNEE = {0: 10.0, 1: 12.0}  # req/s where P99 TPOT reaches 60 ms, per seed


def knee_eval(tree, rate, seed, slo, cand):
    tpot = 60.0 * rate / KNEE[seed]
    m = {"num_requests": 100, "completed": 100, "failed": 0, "mean_output_len": 100.0,
         "output_throughput": 100.0 * rate, "max_concurrent_requests": 2.0 * rate,
         "goodput_pct": 100.0 if tpot <= 60.0 else 0.0, "num_preemptions": 0.0}
    for name, v in (("ttft", 200.0), ("tpot", tpot), ("e2el", 200.0 + 99 * tpot)):
        m[f"p99_{name}_ms"] = m[f"slo_p_{name}_ms"] = v
        m[f"mean_{name}_ms"] = 0.8 * v
    return {"request_rate": rate, "plan_point": m}


def _plan(tmp_path, **kw):
    spec = PlanSpec.model_validate({
        "name": "knee", "workload": {"kind": "random", "num_prompts": 100},
        "slo": {"ttft_ms": 1000, "tpot_ms": 60}, "target_request_rate": 11.0,
        "search": {"hardware": ["h100-sxm"]}, "seeds": [0, 1],
        "tolerance": {"first_guess_rps": 4.0}, **kw})
    return run_plan(spec, tmp_path, tmp_path, evaluate=knee_eval, fit_check=synthetic_fit,
                    quiet=True, write_report=False)


def _assert_consistent(res):
    """No row says it fits while its simulated operating point misses an SLO."""
    for r in res["candidates"]:
        if r["fits"] and r.get("op_simulated"):
            assert r["op_meets_slo"]
            assert r["op_slo_p_tpot_ms"] <= 60.0 and r["op_slo_p_ttft_ms"] <= 1000.0


def test_replica_added_when_the_operating_point_misses_the_slo(tmp_path):
    res = _plan(tmp_path)
    (r,) = res["candidates"]
    assert r["capacity_rps"] == pytest.approx(11.0)  # mean of the per-seed knees 10 and 12
    ops = [p for p in res["points"] if p.get("operating_point")]
    # ceil(11 / 11) = 1 replica at 11 req/s: TPOT 66 ms > 60 ms; 2 replicas at 5.5: 33 ms
    assert [(p["request_rate"], p["slo_p_tpot_ms"]) for p in ops] == [
        (11.0, pytest.approx(66.0)), (5.5, pytest.approx(33.0))]
    assert r["fits"] and r["recommended"]
    assert r["replicas"] == 2 and r["gpus"] == 2
    assert r["operating_rps_per_replica"] == 5.5
    assert r["utilization_of_knee"] == pytest.approx(0.5)
    assert r["op_slo_p_tpot_ms"] == pytest.approx(33.0)
    assert r["slo_margin_pct"] == pytest.approx(45.0)  # (60 - 33) / 60
    assert r["warning"].startswith("2 replicas, not ceil(target / capacity) = 1: with 1 "
                                   "replica (11 req/s each) the simulated operating point "
                                   "missed P99 TPOT 66.0 ms > 60 ms")
    _assert_consistent(res)


def test_not_fitting_when_no_replica_may_be_added(tmp_path):
    res = _plan(tmp_path, max_added_replicas=0)
    (r,) = res["candidates"]
    assert not r["fits"] and not r["recommended"] and math.isnan(r["rank"])
    assert res["recommended"] is None
    assert r["reason"] == ("its simulated operating point misses the SLO even with 1 replica "
                           "(11 req/s each): P99 TPOT 66.0 ms > 60 ms")
    assert not r["pareto"]
    _assert_consistent(res)


def test_no_confirmation_keeps_the_knee_verdict(tmp_path):
    """Without confirm, sizing is ceil(target / capacity) and the row fits at the knee."""
    res = _plan(tmp_path, confirm=False)
    (r,) = res["candidates"]
    assert r["fits"] and r["replicas"] == 1 and r["op_simulated"] is False
    assert not [p for p in res["points"] if p.get("operating_point")]
