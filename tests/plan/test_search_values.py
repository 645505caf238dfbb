"""The rate search and its helpers by value: the exact sequence of probed rates, the
interpolated capacity, convergence and stopping rules, the analytic first guess."""

from __future__ import annotations

import math

import pytest
from servesim.simulator.config import load_config
from servesim.simulator.plan.search import (
    RateSearch,
    first_guess_rps,
    mean_lengths,
    new_search,
    round_rate,
    search_capacity,
    summarize_searches,
)
from servesim.simulator.plan.spec import PlanSLO, PlanTolerance
from servesim.workloads.config import (
    ExponentialDist,
    FixedDist,
    LognormalDist,
    RandomWorkload,
    SyntheticWorkload,
    UniformDist,
)


def drive(s: RateSearch, passes, ratio=None):
    while (r := s.propose()) is not None:
        s.update(r, passes(r), ratio(r) if ratio else None)
    return [h[0] for h in s.history]


def test_round_rate_four_significant_digits():
    assert round_rate(1.23456) == 1.235
    assert round_rate(98765.4) == 98770.0
    assert round_rate(0.000123456) == 0.0001235
    assert round_rate(0.0) == 0.0 and round_rate(-2.5) == -2.5
    assert math.isinf(round_rate(math.inf))


def test_exact_probe_sequence_and_bracket():
    """Pass iff rate ≤ 6.5: double from 1 (1, 2, 4, 8 fails), then bisect [4, 8] until
    (hi − lo)/hi ≤ 0.05."""
    s = RateSearch(rate0=1.0, rel_tol=0.05)
    rates = drive(s, lambda r: r <= 6.5)
    assert rates == [1.0, 2.0, 4.0, 8.0, 6.0, 7.0, 6.5, 6.75]
    assert (s.lo, s.hi) == (6.5, 6.75) and s.converged
    assert (6.75 - 6.5) / 6.75 <= 0.05 < (7.0 - 6.5) / 7.0
    assert s.capacity == 6.5  # no ratios recorded: the highest passing rate


def test_capacity_interpolates_where_the_ratio_crosses_one():
    """capacity = lo + (1 − q_lo)/(q_hi − q_lo) · (hi − lo), with q = metric / threshold."""
    s = RateSearch(rate0=4.0, rel_tol=0.3)
    drive(s, lambda r: r <= 5.0, ratio=lambda r: r / 5.5)  # q = 1 at 5.5
    assert (s.lo, s.hi) == (4.0, 5.0) or s.converged
    lo, hi = s.lo, s.hi
    q_lo, q_hi = lo / 5.5, hi / 5.5
    if q_hi > 1 >= q_lo:
        want = lo + (1 - q_lo) / (q_hi - q_lo) * (hi - lo)
    else:  # the failing end's ratio is below 1 (non-monotone): stays at lo, clamped
        want = lo + min(1.0, max(0.0, (1 - q_lo) / (q_hi - q_lo))) * (hi - lo)
    assert s.capacity == pytest.approx(want, rel=1e-12)
    # explicit bracket with ratios 0.8 at 10 and 1.2 at 12: crossing at 11
    t = RateSearch(rate0=10.0)
    t.update(10.0, True, 0.8)
    t.update(12.0, False, 1.2)
    assert t.capacity == pytest.approx(11.0, rel=1e-12)
    # ratios that do not increase across the bracket: lo
    u = RateSearch(rate0=10.0)
    u.update(10.0, True, 0.9)
    u.update(12.0, False, 0.9)
    assert u.capacity == 10.0
    # crossing outside the bracket is clamped to it
    v = RateSearch(rate0=10.0)
    v.update(10.0, True, 0.5)
    v.update(12.0, False, 0.6)
    assert v.capacity == 12.0


def test_halving_down_to_min_rate_and_max_evals():
    s = RateSearch(rate0=10.0, min_rate=1.0)
    assert drive(s, lambda r: False) == [10.0, 5.0, 2.5, 1.25]  # 0.625 < min_rate: stop
    assert s.capacity == 0.0 and s.lo is None and s.hi == 1.25
    t = RateSearch(rate0=1.0, max_rate=10.0)
    assert drive(t, lambda r: True) == [1.0, 2.0, 4.0, 8.0]  # 16 > max_rate: stop
    assert t.capacity == 8.0 and t.hi is None and not t.converged
    m = RateSearch(rate0=1.0, rel_tol=1e-6, max_evals=6)
    assert len(drive(m, lambda r: r <= 3.3)) == 6 and m.done


def test_non_monotone_answers_only_move_the_bracket():
    s = RateSearch(rate0=4.0)
    s.update(4.0, True)
    s.update(8.0, False)
    s.update(6.0, True)
    assert (s.lo, s.hi) == (6.0, 8.0)
    s.update(5.0, False)  # fails below the passing 6: the bracket loses its lower end
    assert (s.lo, s.hi) == (None, 5.0)
    s.update(7.0, True)  # passes above the failing 5: loses its upper end
    assert (s.lo, s.hi) == (7.0, None)


def test_bisection_stops_when_rounding_cannot_split():
    """Rates are rounded to 4 significant digits: between 1.000 and 1.001 nothing is left."""
    s = RateSearch(rate0=1.0, rel_tol=1e-9)
    s.update(1.0, True)
    s.update(1.001, False)
    assert s.propose() is None and not s.converged
    s2 = RateSearch(rate0=1.0, rel_tol=1e-9)
    s2.update(1.0, True)
    s2.update(1.002, False)
    assert s2.propose() == 1.001


def test_search_capacity_over_seeds_by_value():
    """Each seed's search stops at its own bracket; the result is the mean and t interval."""
    caps = {0: 6.5, 1: 7.3, 2: 5.9}
    slo = PlanSLO(ttft_ms=100, max_queue_growth=None)

    def evaluate(rate, seed):
        return {"slo_p_ttft_ms": 100 * rate / caps[seed], "completed": 10}

    res = search_capacity(evaluate, slo, [0, 1, 2], 1.0, PlanTolerance(rel_width=0.02))
    per = res["per_seed"]
    for s, c in zip((0, 1, 2), per):
        srch = res["searches"][s]
        assert srch.lo <= c <= srch.hi and srch.converged
        assert c == pytest.approx(caps[s], rel=1e-9)  # ratio linear in rate: exact crossing
    from scipy import stats

    ref = stats.t.interval(0.95, 2, loc=sum(per) / 3, scale=stats.sem(per))
    assert res["capacity_rps"] == pytest.approx(sum(per) / 3, rel=1e-12)
    assert (res["ci_low"], res["ci_high"]) == (pytest.approx(ref[0]), pytest.approx(ref[1]))
    assert res["n_evals"] == sum(len(s.history) for s in res["searches"].values())
    assert len(res["points"]) == res["n_evals"]
    assert all(p["passed"] == (p["slo_p_ttft_ms"] <= 100) for p in res["points"])


def test_summarize_one_seed_uses_its_bracket():
    s = new_search(2.0, PlanTolerance(rel_width=0.1, max_evals=20))
    drive(s, lambda r: r <= 5.0)
    out = summarize_searches({0: s})
    assert (out["capacity_rps"], out["ci_low"], out["ci_high"]) == (s.capacity, s.lo, s.hi)
    assert out["converged"] and out["n_evals"] == len(s.history)
    assert (s.rel_tol, s.max_evals) == (0.1, 20)


def test_mean_lengths_by_distribution():
    assert mean_lengths(RandomWorkload(input_len=1000, prefix_len=24, output_len=50)) == (
        1024.0, 50.0)
    syn = SyntheticWorkload(input=UniformDist(low=100, high=301),
                            output=LognormalDist(median=100, sigma=0.5))
    assert mean_lengths(syn) == (200.5, pytest.approx(100 * math.exp(0.125), rel=1e-12))
    syn = SyntheticWorkload(input=FixedDist(value=77),
                            output=LognormalDist(median=100, sigma=2.0, max=300))
    assert mean_lengths(syn) == (77.0, 300.0)  # lognormal mean above max: max
    syn = SyntheticWorkload(input=ExponentialDist(mean=640), output=FixedDist(value=3))
    assert mean_lengths(syn) == (640.0, 3.0)
    assert mean_lengths(object()) == (1024.0, 128.0)


def test_first_guess_by_value():
    """2·params·prompt FLOPs at 50% of peak, plus per output token a weight read at 80% of
    HBM (+3 ms) shared by 64 requests; 70% of the inverse."""
    cfg = load_config(None, ["model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             "workload.input_len=1000", "workload.output_len=200"])
    h, L, V, I = 4096, 32, 128256, 14336
    params = 2 * V * h + h + L * (2 * h + (6144 + 4096) * h + 2 * I * h + I * h)
    prefill_s = 2 * params * 1000 / (312e12 * 0.5)
    decode_s = 200 * (params * 2 / (2039e9 * 0.8) + 0.003) / 64
    assert first_guess_rps(cfg) == pytest.approx(0.7 / (prefill_s + decode_s), rel=1e-12)
    tp2 = load_config(None, ["model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             "parallel.tensor_parallel_size=2", "workload.input_len=1000",
                             "workload.output_len=200"])
    prefill2 = 2 * params * 1000 / (312e12 * 2 * 0.5)
    decode2 = 200 * (params * 2 / (2039e9 * 2 * 0.8) + 0.003) / 64
    assert first_guess_rps(tp2) == pytest.approx(0.7 / (prefill2 + decode2), rel=1e-12)
    # --cpu-offload-gb 4: each decode step also reads 4 GiB over PCIe4 (32 GB/s)
    off = load_config(None, ["model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             "workload.input_len=1000", "workload.output_len=200",
                             "cpu_offload_gb=4"])
    decode_off = 200 * (params * 2 / (2039e9 * 0.8) + 4 * 2**30 / 32e9 + 0.003) / 64
    assert first_guess_rps(off) == pytest.approx(0.7 / (prefill_s + decode_off), rel=1e-12)
    # an offload larger than the model reads at most the model's weights (params · 2 bytes)
    whole = load_config(None, ["model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                               "workload.input_len=1000", "workload.output_len=200",
                               "cpu_offload_gb=100"])
    decode_all = 200 * (params * 2 / (2039e9 * 0.8) + params * 2 / 32e9 + 0.003) / 64
    assert first_guess_rps(whole) == pytest.approx(0.7 / (prefill_s + decode_all), rel=1e-12)
    assert first_guess_rps(object()) == 1.0
