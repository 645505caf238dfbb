"""kind: synthetic and kind: sessions."""

import numpy as np
import pytest
from servesim.workloads import build_workload
from servesim.workloads.config import (
    FixedDist,
    LognormalDist,
    PrefixGroups,
    RateProfile,
    SessionsWorkload,
    SyntheticWorkload,
    UniformDist,
)


def test_synthetic_lengths_and_groups():
    cfg = SyntheticWorkload(
        num_prompts=4000, request_rate=50, seed=3,
        input=LognormalDist(median=500, sigma=0.5), output=UniformDist(low=10, high=20),
        prefix_groups=PrefixGroups(num_groups=4, lengths=[64, 128, 256, 512], zipf_s=1.0),
    )
    r = list(build_workload(cfg, block_size=16))
    assert len(r) == 4000 and r[-1].arrival_s == pytest.approx(4000 / 50)
    o = np.array([x.output_len for x in r])
    assert o.min() >= 10 and o.max() <= 20
    groups = [len(x.prefix_block_ids) for x in r]
    counts = {g: groups.count(g) for g in set(groups)}
    assert set(counts) == {4, 8, 16, 32}
    assert counts[4] > counts[8] > counts[16] > counts[32]  # Zipf popularity
    assert counts[4] / counts[8] == pytest.approx(2.0, rel=0.15)
    sampled = np.array([x.prompt_len - len(x.prefix_block_ids) * 16 for x in r])
    assert np.median(sampled) == pytest.approx(500, rel=0.05)
    again = [(x.arrival_s, x.prompt_len) for x in build_workload(cfg, block_size=16)]
    assert again == [(x.arrival_s, x.prompt_len) for x in r]


def test_piecewise_rate_profile():
    prof = RateProfile(kind="piecewise", points=[(0, 10.0), (100, 1.0)])
    cfg = SyntheticWorkload(num_prompts=1100, rate_profile=prof, seed=1,
                            input=FixedDist(value=10), output=FixedDist(value=5))
    t = np.array([x.arrival_s for x in build_workload(cfg, block_size=16)])
    assert np.all(np.diff(t) >= 0)
    first = (t < 100).sum()
    assert first == pytest.approx(1000, rel=0.1)  # 10 req/s for 100 s
    assert (len(t) - first) / (t[-1] - 100) == pytest.approx(1.0, rel=0.25)


def test_diurnal_profile():
    prof = RateProfile(kind="diurnal", period_s=1000, amplitude=0.8, resolution_s=10)
    cfg = SyntheticWorkload(num_prompts=20000, request_rate=10, rate_profile=prof, seed=2)
    t = np.array([x.arrival_s for x in build_workload(cfg, block_size=16)])
    h, _ = np.histogram(t % 1000, bins=4, range=(0, 1000))
    assert h[0] > 2 * h[2] and h[1] > 2 * h[3]  # peak in the first half-period


def test_sessions_prefix_chain():
    cfg = SessionsWorkload(num_sessions=20, session_rate=2, system_prompt_len=100,
                           turns=FixedDist(value=3), first_input=FixedDist(value=50),
                           user_input=FixedDist(value=20), output=FixedDist(value=30))
    wl = build_workload(cfg, block_size=16)
    r = list(wl)
    assert len(r) == 60 and wl.meta["num_sessions"] == 20
    t = [x.arrival_s for x in r]
    assert t == sorted(t)
    s0 = [x for x in r if x.session_id == "s0"]
    assert [x.turn for x in s0] == [0, 1, 2]
    assert [x.prompt_len for x in s0] == [150, 200, 250]  # prev prompt + output + 20
    assert s0[1].parent_id == s0[0].request_id and s0[0].parent_id is None
    assert s0[1].think_time_s > 0 and s0[0].think_time_s == 0
    a, b, c = (x.prefix_block_ids for x in s0)
    assert len(a) == (150 + 30) // 16 and len(b) == (200 + 30) // 16
    assert b[: len(a)] == a and c[: len(b)] == b
    other = next(x for x in r if x.session_id == "s1")
    assert other.prefix_block_ids[:6] == a[:6]  # shared system prompt: 100 // 16 blocks
    assert other.prefix_block_ids[6] != a[6]


def test_sessions_end_at_max_model_len():
    cfg = SessionsWorkload(num_sessions=5, turns=10,  # bare number = fixed
                           first_input=FixedDist(value=100), user_input=FixedDist(value=100),
                           output=FixedDist(value=100))
    r = list(build_workload(cfg, block_size=16, max_model_len=700))
    assert all(x.prompt_len + x.output_len <= 700 for x in r)
    assert max(x.turn for x in r) == 2
