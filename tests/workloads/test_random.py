"""vLLM ``random`` dataset + ``get_request`` arrivals, against an inline re-implementation."""

import math

import numpy as np
import pytest
from servesim.workloads import build_workload
from servesim.workloads.arrivals import vllm_arrival_times
from servesim.workloads.config import RandomWorkload


def vllm_random_lengths(seed, n, input_len, output_len, range_ratio, prefix_len):
    """vLLM RandomDataset.get_sampling_params / sample (no tokenizer special tokens)."""
    rng = np.random.default_rng(seed)
    input_low = math.floor(input_len * (1 - range_ratio))
    input_high = math.ceil(input_len * (1 + range_ratio))
    output_low = max(math.floor(output_len * (1 - range_ratio)), 1)
    output_high = max(math.ceil(output_len * (1 + range_ratio)), 1)
    input_lens = rng.integers(input_low, input_high + 1, size=n)
    output_lens = rng.integers(output_low, output_high + 1, size=n)
    return [prefix_len + int(x) for x in input_lens], [int(x) for x in output_lens]


def vllm_get_request_delays(n, request_rate, burstiness, seed, strategy=None, start=None,
                            end=None):
    """vLLM serve.py get_request delay_ts (global legacy RNG, as vLLM seeds it)."""
    np.random.seed(seed)
    delay_ts = []
    for i in range(n):
        rate = request_rate
        if strategy and start is not None and end is not None:
            progress = i / max(n - 1, 1)
            if strategy == "linear":
                rate = start + (end - start) * progress
            else:
                rate = start * ((end / start) ** progress)
        if rate == float("inf"):
            delay_ts.append(0)
        elif burstiness == float("inf"):
            delay_ts.append(1.0 / rate)
        else:
            theta = 1.0 / (rate * burstiness)
            delay_ts.append(np.random.gamma(shape=burstiness, scale=theta))
    for i in range(1, len(delay_ts)):
        delay_ts[i] += delay_ts[i - 1]
    if strategy is None and delay_ts[-1] != 0:
        factor = (n / request_rate) / delay_ts[-1]
        delay_ts = [d * factor for d in delay_ts]
    return delay_ts


@pytest.mark.parametrize(
    "kw",
    [
        {"num_prompts": 300, "input_len": 1024, "output_len": 128, "range_ratio": 0.0, "request_rate": 5.0},
        {"num_prompts": 257, "input_len": 1000, "output_len": 77, "range_ratio": 0.33, "prefix_len": 40,
             "request_rate": 3.5, "burstiness": 0.25, "seed": 7},
        {"num_prompts": 100, "input_len": 10, "output_len": 1, "range_ratio": 0.8, "seed": 3},
        {"num_prompts": 50, "input_len": 64, "output_len": 8, "request_rate": 2.0,
             "burstiness": float("inf"), "seed": 1},
    ],
)
def test_random_matches_vllm(kw):
    cfg = RandomWorkload(**kw)
    reqs = list(build_workload(cfg, block_size=16))
    ins, outs = vllm_random_lengths(cfg.seed, cfg.num_prompts, cfg.input_len, cfg.output_len,
                                    cfg.range_ratio, cfg.prefix_len)
    delays = vllm_get_request_delays(cfg.num_prompts, cfg.request_rate, cfg.burstiness, cfg.seed)
    assert [r.prompt_len for r in reqs] == ins
    assert [r.output_len for r in reqs] == outs
    assert [r.arrival_s for r in reqs] == [float(d) for d in delays]
    assert [r.request_id for r in reqs] == [str(i) for i in range(cfg.num_prompts)]


@pytest.mark.parametrize("strategy", ["linear", "exponential"])
def test_ramp_up_matches_vllm(strategy):
    cfg = RandomWorkload(num_prompts=200, ramp_up_strategy=strategy, ramp_up_start_rps=1,
                         ramp_up_end_rps=20, seed=11)
    wl = build_workload(cfg, block_size=16)
    got = [r.arrival_s for r in wl]
    want = vllm_get_request_delays(200, math.inf, 1.0, 11, strategy, 1, 20)
    np.testing.assert_allclose(got, want, rtol=1e-15)
    assert wl.meta["ramp_up_strategy"] == strategy and wl.meta["ramp_up_end_rps"] == 20


def test_chunked_arrivals_equal_single_pass():
    n = 150_000  # > 2 chunks
    got = np.concatenate(list(vllm_arrival_times(n, 100.0, 0.5, 5)))
    rs = np.random.RandomState(5)
    d = rs.gamma(0.5, 1.0 / (100.0 * 0.5), size=n)
    c = np.cumsum(d)
    c = c * ((n / 100.0) / c[-1])
    assert np.array_equal(got, c)


def test_inf_rate_all_at_zero_and_meta():
    wl = build_workload(RandomWorkload(num_prompts=10, max_concurrency=4), block_size=16)
    assert all(r.arrival_s == 0 for r in wl)
    m = wl.meta
    assert m["num_prompts"] == 10 and math.isinf(m["request_rate"]) and m["burstiness"] == 1.0
    assert m["max_concurrency"] == 4 and m["dataset_name"] == "random"
    assert m["num_requests"] == 10


@pytest.mark.parametrize("b,cv", [(1.0, 1.0), (0.25, 2.0)])
def test_burstiness_statistics(b, cv):
    n, rate = 20_000, 10.0
    wl = build_workload(RandomWorkload(num_prompts=n, request_rate=rate, burstiness=b, seed=2),
                        block_size=16)
    t = np.array([r.arrival_s for r in wl])
    assert t[-1] == pytest.approx(n / rate, rel=1e-12)  # rescaled: last = N/rate
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)  # CV = 1/sqrt(b)
    assert np.all(np.diff(t) >= 0)


def test_prefix_len_blocks_shared():
    cfg = RandomWorkload(num_prompts=20, input_len=100, output_len=10, prefix_len=40)
    reqs = list(build_workload(cfg, block_size=16))
    assert all(r.prefix_block_ids == reqs[0].prefix_block_ids for r in reqs)
    assert len(reqs[0].prefix_block_ids) == 2  # 40 // 16; the partial block is unique
    assert all(r.prompt_len == 140 for r in reqs)
    assert next(iter(build_workload(cfg.model_copy(update={"prefix_len": 0}), block_size=16))).prefix_block_ids is None


def test_repeatable_iteration():
    wl = build_workload(RandomWorkload(num_prompts=50, request_rate=4, range_ratio=0.5),
                        block_size=16)
    assert [(r.arrival_s, r.prompt_len) for r in wl] == [(r.arrival_s, r.prompt_len) for r in wl]


def test_long_requests_modes():
    base = {"num_prompts": 100, "input_len": 100, "output_len": 50, "range_ratio": 0.5, "prefix_len": 32}
    keep = build_workload(RandomWorkload(**base), block_size=16, max_model_len=150)
    n_long = sum(r.prompt_len + r.output_len > 150 for r in keep)
    assert n_long > 0 and keep.meta["too_long"] == n_long and keep.meta["rejected"] == 0
    rej = build_workload(RandomWorkload(**base, long_requests="reject"), block_size=16,
                         max_model_len=150)
    assert len(list(rej)) == 100 - n_long and rej.meta["rejected"] == n_long
    cl = build_workload(RandomWorkload(**base, long_requests="clamp"), block_size=16,
                        max_model_len=150)
    rs = list(cl)
    assert len(rs) == 100 and cl.meta["clamped"] == n_long
    assert all(r.prompt_len + r.output_len <= 150 and r.output_len >= 1 for r in rs)


def test_ramp_up_config_checks():
    with pytest.raises(ValueError):
        RandomWorkload(input_len=10, range_ratio=0.95)
    with pytest.raises(ValueError):
        RandomWorkload(ramp_up_strategy="linear", ramp_up_start_rps=1)
    with pytest.raises(ValueError):
        RandomWorkload(ramp_up_strategy="linear", ramp_up_start_rps=1, ramp_up_end_rps=2,
                       request_rate=3)
    assert math.isinf(RandomWorkload(request_rate="inf").request_rate)
