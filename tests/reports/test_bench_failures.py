"""result.json of runs with failed requests, as ``vllm bench serve`` 0.22.1 writes it: the
duration lasts until every request has ended (``asyncio.gather``), failures included; with no
successful request the throughputs and the peak output rate are 0.0; the detailed ``ttfts``
keep a failed request's TTFT when its first token came; ``--metadata`` keys follow
``num_prompts``."""

import numpy as np
import pytest
from servesim.reports.bench_result import compute_bench_result
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.runner import run_experiment

DATE = "20260101-000000"


def run(*overrides):
    return run_experiment(resolve_config(load_config(None, list(overrides))), resolved=True)


def test_duration_lasts_until_the_last_timeout():
    """40 requests at once, 30 to 570 tokens, 2.5-s client timeout: the long ones time out
    (given up 2.5 s after their send); the run lasts until the last of those, and the
    throughputs are over that duration."""
    r = run("workload.num_prompts=40", "workload.request_rate=inf", "workload.input_len=512",
            "workload.output_len=300", "workload.range_ratio=0.9",
            "client.request_timeout_s=2.5", "output.save_detailed=true")
    q = r.requests
    reasons = np.asarray(q["finished_reason"]).astype(str)
    ok = reasons == "length"
    late = reasons == "timeout"
    assert ok.any() and late.any()
    end = max(float(np.max(q["finish_s"][ok])), float(np.max(q["send_s"][late] + 2.5)))
    assert end > float(np.max(q["finish_s"][ok]))  # a timeout came after the last completion
    b = compute_bench_result(r, date=DATE)
    assert b["duration"] == pytest.approx(end, rel=1e-12)
    assert b["request_throughput"] == pytest.approx(ok.sum() / end, rel=1e-12)
    # detailed ttfts: a timed-out request that got its first token keeps its TTFT
    first = np.asarray(q["first_token_s"], dtype=float)
    got = late & np.isfinite(first)
    assert got.any()
    want = np.where(np.isfinite(first), first - np.asarray(q["send_s"]), 0.0)
    np.testing.assert_allclose(b["ttfts"], want, rtol=0, atol=1e-12)
    assert all(b["latencies"][i] == 0.0 for i in np.flatnonzero(~ok))
    # with each request's gaps at hand (save_detailed), ITL pools the successful requests'
    # only, as vLLM's calculate_metrics (the timed-out ones' gaps are left out)
    flat = np.concatenate([np.asarray(b["itls"][i]) for i in np.flatnonzero(ok)])
    every = np.concatenate([np.asarray(x) for x in b["itls"]])
    assert len(every) > len(flat)
    assert b["mean_itl_ms"] == pytest.approx(1e3 * flat.mean(), rel=1e-12)
    assert b["p99_itl_ms"] == pytest.approx(1e3 * np.percentile(flat, 99), rel=1e-12)


def test_nothing_completed_is_zero_throughput_over_the_time_spent():
    """Every request times out (0.05 s, before any finishes): vLLM's duration is until the
    last failure, its throughputs and peak output rate 0.0."""
    r = run("workload.num_prompts=10", "workload.request_rate=inf", "workload.input_len=512",
            "workload.output_len=64", "client.request_timeout_s=0.05")
    q = r.requests
    assert (np.asarray(q["finished_reason"]).astype(str) == "timeout").all()
    b = compute_bench_result(r, date=DATE)
    assert b["completed"] == 0
    assert b["duration"] == pytest.approx(float(np.max(q["send_s"])) + 0.05, rel=1e-12)
    for k in ("request_throughput", "output_throughput", "total_token_throughput",
              "max_output_tokens_per_s"):
        assert b[k] == 0.0, k


def test_metadata_keys_follow_num_prompts_as_strings():
    cfg = resolve_config(load_config(None, [
        "workload.num_prompts=5", "output.metadata={tp: 1, note: ' a=b ', eager: true}"]))
    assert cfg.output.metadata == {"tp": "1", "note": "a=b", "eager": "true"}
    b = compute_bench_result(run_experiment(cfg, resolved=True), date=DATE)
    keys = list(b)
    i = keys.index("num_prompts")
    assert keys[i + 1:i + 4] == ["tp", "note", "eager"] and b["note"] == "a=b"
    plain = resolve_config(load_config(None, ["workload.num_prompts=5"]))
    assert "metadata" not in plain.dump_tree()["output"]
    with pytest.raises(Exception, match="output.metadata"):
        load_config(None, ["output.metadata={tp: [1, 2]}"])


@pytest.mark.parametrize("ov", [[], ["frontend.enable=false"], ["scheduler.stream_interval=4"],
                                ["workload.warmup={num_requests: 10}"]])
def test_save_detailed_writes_each_requests_itls(ov):
    """vllm bench --save-detailed ``itls``: each request's client-side gaps (one per chunk
    after the first), in request order; they pool to the run's ITL and each request's sum
    is its E2EL - TTFT (what vLLM's timeline plot assumes). With warm-up, the measured
    requests' only."""
    r = run("workload.num_prompts=40", "workload.request_rate=20", "workload.input_len=256",
            "workload.output_len=24", "workload.range_ratio=0.5", "output.save_detailed=true",
            *ov)
    b = compute_bench_result(r, date=DATE)
    itls = b["itls"]
    n = 30 if ov and "warmup" in ov[0] else 40
    assert len(itls) == n == len(b["ttfts"])
    lens = np.asarray(b["output_lens"])
    want = 1 + np.ceil((lens - 1) / 4) - 1 if ov == ["scheduler.stream_interval=4"] else lens - 1
    np.testing.assert_array_equal([len(x) for x in itls], want)
    np.testing.assert_allclose([sum(x) for x in itls],
                               np.asarray(b["latencies"]) - np.asarray(b["ttfts"]), atol=1e-9)
    if n == 40:  # (with warm-up the pool keeps the warm-up requests' gaps: documented)
        flat = np.concatenate([np.asarray(x) for x in itls])
        assert b["mean_itl_ms"] == pytest.approx(1e3 * flat.mean(), rel=1e-12)
        assert b["p99_itl_ms"] == pytest.approx(1e3 * np.percentile(flat, 99), rel=1e-12)


def test_a_staged_run_lasts_until_its_cancelled_requests_ended():
    """One 10-s stage at concurrency 4, grace 0, 500-token outputs: 4 requests complete, the
    4 in flight at 10 s are cancelled then; the stage (and the run) lasts until 10 s, as
    vLLM's duration runs until every request ended, and requests.csv says when they did."""
    r = run("workload.num_prompts=50", "workload.range_ratio=0", "workload.output_len=500",
            "workload.stages=[{concurrency: 4, duration_s: 10, grace_s: 0}]")
    q = r.requests
    reasons = np.asarray(q["finished_reason"]).astype(str)
    cancelled = reasons == "cancelled"
    assert cancelled.sum() == 4 and (reasons == "length").sum() == 4
    np.testing.assert_array_equal(np.asarray(q["finish_s"])[cancelled], 10.0)
    b = compute_bench_result(r, date=DATE)
    assert b["duration"] == 10.0
    assert b["request_throughput"] == pytest.approx(4 / 10.0, rel=1e-12)
