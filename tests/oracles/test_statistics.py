"""The planner's capacity interval and the A/B intervals against ``scipy.stats``.

- capacity over seeds: mean ± t_{(1+level)/2, n−1} · s/√n (Student t; scipy.stats.t.interval),
  the lower end clamped at 0 req/s; one seed: its final bracket;
- A/B paired differences d = B − A: t interval (scipy.stats.t.interval), two-sided paired
  t-test p-value (scipy.stats.ttest_rel), percentile bootstrap of the mean
  (scipy.stats.bootstrap, within Monte-Carlo error).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from scipy import stats
from servesim.reports.ab import mean_ci, paired_ab
from servesim.simulator.plan.search import capacity_interval, t_quantile

SAMPLES = [
    [10.0, 12.0],
    [3.1, 2.9, 3.4, 3.0],
    [101.5, 98.2, 99.9, 104.1, 97.0, 100.3, 102.2],
    list(np.random.default_rng(3).normal(40, 6, 25)),
    list(np.random.default_rng(4).gamma(2.0, 3.0, 60)),
]


@pytest.mark.parametrize("x", SAMPLES)
@pytest.mark.parametrize("level", [0.95, 0.9, 0.99])
def test_capacity_interval_is_scipy_t_interval(x, level):
    x = np.asarray(x)
    mean, lo, hi = capacity_interval(list(x), level=level)
    ref = stats.t.interval(level, len(x) - 1, loc=x.mean(), scale=stats.sem(x))
    assert mean == pytest.approx(x.mean(), rel=1e-12)
    assert hi == pytest.approx(ref[1], rel=1e-9)
    assert lo == pytest.approx(max(0.0, ref[0]), rel=1e-9, abs=1e-12)


def test_capacity_interval_lower_end_clamped_at_zero():
    x = [0.1, 3.0, 0.2]
    _mean, lo, hi = capacity_interval(x)
    ref = stats.t.interval(0.95, 2, loc=np.mean(x), scale=stats.sem(x))
    assert ref[0] < 0 and lo == 0.0 and hi == pytest.approx(ref[1], rel=1e-9)


def test_capacity_interval_one_seed_and_none():
    assert capacity_interval([5.0], [(4.0, 6.0)]) == (5.0, 4.0, 6.0)
    assert capacity_interval([5.0], [(4.0, None)]) == (5.0, 4.0, 4.0)
    assert capacity_interval([5.0], [(4.0, math.inf)]) == (5.0, 4.0, 4.0)
    assert capacity_interval([5.0]) == (5.0, 5.0, 5.0)
    assert all(math.isnan(v) for v in capacity_interval([]))


@pytest.mark.parametrize("q,df", [(0.975, 1), (0.975, 7), (0.95, 4), (0.995, 30), (0.975, 200)])
def test_t_quantile_is_scipy(q, df):
    assert t_quantile(q, df) == pytest.approx(stats.t.ppf(q, df), rel=1e-12)


def test_t_quantile_table_without_scipy(monkeypatch):
    """Without scipy: a table of t_{0.975, df} (df ≤ 30, 3 decimals) and 1.96 + 2.4/df above."""
    ref = {df: float(stats.t.ppf(0.975, df)) for df in range(1, 400)}
    monkeypatch.setitem(sys.modules, "scipy", None)
    for df in range(1, 31):
        assert t_quantile(0.975, df) == pytest.approx(ref[df], abs=5e-4), df
    for df in (31, 40, 100, 399):
        assert t_quantile(0.975, df) == pytest.approx(ref[df], abs=3e-3), df
        assert t_quantile(0.975, df) == 1.96 + 2.4 / df
    with pytest.raises(ValueError, match="95%"):
        t_quantile(0.95, 5)


# ---------------------------------------------------------------------------------------------
# A/B


@pytest.mark.parametrize("d", SAMPLES[1:])
@pytest.mark.parametrize("conf", [0.95, 0.8])
def test_ab_t_interval_is_scipy(d, conf):
    d = np.asarray(d) - 50.0
    m, lo, hi = mean_ci(d, confidence=conf)
    ref = stats.t.interval(conf, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
    assert m == pytest.approx(d.mean(), rel=1e-12)
    assert (lo, hi) == (pytest.approx(ref[0], rel=1e-9), pytest.approx(ref[1], rel=1e-9))


def test_ab_t_interval_degenerate_cases():
    assert mean_ci([2.0, 2.0, 2.0]) == (2.0, 2.0, 2.0)  # zero spread
    m, lo, hi = mean_ci([4.0])
    assert m == 4.0 and math.isnan(lo) and math.isnan(hi)
    assert all(math.isnan(v) for v in mean_ci([]))
    with pytest.raises(ValueError):
        mean_ci([1.0, 2.0], method="jackknife")


@pytest.mark.parametrize("d", [SAMPLES[3], SAMPLES[4]])
def test_ab_bootstrap_is_a_percentile_bootstrap(d):
    """Agrees with scipy's percentile bootstrap up to Monte-Carlo error (two independent
    20,000-resample runs: quantile SE ≈ 0.02 standard errors of the mean each)."""
    d = np.asarray(d)
    m, lo, hi = mean_ci(d, method="bootstrap", n_boot=20_000, rng_seed=1)
    ref = stats.bootstrap((d,), np.mean, confidence_level=0.95, n_resamples=20_000,
                          method="percentile", random_state=2).confidence_interval
    se = stats.sem(d)
    assert m == pytest.approx(d.mean(), rel=1e-12)
    assert abs(lo - ref.low) < 0.15 * se and abs(hi - ref.high) < 0.15 * se
    # and, for the mean of 25+ values, close to the normal-theory interval
    assert abs((hi - lo) - 2 * 1.96 * d.std() / math.sqrt(len(d))) < 0.2 * se


def test_ab_bootstrap_confidence_level():
    d = np.asarray(SAMPLES[4])
    lo90, hi90 = mean_ci(d, method="bootstrap", confidence=0.9, n_boot=20_000)[1:]
    ref = stats.bootstrap((d,), np.mean, confidence_level=0.9, n_resamples=20_000,
                          method="percentile", random_state=3).confidence_interval
    se = stats.sem(d)
    assert abs(lo90 - ref.low) < 0.15 * se and abs(hi90 - ref.high) < 0.15 * se


def test_paired_ab_rows_against_scipy():
    """Per rate and metric: diff = mean(B − A) over seeds in both arms, its t interval,
    relative values = 100 · x / mean(A), p-value of the paired t-test."""
    rng = np.random.default_rng(9)
    a = 100 + rng.normal(0, 10, 6)
    b = a + 3 + rng.normal(0, 2, 6)
    rows = ([{"arm": "A", "request_rate": 2.0, "seed": s, "mean_ttft_ms": a[s]}
             for s in range(6)]
            + [{"arm": "B", "request_rate": 2.0, "seed": s, "mean_ttft_ms": b[s]}
               for s in range(5)])  # seed 5 missing in B: unpaired, left out
    (r,) = paired_ab(rows, metrics=["mean_ttft_ms"])
    d = b[:5] - a[:5]
    ref = stats.t.interval(0.95, 4, loc=d.mean(), scale=stats.sem(d))
    assert r["n"] == 5 and r["arm_a"] == "A" and r["arm_b"] == "B"
    assert r["diff"] == pytest.approx(d.mean(), rel=1e-12)
    assert (r["ci_low"], r["ci_high"]) == (pytest.approx(ref[0]), pytest.approx(ref[1]))
    assert r["mean_a"] == pytest.approx(a[:5].mean()) and r["mean_b"] == pytest.approx(
        b[:5].mean())
    scale = 100 / a[:5].mean()
    assert r["rel_diff_pct"] == pytest.approx(d.mean() * scale)
    assert r["rel_ci_low_pct"] == pytest.approx(ref[0] * scale)
    assert r["rel_ci_high_pct"] == pytest.approx(ref[1] * scale)
    assert r["p_value"] == pytest.approx(stats.ttest_rel(b[:5], a[:5]).pvalue, rel=1e-9)
    assert r["verdict"] == ("B worse" if ref[0] > 0 else "no significant difference")


def test_paired_ab_p_value_edges():
    rows = [{"arm": arm, "request_rate": 1.0, "seed": s, "output_throughput": v}
            for arm, vals in (("A", [10.0, 11.0, 12.0]), ("B", [12.0, 13.0, 14.0]))
            for s, v in enumerate(vals)]
    (r,) = paired_ab(rows, metrics=["output_throughput"])
    assert r["p_value"] == 0.0 and (r["ci_low"], r["ci_high"]) == (2.0, 2.0)
    assert r["verdict"] == "B better"
    same = [dict(x, output_throughput=1.0) for x in rows]
    (r,) = paired_ab(same, metrics=["output_throughput"])
    assert r["p_value"] == 1.0 and r["verdict"] == "no significant difference"
