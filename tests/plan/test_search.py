"""Capacity search, sizing/cost arithmetic, Pareto flags and the plan driver (synthetic model)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from servesim.simulator.plan import (
    PlanSLO,
    PlanSpec,
    PlanTolerance,
    RateSearch,
    deployment_cost,
    load_prices,
    pareto_mask,
    point_metrics,
    search_capacity,
    slo_passed,
)
from servesim.simulator.plan.runner import run_plan

from .synthetic import BASE, synthetic_eval, synthetic_fit, true_capacity


def _curve(cap_of_seed):
    """evaluate(rate, seed): P99 TTFT (ms) rising steeply towards the seed's capacity."""
    def ev(rate, seed):
        u = rate / cap_of_seed(seed)
        return {"slo_p_ttft_ms": 100 + 900 * u ** 5, "slo_p_tpot_ms": 20 + 20 * u ** 2,
                "completed": 100}
    return ev


def test_rate_search_brackets_then_bisects_to_tolerance():
    ev = _curve(lambda s: 10.0)
    slo = PlanSLO(ttft_ms=1000)  # met exactly at rate 10
    s = RateSearch(rate0=0.7, rel_tol=0.05)
    while (r := s.propose()) is not None:
        s.update(r, slo_passed(ev(r, 0), slo))
    assert s.converged and (s.hi - s.lo) / s.hi <= 0.05
    assert s.lo <= 10.0 <= s.hi
    rates = [h[0] for h in s.history]
    assert rates[:5] == [0.7, 1.4, 2.8, 5.6, 11.2]  # doubling from the first guess


def test_rate_search_halves_when_first_guess_too_high_and_gives_up_below_min():
    s = RateSearch(rate0=100.0, rel_tol=0.05, min_rate=1.0)
    while (r := s.propose()) is not None:
        s.update(r, r <= 3.0)
    assert 3.0 * 0.95 <= s.capacity <= 3.0
    never = RateSearch(rate0=8.0, min_rate=1.0)
    while (r := never.propose()) is not None:
        never.update(r, False)
    assert never.capacity == 0.0 and [h[0] for h in never.history] == [8.0, 4.0, 2.0, 1.0]


def test_capacity_interpolation_recovers_the_true_knee():
    caps = {0: 9.3, 1: 10.4, 2: 11.1}
    res = search_capacity(_curve(caps.get), PlanSLO(ttft_ms=1000), [0, 1, 2], 2.0)
    for got, want in zip(res["per_seed"], caps.values()):
        assert got == pytest.approx(want, rel=0.02)
    assert res["ci_low"] <= res["capacity_rps"] <= res["ci_high"]
    assert res["converged"]


def test_looser_slo_gives_higher_capacity():
    ev = _curve(lambda s: 10.0 * (1 + 0.03 * s))
    caps = [search_capacity(ev, PlanSLO(ttft_ms=t, tpot_ms=100), [0, 1], 1.0)["capacity_rps"]
            for t in (300, 600, 1000, 3000)]
    assert caps == sorted(caps) and caps[0] < caps[-1]
    tight_tpot = search_capacity(ev, PlanSLO(ttft_ms=3000, tpot_ms=30), [0, 1], 1.0)
    assert tight_tpot["capacity_rps"] < caps[-1]


def test_more_seeds_narrow_the_interval():
    def cap(seed):
        return 10.0 * (1 + 0.05 * np.random.default_rng(seed).standard_normal())
    ev = _curve(cap)
    slo = PlanSLO(ttft_ms=1000)
    few = search_capacity(ev, slo, range(2), 2.0)
    many = search_capacity(ev, slo, range(12), 2.0)
    assert many["ci_high"] - many["ci_low"] < few["ci_high"] - few["ci_low"]
    assert many["ci_low"] <= 10.0 <= many["ci_high"]


def test_point_metrics_percentiles_and_goodput():
    n = 100
    ttft = np.linspace(0.01, 1.0, n)  # s
    req = {"ttft_s": ttft, "tpot_s": np.full(n, 0.02), "e2el_s": ttft + 1.0,
           "output_len": np.full(n, 51), "prompt_len": np.full(n, 100),
           "finished_reason": np.array(["length"] * n, dtype=object)}
    m = point_metrics(req, PlanSLO(ttft_ms=500, tpot_ms=50), duration_s=10.0)
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile(ttft * 1e3, 99))
    assert m["goodput_pct"] == pytest.approx(100 * np.mean(ttft * 1e3 <= 500))
    assert m["request_throughput"] == pytest.approx(10.0)
    assert m["output_throughput"] == pytest.approx(510.0)
    assert not m["passed"]  # P99 TTFT 990 ms > 500 ms
    assert point_metrics(req, PlanSLO(ttft_ms=1000), duration_s=10.0)["passed"]
    assert point_metrics(req, PlanSLO(ttft_ms=995), duration_s=10.0)["passed"]
    assert not point_metrics(req, PlanSLO(ttft_ms=995, min_goodput_pct=99.5),
                             duration_s=10.0)["passed"]


def test_cost_arithmetic_by_hand():
    c = deployment_cost(target_rps=50, capacity_rps=7.3, gpus_per_replica=2,
                        usd_per_gpu_hour=2.99, mean_output_len=130)
    assert c["replicas"] == 7  # ceil(50 / 7.3) = ceil(6.85)
    assert c["gpus"] == 14
    assert c["usd_per_hour"] == pytest.approx(14 * 2.99)
    # 50 req/s x 130 tok = 6500 tok/s = 23.4 M tok/h -> 41.86 / 23.4 $ per M
    assert c["usd_per_1m_output_tokens"] == pytest.approx(41.86 / 23.4)
    assert c["utilization_of_knee"] == pytest.approx(50 / 7 / 7.3)
    exact = deployment_cost(50, 10.0, 1, 1.0, 100)
    assert exact["replicas"] == 5 and exact["utilization_of_knee"] == pytest.approx(1.0)


def test_pareto_mask_maximizes_both():
    x = [1, 2, 3, 2, math.nan]
    y = [3, 2, 1, 1, 9]
    assert pareto_mask(x, y).tolist() == [True, True, True, False, False]


def test_prices_file_has_sources_and_covers_the_hardware_catalog():
    prices = load_prices()
    for name, p in prices.items():
        assert p["usd_per_gpu_hour"] > 0 and p["source"] and p["as_of"], name
    hw_dir = Path(__file__).resolve().parents[2] / "configs" / "hardware"
    for f in hw_dir.glob("*.yaml"):
        assert f.stem in prices, f"no price for {f.stem}"


def _spec(**kw) -> PlanSpec:
    d = {"name": "t", "workload": {"kind": "random", "num_prompts": 100, "input_len": 1000,
                                 "output_len": 130},
             "slo": {"ttft_ms": 1000, "tpot_ms": 45}, "target_request_rate": 50,
             "search": {"hardware": ["a100-sxm4-80gb", "h100-sxm", "l40s"],
                     "tensor_parallel_size": [1, 2]},
             "seeds": [0, 1], "tolerance": {"first_guess_rps": 2.0}}
    d.update(kw)
    return PlanSpec.model_validate(d)


def test_plan_skips_non_fitting_candidate_and_recommends_cheapest(tmp_path):
    res = run_plan(_spec(), tmp_path, tmp_path, evaluate=synthetic_eval,
                   fit_check=synthetic_fit, quiet=True, write_report=False)
    rows = {r["candidate"]: r for r in res["candidates"]}
    assert not rows["l40s_tp1"]["fits"]
    assert "CapacityError" in rows["l40s_tp1"]["reason"]
    assert math.isnan(rows["l40s_tp1"].get("capacity_rps", math.nan))
    usable = [r for r in res["candidates"] if r["fits"]]
    assert len(usable) == 5
    for r in usable:  # capacity close to the synthetic model's knee (TTFT 1000 ms at u = 1)
        truth = np.mean([true_capacity({"hardware": {"name": r["hardware"]}, "parallel": {
            "tensor_parallel_size": r["tensor_parallel_size"]}}, s) for s in (0, 1)])
        assert r["capacity_rps"] == pytest.approx(truth, rel=0.06)
        assert r["replicas"] == math.ceil(50 / r["capacity_rps"])
        assert r["gpus"] == r["replicas"] * r["tensor_parallel_size"]
    rec = [r for r in res["candidates"] if r["recommended"]]
    assert len(rec) == 1 and rec[0]["rank"] == 1
    assert rec[0]["usd_per_hour"] == min(r["usd_per_hour"] for r in usable)
    assert any(r["pareto"] for r in usable)
    csv = (tmp_path / "plan.csv").read_text().splitlines()
    assert len(csv) == 7 and csv[0].startswith("rank,recommended,candidate")
    for col in ("fits", "reason", "capacity_rps", "ci_low", "ci_high", "replicas", "gpus",
                "usd_per_hour", "usd_per_1m_output_tokens", "pareto", "utilization_of_knee"):
        assert col in csv[0].split(",")
    assert json.loads((tmp_path / "plan.json").read_text())["recommended"] == rec[0]["candidate"]


def test_plan_warns_near_the_knee():
    # one candidate whose capacity makes the target land at > 85% of the knee
    spec = _spec(target_request_rate=BASE["h100-sxm"] * 0.95,
                 search={"hardware": ["h100-sxm"]}, seeds=[0], confirm=False)
    res = run_plan(spec, Path("."), Path(pytest.importorskip("tempfile").mkdtemp()),
                   evaluate=synthetic_eval, fit_check=synthetic_fit, quiet=True,
                   write_report=False)
    r = res["candidates"][0]
    assert r["replicas"] == 1 and r["utilization_of_knee"] > 0.85
    assert "of its capacity" in r["warning"]


_CALLS: list = []


def _counting_eval(tree, rate, seed, slo, cand):
    """synthetic_eval that counts its calls (the plan driver writes the point files)."""
    _CALLS.append((cand, rate, seed))
    return synthetic_eval(tree, rate, seed, slo, cand)


def test_resume_reuses_finished_points(tmp_path):
    spec = _spec(search={"hardware": ["a100-sxm4-80gb", "h100-sxm"]})
    _CALLS.clear()
    first = run_plan(spec, tmp_path, tmp_path, evaluate=_counting_eval, fit_check=synthetic_fit,
                     quiet=True, write_report=False)
    n = len(_CALLS)
    assert n > 10
    assert list(tmp_path.glob("points/SERVE-h100-sxm-BENCH-*/run=0.json"))
    _CALLS.clear()
    again = run_plan(spec, tmp_path, tmp_path, evaluate=_counting_eval,
                     fit_check=synthetic_fit, quiet=True, write_report=False, resume=True)
    assert _CALLS == []
    a = {r["candidate"]: r["capacity_rps"] for r in first["candidates"]}
    b = {r["candidate"]: r["capacity_rps"] for r in again["candidates"]}
    assert a == b
    # a changed point definition (another SLO) is not reused
    run_plan(_spec(search={"hardware": ["h100-sxm"]}, slo={"ttft_ms": 900, "tpot_ms": 45}),
             tmp_path, tmp_path, evaluate=_counting_eval, fit_check=synthetic_fit, quiet=True,
             write_report=False, resume=True)
    assert len(_CALLS) > 3


def test_resume_reruns_points_of_other_code(tmp_path, monkeypatch):
    """Same plan, other servesim code (``code_hash``: a default or a formula changed): no
    point is reused."""
    from servesim.simulator.experiments import points

    spec = _spec(search={"hardware": ["h100-sxm"]})
    _CALLS.clear()
    run_plan(spec, tmp_path, tmp_path, evaluate=_counting_eval, fit_check=synthetic_fit,
             quiet=True, write_report=False)
    n = len(_CALLS)
    monkeypatch.setattr(points, "code_hash", lambda: "another version")
    _CALLS.clear()
    run_plan(spec, tmp_path, tmp_path, evaluate=_counting_eval, fit_check=synthetic_fit,
             quiet=True, write_report=False, resume=True)
    assert len(_CALLS) == n


def test_tolerance_defaults():
    t = PlanTolerance()
    assert t.rel_width == 0.05


def test_queue_growth_separates_sustained_from_overloaded():
    from servesim.simulator.plan import queue_growth

    rng = np.random.default_rng(0)
    arr = np.sort(rng.uniform(0, 100, 2000))  # 20 req/s for 100 s
    stable = {"arrival_s": arr, "finish_s": arr + rng.uniform(1, 3, len(arr))}
    assert abs(queue_growth(stable)) < 0.03
    # served at 16 req/s in arrival order: 20 % overload -> the queue grows by ~20 % of arrivals
    over = {"arrival_s": arr, "finish_s": np.maximum(arr + 1, np.arange(1, len(arr) + 1) / 16)}
    assert 0.15 < queue_growth(over) < 0.25
    slo = PlanSLO(tpot_ms=50)
    base = {"slo_p_tpot_ms": 20.0, "completed": 10}
    assert slo_passed({**base, "queue_growth": 0.02}, slo)
    assert not slo_passed({**base, "queue_growth": 0.2}, slo)


def test_sustained_tree_raises_num_prompts():
    from servesim.simulator.plan.point import sustained_tree

    t = {"workload": {"kind": "random", "num_prompts": 300}}
    assert sustained_tree(t, 2.0, 60, 20000) is t  # 120 < 300: unchanged
    assert sustained_tree(t, 20.0, 60, 20000)["workload"]["num_prompts"] == 1200
    assert sustained_tree(t, 1000.0, 60, 5000)["workload"]["num_prompts"] == 5000
    assert t["workload"]["num_prompts"] == 300
    tr = {"workload": {"kind": "trace", "path": "x.csv"}}
    assert sustained_tree(tr, 20.0, 60, 20000) is tr


def test_load_plan_with_relative_base_and_bad_key(tmp_path):
    from servesim.simulator.errors import ConfigError
    from servesim.simulator.plan.spec import base_tree, expand_candidates, load_plan

    (tmp_path / "base.yaml").write_text("hardware: {name: l40s}\nparallel: "
                                        "{data_parallel_size: 4}\nworkload: {num_prompts: 5}\n")
    (tmp_path / "p.yaml").write_text(
        "base: base.yaml\nslo: {ttft_ms: 1000}\ntarget_request_rate: 10\n"
        "workload: {kind: random, num_prompts: 50}\n"
        "search: {tp: [1, 2], max_num_seqs: [64, null]}\n")
    spec, d = load_plan(tmp_path / "p.yaml")
    tree = base_tree(spec, d)
    assert tree["hardware"]["name"] == "l40s" and tree["workload"]["num_prompts"] == 50
    assert tree["parallel"]["data_parallel_size"] == 1  # capacity is per replica
    assert tree["slo"] == {"ttft_ms": 1000}
    names = [n for n, _, _ in expand_candidates(spec, tree)]
    assert names == ["tp1_mns64", "tp1", "tp2_mns64", "tp2"]
    (tmp_path / "bad.yaml").write_text("slo: {ttft_ms: 1000}\ntarget_request_rate: 10\n"
                                       "serach: {}\n")
    with pytest.raises(ConfigError, match="bad.yaml: serach"):
        load_plan(tmp_path / "bad.yaml")


def test_plan_where_nothing_fits_says_so(tmp_path):
    from servesim.reports.plan import plan_summary
    from servesim.simulator.errors import CapacityError

    def never(tree, source):
        raise CapacityError(f"{source}: does not fit (test)")

    res = run_plan(_spec(), tmp_path, tmp_path, evaluate=synthetic_eval, fit_check=never,
                   quiet=True)
    assert res["recommended"] is None
    assert plan_summary(res).startswith("**None of the 6 candidates fits**")
    assert "does not fit (test)" in plan_summary(res)
    assert (tmp_path / "report.html").is_file()
