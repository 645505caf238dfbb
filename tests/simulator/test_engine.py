"""Engine-level behaviour through run_experiment: client concurrency, sessions, DP, and the
fast path against the exact loop on a full run."""

import numpy as np
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.runner import run_experiment


def run(*overrides, fast_path=True):
    cfg = resolve_config(load_config(None, ["workload.num_prompts=120", "workload.input_len=300",
                                            "workload.output_len=40", *overrides]))
    return run_experiment(cfg, resolved=True, fast_path=fast_path)


def test_fast_path_matches_exact_loop_end_to_end():
    for ov in ([], ["cache.num_gpu_blocks_override=120", "model.max_model_len=1920", "workload.request_rate=inf"],
               ["scheduler.long_prefill_token_threshold=64", "workload.prefix_len=200"]):
        a, b = run(*ov), run(*ov, fast_path=False)
        for col in ("first_token_s", "finish_s", "num_preemptions", "num_cached_tokens"):
            np.testing.assert_array_equal(a.requests[col], b.requests[col])
        assert a.counters["num_steps"] == b.counters["num_steps"]
        np.testing.assert_allclose(np.repeat(a.itl_values, a.itl_counts).sum(),
                                   np.repeat(b.itl_values, b.itl_counts).sum())


def test_max_concurrency_is_a_closed_loop():
    r = run("workload.max_concurrency=4", "workload.request_rate=inf")
    send, fin = r.requests["send_s"], r.requests["finish_s"]
    events = sorted([(t, 1) for t in send] + [(t, -1) for t in fin], key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak <= 4
    # Requests wait client-side: sends are spread out although all arrive at t=0.
    assert np.count_nonzero(send > 0) >= 100
    assert (r.steps["vllm:num_requests_running"] <= 4).all()


def test_sessions_hit_previous_turn_prompt_and_output():
    cfg = resolve_config(load_config(None, [
        "workload.kind=sessions", "workload.num_sessions=4", "workload.turns=3",
        "workload.session_rate=0.5", "workload.think_time_s=1", "workload.system_prompt_len=0",
    ]))
    r = run_experiment(cfg, resolved=True)
    q = r.requests
    row = {rid: i for i, rid in enumerate(q["request_id"])}
    checked = 0
    for rid, i in row.items():
        sess, turn = rid.rsplit("-t", 1)
        if turn == "0":
            continue
        p = row[f"{sess}-t{int(turn) - 1}"]
        # Sent think_time after the parent finished ...
        assert abs(q["send_s"][i] - (q["finish_s"][p] + 1.0)) < 1e-9
        # ... and hits every full block of the parent's prompt + output whose KV exists (the
        # parent's last sampled token never had its KV computed): output blocks included.
        assert q["num_cached_tokens"][i] == (q["prompt_len"][p] + q["output_len"][p] - 1) // 16 * 16
        assert q["num_cached_tokens"][i] > q["prompt_len"][p]
        checked += 1
    assert checked == 8


def test_data_parallel_replicas_share_the_load():
    one = run("workload.request_rate=inf")
    two = run("workload.request_rate=inf", "parallel.data_parallel_size=2")
    assert two.counters["num_replicas"] == 2
    assert two.duration_s < 0.75 * one.duration_s


def test_data_parallel_timeseries_sums_the_engines():
    """With DP > 1 each step row holds the engines' latest gauges and counters summed (KV usage:
    their mean), vLLM's per-engine series summed: the counters never go back and end at the
    run's totals; at rate inf each engine runs its full 256 seats at first, so the running
    gauge reaches 2 × 256 (one engine's count alone never exceeds 256)."""
    two = run("workload.request_rate=inf", "workload.num_prompts=1200",
              "parallel.data_parallel_size=2")
    s = {k: np.asarray(v) for k, v in two.steps.items()}
    for col, total in (("vllm:prefix_cache_queries_total", "prefix_cache_queries"),
                       ("vllm:prefix_cache_hits_total", "prefix_cache_hits"),
                       ("vllm:num_preemptions_total", "num_preemptions")):
        assert (np.diff(s[col]) >= 0).all(), col
        assert s[col][-1] == two.counters[total], col
    assert s["vllm:num_requests_running"].max() == 512
    assert (s["vllm:kv_cache_usage_perc"] <= 1).all()


def _run70(*ov):
    cfg = resolve_config(load_config(None, [
        "model.name=llama-3.1-70b", "model.max_model_len=8192", "hardware.name=h100-sxm",
        "workload.request_rate=inf", "workload.num_prompts=200", "workload.input_len=512",
        "workload.output_len=64", *ov]))
    return run_experiment(cfg, resolved=True)


def test_pipeline_parallel_keeps_pp_batches_in_flight():
    tp4 = _run70("parallel.tensor_parallel_size=4")
    pp = _run70("parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2")
    q = pp.requests
    assert (q["finished_reason"] == "length").all()
    assert (q["output_len"] == tp4.requests["output_len"]).all()
    # Batches overlap: the next one enters the pipeline before the previous one is out.
    end = pp.steps["time_s"]
    start = end - pp.steps["step_seconds"]
    assert (start[1:] < end[:-1]).mean() > 0.5
    # Token conservation still holds (no preemptions here): every scheduled token counted once.
    assert pp.counters["num_preemptions"] == 0
    expected = (q["prompt_len"] + q["output_len"] - 1 - q["num_cached_tokens"]).sum()
    assert pp.steps["step_tokens"].sum() == expected
    # With pp batches in flight, PP2 x TP2 is in the same throughput class as TP4 on 4 GPUs.
    assert pp.duration_s < 1.5 * tp4.duration_s


def test_batch_shape_of_each_step_by_hand():
    """The ``BatchShape`` the cost model prices, step by step (budget 64 tokens, vLLM's running
    rows first): decode rows count in ``num_decode`` with context = computed + 1, prefill
    chunks as (new tokens, context) pairs, every row gets logits (``num_sampled``); the decode
    group (fast path) gives the same shapes as the per-request loop."""
    from harness import Harness

    for fast_path in (False, True):
        h = Harness(fast_path=fast_path, max_num_batched_tokens=64, block_size=16)
        h.add("a", 30, 10)
        h.add("b", 20, 10)
        s = h.step().shape
        assert (s.num_decode, s.decode_context_sum, s.decode_context_max,
                s.prefill_new_tokens, s.prefill_context, s.num_sampled) == (
            0, 0, 0, (30, 20), (0, 0), 2)
        h.add("c", 100, 5)
        shapes = [h.step().shape for _ in range(3)]
        got = [(s.num_decode, s.decode_context_sum, s.decode_context_max,
                s.prefill_new_tokens, s.prefill_context, s.num_sampled, s.num_spec_tokens)
               for s in shapes]
        assert got == [
            (2, 31 + 21, 31, (62,), (0,), 3, 0),    # a, b decode; c's first chunk 64 − 2
            (2, 32 + 22, 32, (38,), (62,), 3, 0),   # c's last chunk: its first token
            (3, 33 + 23 + 101, 101, (), (), 3, 0),  # three decodes
        ], fast_path
        assert h.step().shape.decode_context_sum == 34 + 24 + 102
