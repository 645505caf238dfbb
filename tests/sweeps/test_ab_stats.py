"""A/B statistics on hand-made summary rows."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from servesim.reports.ab import (
    NO_DIFF,
    ab_csv_text,
    ab_rich_table,
    mean_ci,
    metric_direction,
    paired_ab,
    verdict,
)


def rows(effect_ttft=0.0, effect_tput=0.0, n=5, noise=30.0, rates=(1.0, 2.0), arms=("A", "B")):
    """Summary rows with seed-shared noise (CRN) and a per-arm effect for arms after the first."""
    out = []
    for rate in rates:
        for i, arm in enumerate(arms):
            for s in range(n):
                z = np.random.default_rng(s).normal(0, noise, 2)
                jitter = np.random.default_rng(1000 * i + s).normal(0, 1.0, 2)
                out.append({"arm": arm, "request_rate": rate, "seed": s,
                            "mean_ttft_ms": 100 + z[0] + jitter[0] + (effect_ttft if i else 0),
                            "output_throughput": 900 + z[1] + jitter[1]
                            + (effect_tput if i else 0),
                            "request_goodput": None})
    return out


def test_t_interval_matches_scipy():
    d = np.array([1.0, 3.0, 2.0, 5.0, 4.0])
    m, lo, hi = mean_ci(d)
    ref = stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
    assert m == 3.0 and lo == pytest.approx(ref[0]) and hi == pytest.approx(ref[1])


def test_bootstrap_interval_is_deterministic_and_sane():
    d = np.array([1.0, 3.0, 2.0, 5.0, 4.0, 2.5])
    a = mean_ci(d, method="bootstrap", n_boot=2000)
    assert a == mean_ci(d, method="bootstrap", n_boot=2000)
    assert a[1] < a[0] < a[2] and a[1] >= d.min() and a[2] <= d.max()


def test_directions_and_verdicts():
    assert metric_direction("p99_ttft_ms") == -1
    assert metric_direction("output_throughput") == 1
    assert metric_direction("request_goodput") == 1
    assert verdict("mean_ttft_ms", -5, -1, 5) == "B better"
    assert verdict("mean_ttft_ms", 1, 5, 5) == "B worse"
    assert verdict("output_throughput", 1, 5, 5) == "B better"
    assert verdict("output_throughput", -1, 5, 5) == NO_DIFF
    assert verdict("output_throughput", math.nan, math.nan, 1) == "insufficient data"


def test_aa_is_no_difference():
    ab = paired_ab(rows(0.0, 0.0))
    assert ab and {r["verdict"] for r in ab} == {NO_DIFF}
    assert {r["metric"] for r in ab} == {"mean_ttft_ms", "output_throughput"}  # goodput all null
    assert all(r["n"] == 5 and r["arm_a"] == "A" and r["arm_b"] == "B" for r in ab)


def test_identical_arms_give_zero_width_interval():
    r = rows()
    same = [dict(x, arm="B") if x["arm"] == "A" else None for x in r]
    ab = paired_ab([x for x in r if x["arm"] == "A"] + [x for x in same if x])
    assert all(x["diff"] == 0 and x["ci_low"] == 0 == x["ci_high"] for x in ab)
    assert {x["verdict"] for x in ab} == {NO_DIFF}


def test_planted_difference_detected_with_direction_and_pairing():
    # a 10 ms effect under 30 ms of shared noise: only the paired test can see it
    ab = paired_ab(rows(effect_ttft=10.0, effect_tput=-8.0))
    by = {(r["request_rate"], r["metric"]): r for r in ab}
    for rate in (1.0, 2.0):
        t = by[(rate, "mean_ttft_ms")]
        assert t["verdict"] == "B worse" and t["ci_low"] > 0
        assert t["rel_diff_pct"] == pytest.approx(100 * t["diff"] / t["mean_a"])
        assert by[(rate, "output_throughput")]["verdict"] == "B worse"
    better = paired_ab(rows(effect_ttft=-10.0), metrics=["mean_ttft_ms"], method="bootstrap")
    assert {r["verdict"] for r in better} == {"B better"}


def test_baseline_multiple_arms_dataframe_and_unpaired_seeds():
    r = rows(effect_ttft=50.0, arms=("A", "B", "C"))
    r = [x for x in r if not (x["arm"] == "C" and x["seed"] == 4)]  # C lost a seed
    ab = paired_ab(pd.DataFrame(r), baseline="B", metrics=["mean_ttft_ms"])
    pairs = {(x["arm_a"], x["arm_b"]) for x in ab}
    assert pairs == {("B", "A"), ("B", "C")}
    assert {x["n"] for x in ab if x["arm_b"] == "C"} == {4}
    assert {x["verdict"] for x in ab if x["arm_b"] == "A"} == {"B better"}  # A is 50 ms lower
    text = ab_csv_text(ab)
    assert text.splitlines()[0].startswith("request_rate,metric,arm_a,arm_b,n,")
    assert len(text.splitlines()) == 1 + len(ab)
    assert ab_rich_table(ab).row_count == len(ab)
    with pytest.raises(ValueError):
        paired_ab(r, baseline="Z")


def test_rates_as_strings_from_csv():
    r = rows(rates=(2.0,))
    for x in r:
        x["request_rate"] = "inf"
    ab = paired_ab(r, metrics=["mean_ttft_ms"])
    assert len(ab) == 1 and ab[0]["request_rate"] == math.inf
