"""Length distributions and arrival processes by value: mean, spread and bounds (inclusive or
exclusive as documented) within sampling error. Seeds are fixed, so each check is
deterministic; tolerances are 5 standard errors of the estimate (a correct sampler would fail
a fresh seed with probability ~1e-6), small enough that a wrong parameter fails by far.

Standard errors used: mean σ/√n; standard deviation ≈ σ/√(2n) (normal) and, for skewed
samples, the delta-method √((m4 − σ⁴)/(4σ²n)) from the sample's own fourth moment; a
proportion √(p(1 − p)/n); a Poisson count √λ.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from servesim.workloads import build_workload
from servesim.workloads.arrivals import gamma_renewal_unit, ramp_up_rate, vllm_arrival_times
from servesim.workloads.config import (
    EmpiricalDist,
    ExponentialDist,
    FixedDist,
    LognormalDist,
    PrefixGroups,
    RandomWorkload,
    RateProfile,
    SessionsWorkload,
    SyntheticWorkload,
    UniformDist,
)
from servesim.workloads.generators import (
    SYNTHETIC_GROUP_BASE,
    LengthSampler,
    profile_arrivals,
    random_len_bounds,
)

Z = 5.0
N = 40_000


def sampler(dist, seed=0, **kw):
    return LengthSampler(dist, np.random.default_rng(seed), **kw)


def assert_mean(x, mu, sigma, what=""):
    se = sigma / math.sqrt(len(x))
    assert abs(np.mean(x) - mu) <= Z * se, f"{what}: mean {np.mean(x)} vs {mu} ± {Z * se}"


def assert_std(x, sigma, what=""):
    """Sample std vs sigma, SE from the sample's fourth central moment (delta method)."""
    x = np.asarray(x, dtype=float)
    m4 = np.mean((x - x.mean()) ** 4)
    se = math.sqrt(max(m4 - sigma**4, 1e-300) / (4 * sigma**2 * len(x)))
    assert abs(np.std(x) - sigma) <= Z * se, f"{what}: std {np.std(x)} vs {sigma} ± {Z * se}"


def assert_share(k, n, p, what=""):
    se = math.sqrt(p * (1 - p) / n)
    assert abs(k / n - p) <= Z * se, f"{what}: {k}/{n} vs {p} ± {Z * se}"


# ---------------------------------------------------------------------------------------------
# length distributions


def test_fixed():
    assert sampler(FixedDist(value=77)).sample(5).tolist() == [77] * 5
    assert sampler(FixedDist(value=2.6)).sample(3).tolist() == [3] * 3  # rounded
    assert sampler(FixedDist(value=0)).sample(2).tolist() == [1, 1]  # at least 1 token
    assert sampler(FixedDist(value=0.25), integer=False).sample(2).tolist() == [0.25, 0.25]


@pytest.mark.parametrize("low,high", [(10, 20), (1, 1), (100, 1000)])
def test_uniform_integers_inclusive(low, high):
    """Integers uniform on [low, high], both ends included: mean (l + h)/2, variance
    ((h − l + 1)² − 1)/12."""
    x = sampler(UniformDist(low=low, high=high), seed=1).sample(N)
    assert x.dtype.kind == "i"
    assert x.min() == low and x.max() == high
    sigma = math.sqrt(((high - low + 1) ** 2 - 1) / 12)
    if sigma:
        assert_mean(x, (low + high) / 2, sigma, "uniform")
        assert_std(x, sigma, "uniform")
        # every value equally likely: the two end values each ≈ 1/(h − l + 1)
        k = high - low + 1
        if k <= 20:
            for v in (low, high):
                assert_share((x == v).sum(), N, 1 / k, f"P({v})")


def test_uniform_reals_for_think_times():
    """integer=False: reals on [low, high): mean (l + h)/2, std (h − l)/√12."""
    x = sampler(UniformDist(low=2.0, high=5.0), seed=2, integer=False).sample(N)
    assert x.dtype.kind == "f" and (x >= 2.0).all() and (x < 5.0).all()
    assert_mean(x, 3.5, 3 / math.sqrt(12), "uniform real")
    assert_std(x, 3 / math.sqrt(12), "uniform real")
    assert len(np.unique(x)) > N // 2  # not rounded


def test_lognormal_median_sigma_and_clipping():
    """exp(N(ln median, σ²)): log-mean ln(median) (SE σ/√n), log-std σ; rounded to integers,
    clipped to [min, max] with the clipped mass P(X > max) at max."""
    med, sig = 400.0, 0.8
    x = sampler(LognormalDist(median=med, sigma=sig), seed=3).sample(N)
    lx = np.log(x)
    assert_mean(lx, math.log(med), sig, "log mean")
    assert abs(np.std(lx) - sig) <= Z * sig / math.sqrt(2 * N) + 0.002  # + rounding jitter
    assert_mean(x, med * math.exp(sig**2 / 2), med * math.sqrt(
        (math.exp(sig**2) - 1) * math.exp(sig**2)), "mean")
    assert np.array_equal(x, np.rint(x))
    hi, lo = 900, 50
    c = sampler(LognormalDist(median=med, sigma=sig, min=lo, max=hi), seed=3).sample(N)
    assert c.min() == lo and c.max() == hi
    p_hi = 0.5 * math.erfc(math.log(hi / med) / (sig * math.sqrt(2)))
    p_lo = 0.5 * math.erfc(-math.log(lo / med) / (sig * math.sqrt(2)))
    assert_share((c == hi).sum(), N, p_hi, "mass at max")
    assert_share((c == lo).sum(), N, p_lo, "mass at min")
    # same stream: clipping only moves the tails
    assert np.array_equal(c, np.clip(x, lo, hi))


def test_exponential_mean_not_rate():
    """mean = scale: the sample mean and std both ≈ mean (rate 1/mean)."""
    mu = 120.0
    r = sampler(ExponentialDist(mean=mu), seed=4, integer=False).sample(N)
    assert (r >= 0).all()
    assert_mean(r, mu, mu, "exponential")
    assert_std(r, mu, "exponential")
    assert_share((r > mu).sum(), N, math.exp(-1), "P(X > mean)")
    # tokens: the same draws rounded, at least 1
    t = sampler(ExponentialDist(mean=mu), seed=4).sample(N)
    assert np.array_equal(t, np.maximum(np.rint(r), 1).astype(np.int64))


def test_minimum_applies_to_rounded_values():
    x = sampler(ExponentialDist(mean=0.3), seed=5, minimum=2).sample(1000)
    assert x.min() == 2


def test_empirical_resamples_the_trace_column(tmp_path):
    p = tmp_path / "t.csv"
    rows = [(0.1 * i, 100 * (1 + i % 3), 7 + (i % 2)) for i in range(30)]
    p.write_text("arrival_s,prompt_len,output_len\n"
                 + "".join(f"{a},{b},{c}\n" for a, b, c in rows))
    x = sampler(EmpiricalDist(path=str(p)), seed=6).sample(N)
    assert set(x.tolist()) == {100, 200, 300}
    for v in (100, 200, 300):
        assert_share((x == v).sum(), N, 1 / 3, f"P({v})")
    y = sampler(EmpiricalDist(path=str(p), column="output_len"), seed=6).sample(N)
    assert set(y.tolist()) == {7, 8}
    assert_share((y == 8).sum(), N, 0.5, "P(8)")


# ---------------------------------------------------------------------------------------------
# vLLM random dataset


@pytest.mark.parametrize("L,O,r", [(1024, 128, 0.0), (1000, 77, 0.33), (10, 1, 0.8),
                                   (5, 3, 0.5)])
def test_random_len_bounds_inclusive(L, O, r):
    lo, hi, olo, ohi = random_len_bounds(L, O, r)
    assert (lo, hi) == (math.floor(L * (1 - r)), math.ceil(L * (1 + r)))
    assert (olo, ohi) == (max(math.floor(O * (1 - r)), 1), max(math.ceil(O * (1 + r)), 1))
    wl = build_workload(RandomWorkload(num_prompts=4000, input_len=L, output_len=O,
                                       range_ratio=r, prefix_len=3, seed=7), block_size=16)
    reqs = list(wl)
    p = np.array([x.prompt_len for x in reqs]) - 3
    o = np.array([x.output_len for x in reqs])
    assert (p.min(), p.max()) == (lo, hi)  # both ends drawn: inclusive
    assert (o.min(), o.max()) == (olo, ohi)
    if hi > lo:
        assert_mean(p, (lo + hi) / 2, math.sqrt(((hi - lo + 1) ** 2 - 1) / 12), "input")


def test_random_range_ratio_per_side():
    """``--random-range-ratio '{"input": 0.3, "output": 0.5}'`` (vLLM
    ``_resolve_range_ratios``): input lengths on [floor(1024·0.7), ceil(1024·1.3)] =
    [716, 1332], outputs on [64, 192], drawn as vLLM does: all inputs, then all outputs, from
    one ``default_rng(seed)``."""
    from servesim.simulator.config import load_config

    cfg = load_config(None, ["workload.range_ratio={input: 0.3, output: 0.5}",
                             "workload.num_prompts=500", "workload.seed=3"]).workload
    assert cfg.range_ratios == (0.3, 0.5)
    reqs = list(build_workload(cfg, block_size=16))
    rng = np.random.default_rng(3)
    ins, outs = rng.integers(716, 1333, size=500), rng.integers(64, 193, size=500)
    assert [r.prompt_len for r in reqs] == ins.tolist()
    assert [r.output_len for r in reqs] == outs.tolist()
    assert RandomWorkload(range_ratio=0.25).range_ratios == (0.25, 0.25)
    assert RandomWorkload(range_ratio={"input": 0.25, "output": 0.25}).range_ratio == 0.25
    with pytest.raises(ValueError, match="output"):
        RandomWorkload(range_ratio={"input": 0.3, "output": 1.0})
    with pytest.raises(ValueError, match="output"):
        RandomWorkload(range_ratio={"input": 0.3})
    from servesim.simulator.errors import ConfigError

    # the one-line error names the key inside the dict, not the float branch of the union
    with pytest.raises(ConfigError, match=r"workload.range_ratio.output: input should be less "
                       r"than 1 \(got 1.5\)"):
        load_config(None, ["workload.range_ratio={input: 0.3, output: 1.5}"])


def test_random_len_bounds_rejects_ratio_one():
    with pytest.raises(ValueError):
        random_len_bounds(100, 10, 1.0)


# ---------------------------------------------------------------------------------------------
# arrival processes


@pytest.mark.parametrize("rate,b", [(5.0, 1.0), (20.0, 0.25), (2.0, 4.0)])
def test_gamma_arrivals_rate_and_cv(rate, b):
    """Gaps ~ Gamma(shape b, mean 1/rate): CV 1/√b; rescaled so the last arrival is N/rate
    exactly; the first request goes out after its own gap, not at 0."""
    t = np.concatenate(list(vllm_arrival_times(N, rate, b, seed=8)))
    assert t[-1] == pytest.approx(N / rate, rel=1e-12)
    gaps = np.diff(np.r_[0.0, t])
    assert t[0] > 0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-12)
    cv = 1 / math.sqrt(b)
    assert_std(gaps * rate, cv, "CV")
    # Poisson (b = 1): counts per unit window are Poisson(rate)
    if b == 1.0:
        counts = np.bincount(t.astype(np.int64))[:-1]
        assert_mean(counts, rate, math.sqrt(rate), "counts")
        assert_std(counts, math.sqrt(rate), "count std")


def test_constant_arrivals_with_infinite_burstiness():
    t = np.concatenate(list(vllm_arrival_times(100, 4.0, math.inf, seed=9)))
    np.testing.assert_allclose(t, np.arange(1, 101) / 4.0, rtol=1e-12)


def test_infinite_rate_sends_everything_at_zero():
    t = np.concatenate(list(vllm_arrival_times(50, math.inf, 1.0, seed=1)))
    assert (t == 0).all()


@pytest.mark.parametrize("strategy", ["linear", "exponential"])
def test_ramp_up_rates_and_gaps(strategy):
    """Request i's rate: linear s + (e − s)·i/(N − 1), exponential s·(e/s)^(i/(N − 1)); its
    gap ~ Exp(rate_i) (not rescaled). Mean gap over each decile ≈ mean of 1/rate_i."""
    n, s, e = N, 2.0, 50.0
    idx = np.arange(n)
    rates = ramp_up_rate(strategy, s, e, idx, n, math.inf)
    prog = idx / (n - 1)
    want = s + (e - s) * prog if strategy == "linear" else s * (e / s) ** prog
    np.testing.assert_allclose(rates, want, rtol=1e-12)
    assert rates[0] == s and rates[-1] == pytest.approx(e)
    t = np.concatenate(list(vllm_arrival_times(n, math.inf, 1.0, 3, strategy, s, e)))
    gaps = np.diff(np.r_[0.0, t])
    for part in np.array_split(np.arange(n), 10):
        inv = 1 / rates[part]
        se = math.sqrt(np.sum(inv**2)) / len(part)
        assert abs(gaps[part].mean() - inv.mean()) <= Z * se
    assert ramp_up_rate(None, None, None, idx[:3], n, 7.0).tolist() == [7.0] * 3


def test_gamma_renewal_unit_rate():
    rs = np.random.RandomState(4)
    t = np.concatenate(list(gamma_renewal_unit(N, 0.5, rs)))
    gaps = np.diff(np.r_[0.0, t])
    assert_mean(gaps, 1.0, math.sqrt(2.0), "unit gaps")
    assert_std(gaps, math.sqrt(2.0), "unit CV")
    t = np.concatenate(list(gamma_renewal_unit(10, math.inf, rs)))
    assert t.tolist() == [float(i) for i in range(1, 11)]


def test_piecewise_profile_counts_per_segment():
    """Rate 30/s on [0, 100), 0 on [100, 150), then 5/s: counts ~ Poisson(rate·length)."""
    prof = RateProfile(kind="piecewise", points=[(0, 30.0), (100, 0.0), (150, 5.0)])
    t = np.concatenate(list(profile_arrivals(4000, prof, math.inf, 1.0, seed=2)))
    assert (np.diff(t) >= 0).all()
    a = ((t >= 0) & (t < 100)).sum()
    assert abs(a - 3000) <= Z * math.sqrt(3000)
    assert ((t >= 100) & (t < 150)).sum() == 0  # rate 0: nothing arrives
    rest = t[t >= 150]
    assert len(rest) == 4000 - a
    span = 150 + len(rest) / 5.0
    assert abs(rest[-1] - span) <= Z * math.sqrt(len(rest)) / 5.0


def test_diurnal_profile_follows_the_sine():
    """rate(t) = mean·(1 + A·sin(2πt/P + φ)), stepped every resolution_s: counts per step
    ~ Poisson(rate at the step's middle × step)."""
    mean, A, P, res = 20.0, 0.6, 200.0, 10.0
    prof = RateProfile(kind="diurnal", period_s=P, amplitude=A, resolution_s=res, phase=0.5)
    n = 12_000
    t = np.concatenate(list(profile_arrivals(n, prof, mean, 1.0, seed=6)))
    full = int(t[-1] // res)  # complete steps only
    counts = np.bincount((t // res).astype(np.int64))[:full]
    mids = (np.arange(full) + 0.5) * res
    lam = mean * (1 + A * np.sin(2 * np.pi * mids / P + 0.5)) * res
    z = (counts - lam) / np.sqrt(lam)
    assert abs(z.mean()) <= Z / math.sqrt(full)
    assert abs(np.corrcoef(counts, lam)[0, 1]) > 0.9
    assert t[-1] == pytest.approx(n / mean, rel=0.05)


def test_diurnal_needs_a_finite_mean_rate():
    prof = RateProfile(kind="diurnal")
    with pytest.raises(ValueError, match="finite request_rate"):
        next(profile_arrivals(10, prof, math.inf, 1.0, seed=0))


# ---------------------------------------------------------------------------------------------
# synthetic workloads and sessions


def test_synthetic_lengths_groups_and_shares():
    """Prompt = sampled input + the group prompt (for the `fraction` of requests that use a
    group, group k chosen with probability ∝ 1/k^s); block ids = group length // block size."""
    g = PrefixGroups(num_groups=3, lengths=[64, 200], zipf_s=1.5, fraction=0.7)
    cfg = SyntheticWorkload(num_prompts=N, request_rate=100, seed=11,
                            input=UniformDist(low=10, high=30),
                            output=ExponentialDist(mean=50), prefix_groups=g)
    reqs = list(build_workload(cfg, block_size=16))
    glen = [64, 200, 64]  # lengths cycled over groups
    ids = [r.prefix_block_ids for r in reqs]
    use = np.array([i is not None for i in ids])
    assert_share(use.sum(), N, 0.7, "fraction using a group")
    grp = np.array([(i[0] - SYNTHETIC_GROUP_BASE) >> 24 if i else -1 for i in ids])
    w = 1 / np.arange(1, 4) ** 1.5
    w /= w.sum()
    for k in range(3):
        assert_share((grp == k).sum(), use.sum(), w[k], f"group {k}")
        sel = np.flatnonzero(grp == k)
        assert all(len(ids[i]) == glen[k] // 16 for i in sel[:50])
    base = np.array([r.prompt_len for r in reqs]) - np.where(
        grp >= 0, np.array(glen)[np.maximum(grp, 0)], 0)
    assert base.min() == 10 and base.max() == 30
    assert_mean(base, 20, math.sqrt((21**2 - 1) / 12), "input")
    o = np.array([r.output_len for r in reqs])
    assert_mean(o, 50, 50, "output")  # rounding of Exp(50) moves the mean by < 0.01
    t = np.array([r.arrival_s for r in reqs])
    assert t[-1] == pytest.approx(N / 100, rel=1e-12)


def test_sessions_turns_inputs_and_think_times():
    """Turn counts from `turns`, turn k+1 prompt = prompt_k + output_k + user input; think
    times (seconds, not rounded) from `think_time_s`; sessions arrive at session_rate."""
    cfg = SessionsWorkload(num_sessions=3000, session_rate=10, seed=12,
                           turns=UniformDist(low=1, high=4), system_prompt_len=32,
                           first_input=FixedDist(value=100), user_input=UniformDist(low=5, high=9),
                           output=FixedDist(value=20), think_time_s=ExponentialDist(mean=3.0))
    reqs = list(build_workload(cfg, block_size=16, max_model_len=100_000))
    by = {}
    for r in reqs:
        by.setdefault(r.session_id, []).append(r)
    turns = np.array([len(v) for v in by.values()])
    assert turns.min() == 1 and turns.max() == 4
    assert_mean(turns, 2.5, math.sqrt((16 - 1) / 12), "turns")
    think, user = [], []
    for v in by.values():
        assert v[0].prompt_len == 132 and v[0].think_time_s == 0.0
        for a, b in itertools.pairwise(v):
            user.append(b.prompt_len - a.prompt_len - a.output_len)
            think.append(b.think_time_s)
            assert b.parent_id == a.request_id and b.arrival_s == a.arrival_s
    assert min(user) == 5 and max(user) == 9
    think = np.array(think)
    assert len(np.unique(think)) == len(think)  # real-valued
    assert_mean(think, 3.0, 3.0, "think time")
    starts = np.array([v[0].arrival_s for v in by.values()])
    assert starts[-1] == pytest.approx(3000 / 10, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# chunked generation equals one pass; edge rules


def test_random_workload_chunks_equal_a_single_pass(monkeypatch):
    """Lengths and arrivals are drawn in CHUNK-sized pieces; with a tiny chunk they must equal
    vLLM's single-pass draws: default_rng(seed).integers for all inputs, then all outputs;
    legacy RandomState(seed).standard_gamma for the gaps, cumulated and rescaled."""
    from servesim.workloads import arrivals, generators

    monkeypatch.setattr(arrivals, "CHUNK", 7)
    monkeypatch.setattr(generators, "CHUNK", 7)
    n, seed = 50, 21
    cfg = RandomWorkload(num_prompts=n, input_len=100, output_len=20, range_ratio=0.5,
                         request_rate=3.0, burstiness=0.5, seed=seed)
    reqs = list(build_workload(cfg, block_size=16))
    rng = np.random.default_rng(seed)
    ins = rng.integers(50, 150 + 1, size=n)
    outs = rng.integers(10, 30 + 1, size=n)
    gaps = np.random.RandomState(seed).standard_gamma(0.5, size=n) * (1 / (3.0 * 0.5))
    t = np.cumsum(gaps)
    t *= (n / 3.0) / t[-1]
    assert [r.prompt_len for r in reqs] == ins.tolist()
    assert [r.output_len for r in reqs] == outs.tolist()
    np.testing.assert_allclose([r.arrival_s for r in reqs], t, rtol=1e-12)


def test_profile_arrivals_chunks_equal_a_single_pass(monkeypatch):
    from servesim.workloads import arrivals

    prof = RateProfile(kind="piecewise", points=[(0, 2.0), (3, 5.0), (7, 1.0)])
    whole = np.concatenate(list(profile_arrivals(40, prof, math.inf, 1.0, seed=4)))
    monkeypatch.setattr(arrivals, "CHUNK", 6)
    parts = np.concatenate(list(profile_arrivals(40, prof, math.inf, 1.0, seed=4)))
    np.testing.assert_allclose(parts, whole, rtol=1e-12)
    # time rescaling by hand: unit-rate event times u mapped through Λ⁻¹
    u = np.cumsum(np.random.RandomState(4).standard_gamma(1.0, size=40))
    lam = np.interp(u, [0, 6, 26, 1e9], [0, 3, 7, 7 + (1e9 - 26)])
    np.testing.assert_allclose(whole, lam, rtol=1e-9)


def test_short_prefix_group_has_no_block_ids():
    g = PrefixGroups(num_groups=1, lengths=[8], fraction=1.0)
    cfg = SyntheticWorkload(num_prompts=5, seed=1, input=FixedDist(value=10),
                            output=FixedDist(value=3), prefix_groups=g)
    reqs = list(build_workload(cfg, block_size=16))
    assert all(r.prompt_len == 18 and r.prefix_block_ids is None for r in reqs)


def test_session_keeps_a_first_turn_over_the_limit():
    """A session ends *before* a later turn would exceed max_context_len; its first turn is
    always sent (the engine rejects it if it cannot run)."""
    cfg = SessionsWorkload(num_sessions=2, turns=FixedDist(value=3),
                           first_input=FixedDist(value=500), user_input=FixedDist(value=10),
                           output=FixedDist(value=100), max_context_len=400)
    reqs = list(build_workload(cfg, block_size=16))
    assert [(r.session_id, r.turn, r.prompt_len) for r in reqs] == [("s0", 0, 500),
                                                                     ("s1", 0, 500)]
    cfg2 = cfg.model_copy(update={"max_context_len": 720})
    reqs = list(build_workload(cfg2, block_size=16))
    # turn 1: 500 + 100 + 10 = 610 prompt + 100 output = 710 ≤ 720; turn 2 would be 820
    assert [(r.turn, r.prompt_len) for r in reqs if r.session_id == "s0"] == [(0, 500),
                                                                             (1, 610)]


def test_generators_are_deterministic_and_ids_well_formed():
    """Same config → identical requests (every field); request ids 0..n−1 in order; block
    ids in their documented ranges, distinct where content differs."""
    from servesim.workloads.generators import (
        RANDOM_PREFIX_BASE,
        SESSION_BASE,
        SESSION_SYSTEM_BASE,
    )

    syn = SyntheticWorkload(num_prompts=300, request_rate=10, seed=5,
                            input=LognormalDist(median=100, sigma=0.5),
                            output=ExponentialDist(mean=20),
                            prefix_groups=PrefixGroups(num_groups=2, lengths=[32, 48]))
    ses = SessionsWorkload(num_sessions=40, session_rate=3, seed=6, system_prompt_len=40,
                           turns=UniformDist(low=1, high=3), output=ExponentialDist(mean=30),
                           user_input=UniformDist(low=1, high=50))
    for cfg in (syn, ses, RandomWorkload(num_prompts=50, request_rate=2, prefix_len=40,
                                         range_ratio=0.5, seed=7)):
        a = [dataclasses.asdict(r) for r in build_workload(cfg, block_size=16,
                                                           max_model_len=10_000)]
        b = [dataclasses.asdict(r) for r in build_workload(cfg, block_size=16,
                                                           max_model_len=10_000)]
        assert a == b
    rs = list(build_workload(syn, block_size=16))
    assert [r.request_id for r in rs] == [str(i) for i in range(300)]
    g = {r.prefix_block_ids for r in rs}
    assert {len(x) for x in g} == {2, 3}
    for ids in g:
        base = SYNTHETIC_GROUP_BASE + ((ids[0] - SYNTHETIC_GROUP_BASE) >> 24 << 24)
        assert list(ids) == [base + j for j in range(len(ids))]
    rnd = list(build_workload(RandomWorkload(num_prompts=3, prefix_len=40), block_size=16))
    assert rnd[0].prefix_block_ids == (RANDOM_PREFIX_BASE, RANDOM_PREFIX_BASE + 1)
    sess = list(build_workload(ses, block_size=16, max_model_len=10_000))
    own = []
    for r in sess:
        assert r.prefix_block_ids[:2] == (SESSION_SYSTEM_BASE, SESSION_SYSTEM_BASE + 1)
        if r.turn == 0:
            own += [x for x in r.prefix_block_ids[2:]]
    assert len(own) == len(set(own)) and min(own) == SESSION_BASE
    assert [r.request_id for r in sess if r.session_id == "s0"] == [
        f"s0-t{k}" for k in range(sum(r.session_id == "s0" for r in sess))]
