"""``scheduler.stream_interval`` (vLLM ``--stream-interval``): the API server sends a request's
tokens with its first token, when N are unsent, and when it finishes
(``RequestState.make_request_output``); the client's inter-token gaps are per chunk, the
output work is per token plus per chunk (simulator/frontend.py)."""

import math
from itertools import pairwise

import numpy as np
import pytest
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.errors import ConfigError
from servesim.simulator.runner import run_experiment

DETOK, CHUNK = 0.002, 0.0015  # large enough to see: per token 0.5 ms, per chunk 1.5 ms


def run(*overrides):
    cfg = resolve_config(load_config(None, list(overrides)))
    return run_experiment(cfg, resolved=True)


def one_request(n: int, out: int, *extra):
    return run("workload.num_prompts=1", "workload.input_len=64", f"workload.output_len={out}",
               "workload.range_ratio=0", f"scheduler.stream_interval={n}",
               f"frontend.detokenize_per_token_s={DETOK}", f"frontend.stream_chunk_s={CHUNK}",
               *extra)


def token_step_ends(r) -> list[float]:
    """End times of the steps that produced a token (one request: one token each)."""
    st = r.steps
    return [t for t, g in zip(st["time_s"], st["num_generated_tokens"]) if g]


@pytest.mark.parametrize("out, chunks", [(9, [0, 3, 6, 8]), (7, [0, 3, 6]), (1, [0])])
def test_one_request_gets_its_tokens_in_chunks_of_three(out, chunks):
    """Nine tokens at N = 3: chunks with tokens 1, 4, 7 and 9 (the last: it finished with two
    unsent). Each chunk's output work is the same (one token, one chunk) and the API server is
    idle when a step ends, so a client gap is the gap between the engine steps that sent."""
    r = one_request(3, out)
    t = token_step_ends(r)
    assert len(t) == out
    want = [t[b] - t[a] for a, b in pairwise(chunks)]
    vals = np.repeat(r.itl_values, r.itl_counts.astype(int))
    np.testing.assert_allclose(np.sort(vals), np.sort(want), rtol=0, atol=1e-12)
    # vLLM's engine-side gaps (vllm:inter_token_latency_seconds): every token, as at N = 1
    ev, ec = r.engine_itl.exact_sample() if out > 1 else (np.zeros(0), np.zeros(0))
    np.testing.assert_allclose(np.repeat(ev, ec.astype(int)), np.diff(t), atol=1e-12)
    # client times: the first and the last chunk, ipc + one token + one chunk after the step
    q = r.requests
    delay = r.frontend["params"]["ipc_s"] + (DETOK - CHUNK) + CHUNK
    assert math.isclose(q["first_token_s"][0], t[0] + delay, abs_tol=1e-12)
    assert math.isclose(q["finish_s"][0], t[-1] + delay, abs_tol=1e-12)
    # the API server's work: the request, 0.5 ms per token, 1.5 ms per chunk
    busy = r.frontend["params"]["request_s"] + out * (DETOK - CHUNK) + len(chunks) * CHUNK
    assert math.isclose(r.counters["api_server_busy_seconds"], busy, rel_tol=1e-12)


def test_interval_one_is_one_chunk_per_token():
    """N = 1 (vLLM's default): every token its own chunk and gap, the whole
    ``detokenize_per_token_s`` per token."""
    r = one_request(1, 9)
    t = token_step_ends(r)
    vals = np.repeat(r.itl_values, r.itl_counts.astype(int))
    np.testing.assert_allclose(np.sort(vals), np.sort(np.diff(t)), atol=1e-12)
    busy = r.frontend["params"]["request_s"] + 9 * DETOK
    assert math.isclose(r.counters["api_server_busy_seconds"], busy, rel_tol=1e-12)


def test_many_requests_chunk_counts_and_output_work():
    """100 requests of 5..12 tokens at N = 4: 1 + ceil((out - 1) / 4) chunks each (the
    output work counts them) and one client gap per chunk after the first, where N = 1 has
    one per token."""
    base = ["workload.num_prompts=100", "workload.request_rate=50", "workload.input_len=128",
            "workload.output_len=8", "workload.range_ratio=0.5",
            f"frontend.detokenize_per_token_s={DETOK}", f"frontend.stream_chunk_s={CHUNK}"]
    a = run(*base, "scheduler.stream_interval=1")
    b = run(*base, "scheduler.stream_interval=4")
    outs = np.asarray(b.requests["output_len"], dtype=int)
    np.testing.assert_array_equal(outs, np.asarray(a.requests["output_len"], dtype=int))
    assert (outs > 1).all()
    chunks = 1 + np.ceil((outs - 1) / 4).astype(int)
    assert int(b.itl_counts.sum()) == int((chunks - 1).sum())
    assert int(a.itl_counts.sum()) == int((outs - 1).sum())
    p = b.frontend["params"]
    busy = 100 * p["request_s"] + outs.sum() * (DETOK - CHUNK) + chunks.sum() * CHUNK
    assert math.isclose(b.counters["api_server_busy_seconds"], busy, rel_tol=1e-9)
    # timeseries: the chunks of each step (vllm bench's peak output rate counts chunks)
    assert int(b.steps["num_output_chunks"].sum()) == int(chunks.sum())
    assert "num_output_chunks" not in a.steps  # one token a chunk: the tokens column says it


def test_timed_out_request_keeps_only_the_tokens_sent():
    """A client that gives up mid-stream holds what the last chunk brought: at N = 8, of the
    k tokens the engine has returned, 1 + 8 * floor((k - 1) / 8)."""
    base = ["workload.num_prompts=1", "workload.input_len=64", "workload.output_len=200",
            "workload.range_ratio=0", "client.request_timeout_s=0.5"]
    a = run(*base, "scheduler.stream_interval=1")
    b = run(*base, "scheduler.stream_interval=8")
    k = int(a.requests["output_len"][0])
    assert 9 < k < 200 and a.requests["finished_reason"][0] == "timeout"
    assert int(b.requests["output_len"][0]) == 1 + 8 * ((k - 1) // 8)


@pytest.mark.parametrize("ov, msg", [
    (["frontend.enable=false"], "scheduler.stream_interval: 4 needs the API-server model"),
    (["cluster.instances=[{name: a}]"], "scheduler.stream_interval: 4: cluster runs leave"),
    (["cache.kv_offload={cpu_bytes: 4G}"],
     "scheduler.stream_interval: 4: runs with cache.kv_offload"),
])
def test_refused_without_the_api_server(ov, msg):
    with pytest.raises(ConfigError, match=msg):
        resolve_config(load_config(None, ["scheduler.stream_interval=4", *ov]))


def test_zero_is_refused_and_default_leaves_the_hash():
    with pytest.raises(Exception, match="stream_interval"):
        load_config(None, ["scheduler.stream_interval=0"])
    a = resolve_config(load_config(None, []))
    b = resolve_config(load_config(None, ["scheduler.stream_interval=1"]))
    assert "stream_interval" not in a.dump_tree()["scheduler"]
    assert a.config_hash() == b.config_hash()
    c = resolve_config(load_config(None, ["scheduler.stream_interval=2"]))
    assert c.dump_tree()["scheduler"]["stream_interval"] == 2


def test_speculative_decoding_counts_each_rows_tokens():
    """EAGLE-3, several tokens a step: a chunk goes when 4 or more tokens are unsent (or at
    the finish), so chunk boundaries follow the accepted counts. Client time of a sending step
    = its end + ipc + 0.5 ms per token of the step + one 1.5 ms chunk."""
    r = run("model.name=llama-3.1-8b", "hardware.name=h100-sxm",
            "speculative_config={method: eagle3, num_speculative_tokens: 3, "
            "acceptance: {rate: 0.6}}",
            "workload.num_prompts=1", "workload.input_len=64", "workload.output_len=40",
            "workload.range_ratio=0", "scheduler.stream_interval=4",
            f"frontend.detokenize_per_token_s={DETOK}", f"frontend.stream_chunk_s={CHUNK}")
    st = r.steps
    steps = [(t, g) for t, g in zip(st["time_s"], st["num_generated_tokens"]) if g]
    assert max(g for _, g in steps) > 1  # drafts were accepted
    total, sent, client = 0, 0, []
    for i, (t, g) in enumerate(steps):
        total += g
        if i == 0 or total - sent >= 4 or total == 40:
            sent = total
            client.append(t + (DETOK - CHUNK) * g + CHUNK)
    vals = np.repeat(r.itl_values, r.itl_counts.astype(int))
    np.testing.assert_allclose(np.sort(vals), np.sort(np.diff(client)), atol=1e-12)
    assert len(vals) < len(steps) - 1  # fewer chunks than steps


def test_peak_output_rate_counts_chunks_as_vllm_bench():
    """vllm bench serve's ``max_output_tokens_per_s`` buckets each successful request's chunk
    times (start + ttft, then one per ITL, ``calculate_metrics``): with EAGLE-3 a step's row
    is one chunk of 1 to 4 tokens. Without a frontend the client's times are the engine's,
    so the step-based peak (chunk column) must equal vLLM's formula applied to the same
    run's per-request lists (``save_detailed``: ttfts, itls, start_times)."""
    from servesim.reports.bench_result import compute_bench_result

    base = ["model.name=llama-3.1-8b", "hardware.name=h100-sxm", "frontend.enable=false",
            ("speculative_config={method: eagle3, num_speculative_tokens: 3, "
             "acceptance: {rate: 0.6}}"), "workload.num_prompts=200", "workload.request_rate=20",
            "workload.input_len=256", "workload.output_len=128"]
    r = run(*base)
    st = r.steps
    chunks = np.asarray(st["num_output_chunks"])
    assert chunks.sum() == r.itl_counts.sum() + 200  # one gap per chunk after the first
    assert st["num_generated_tokens"].sum() > 1.5 * chunks.sum()
    d = compute_bench_result(run(*base, "output.save_detailed=true"))
    times = [s + t + np.concatenate(([0.0], np.cumsum(g)))
             for s, t, g in zip(d["start_times"], d["ttfts"], d["itls"])]
    t0 = min(d["start_times"])
    want = np.bincount(np.floor(np.concatenate(times) - t0).astype(int)).max()
    assert compute_bench_result(r)["max_output_tokens_per_s"] == want
    assert d["max_output_tokens_per_s"] == want


def test_a_client_that_gives_up_gets_no_more_chunks():
    """Client timeouts at N = 4: a request given up holds the tokens of the chunks it got
    (1, 5, 9, ...: 1 + 4m tokens), its detailed ITL list one gap per chunk after the first,
    and no chunk is sent for it afterwards (vLLM's output processor drops an aborted
    request's outputs): the steps' chunk column adds up to the chunks the requests got."""
    from servesim.reports.bench_result import compute_bench_result

    r = run("workload.num_prompts=40", "workload.request_rate=inf", "workload.input_len=512",
            "workload.output_len=300", "workload.range_ratio=0.9",
            "client.request_timeout_s=2.5", "scheduler.stream_interval=4",
            "output.save_detailed=true")
    q = r.requests
    reasons = np.asarray(q["finished_reason"]).astype(str)
    outs = np.asarray(q["output_len"], dtype=int)
    late = (reasons == "timeout") & (outs > 0)
    done = reasons == "length"
    assert late.any() and done.any()
    assert ((outs[late] - 1) % 4 == 0).all()
    itls = compute_bench_result(r)["itls"]
    np.testing.assert_array_equal([len(itls[i]) for i in np.flatnonzero(late)],
                                  (outs[late] - 1) // 4)
    chunks = (1 + np.ceil((outs[done] - 1) / 4)).sum() + (1 + (outs[late] - 1) // 4).sum()
    assert int(r.steps["num_output_chunks"].sum()) == int(chunks)
