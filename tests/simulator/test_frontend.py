"""The API-server frontend (simulator/frontend.py): client-visible TTFT above the engine's by
the named terms, queueing when the API server is busy, the tokenizer's micro-batches, the
calibration file's ``frontend:`` section and config overrides."""

import math

import numpy as np
import pytest
from servesim.reports.bench_result import TTFT_TERMS, compute_bench_result
from servesim.reports.console import summary_lines
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.frontend import FrontendParams
from servesim.simulator.runner import run_experiment


def run(*overrides):
    cfg = resolve_config(load_config(None, list(overrides)))
    return run_experiment(cfg, resolved=True)


def test_default_priors_add_the_named_terms_at_concurrency_one():
    """Llama-3.1-8B on an H100, one request at a time, 1,024-token prompts: the client's TTFT
    is the engine's (queue + prefill) plus exactly the frontend's terms at their priors."""
    r = run("model.name=llama-3.1-8b", "hardware.name=h100-sxm", "workload.num_prompts=6",
            "workload.request_rate=inf", "workload.max_concurrency=1", "workload.input_len=1024",
            "workload.range_ratio=0", "workload.output_len=16")
    q = r.requests
    p = FrontendParams()
    engine_only = q["queue_s"] + q["prefill_s"]
    terms = (p.request_s + p.tokenizer_batch_wait_s + 1024 * p.tokenize_per_token_s
             + 2 * p.ipc_s + p.detokenize_per_token_s)
    np.testing.assert_allclose(q["ttft_s"] - engine_only, terms, rtol=0, atol=1e-9)
    assert terms > 3e-3  # the 2 ms tokenizer window + 1 ms of tokenization + the rest
    # vLLM's Prometheus TTFT starts at the API server's arrival_time and ends when the output
    # handler starts on the token: the request work and the final output work are outside
    np.testing.assert_allclose(q["ttft_s"] - q["engine_ttft_s"],
                               p.request_s + p.detokenize_per_token_s, atol=1e-9)
    # TPOT: every token pays the same delivery delay, so client and engine agree
    np.testing.assert_allclose(q["tpot_s"], q["engine_tpot_s"], rtol=1e-9)
    bench = compute_bench_result(r)
    bd = bench["ttft_breakdown_ms"]
    assert list(bd) == [t[0] for t in TTFT_TERMS]
    assert math.isclose(sum(bd.values()), bench["mean_ttft_ms"], abs_tol=1e-5)  # ns terms
    assert math.isclose(bd["tokenizer"], 1e3 * (p.tokenizer_batch_wait_s
                                                 + 1024 * p.tokenize_per_token_s), rel_tol=1e-6)
    assert math.isclose(bd["ipc_in"], 1e3 * p.ipc_s, rel_tol=1e-6)
    assert bench["engine_metrics"]["ttft"] == "vllm:time_to_first_token_seconds"
    assert math.isclose(bench["mean_engine_ttft_ms"], 1e3 * float(np.mean(q["engine_ttft_s"])))
    assert bench["frontend"]["api_server_count"] == 1
    text = "\n".join(summary_lines(bench))
    for name in ("Mean TTFT breakdown", "api server", "tokenizer", "ipc in + input queue (ms)",
                 "engine queue",
                 "engine prefill", "output", "tokenize per token", "tokenizer batch window",
                 "IPC hop, each way", "detokenize+SSE per token", "Mean engine TTFT"):
        assert name in text, name


def test_disabled_frontend_is_the_engine_alone():
    r = run("frontend.enable=false", "workload.num_prompts=20", "workload.request_rate=4")
    q = r.requests
    # the engine core's input queue (until the step running at the send ends) + the waiting
    # queue + prefill
    wait_in = q["queued_s"] - q["send_s"]
    assert (wait_in >= 0).all() and (wait_in > 0).sum() >= 10  # most come mid-step
    np.testing.assert_allclose(q["ttft_s"], wait_in + q["queue_s"] + q["prefill_s"],
                               atol=1e-12)
    np.testing.assert_allclose(q["engine_ttft_s"], q["ttft_s"])
    assert r.frontend == {"enable": False}


def test_busy_api_server_queues_requests_and_more_servers_help():
    base = ["workload.num_prompts=400", "workload.request_rate=800", "workload.input_len=16",
            "workload.output_len=2", "workload.range_ratio=0"]
    light = run(*base, "frontend.request_s=2e-4")
    heavy = run(*base, "frontend.request_s=1.5e-3")  # 800/s x 1.5 ms: over one process
    two = run(*base, "frontend.request_s=1.5e-3", "frontend.api_server_count=2")
    t = {k: float(np.nanmean(v.requests["ttft_s"])) for k, v in
         (("light", light), ("heavy", heavy), ("two", two))}
    assert t["heavy"] > t["light"] + 0.05  # a backlog: far more than the 1.3 ms difference
    assert t["two"] < 0.5 * t["heavy"]
    assert two.frontend["api_server_count"] == 2
    # the engine sees the requests later, not slower
    np.testing.assert_allclose(np.nanmean(heavy.requests["prefill_s"]),
                               np.nanmean(light.requests["prefill_s"]), rtol=0.5)


def test_tokenizer_takes_at_most_32_prompts_per_batch():
    r = run("workload.num_prompts=100", "workload.request_rate=inf", "workload.input_len=64",
            "workload.output_len=2", "frontend.request_s=1e-6")
    q = r.requests
    tok = q["tokenized_s"]
    _, counts = np.unique(tok, return_counts=True)
    assert counts.max() == 32 and r.counters["tokenizer_batches"] == len(counts) >= 4
    # the engine gets each batch one IPC hop after it is tokenized, and takes it in then or,
    # mid-step, when the step ends
    assert (q["queued_s"] - tok >= FrontendParams().ipc_s - 1e-12).all()


def test_calibration_frontend_section_and_config_override(tmp_path):
    cal = tmp_path / "fit.yaml"
    cal.write_text("version: 2\ngpu: a100-sxm4-80gb\nlayer_over: auto\n"
                   "frontend: {request_s: 0.002, ipc_s: 0.0004}\n")
    r = run(f"hardware.calibration={cal}", "workload.num_prompts=5", "workload.request_rate=1",
            "frontend.ipc_s=0.0001")
    fe = r.frontend
    assert fe["params"]["request_s"] == 0.002 and fe["params"]["ipc_s"] == 0.0001
    assert fe["provenance"]["request_s"] == "calibration:fit.yaml"
    assert fe["provenance"]["ipc_s"] == "config"
    assert fe["provenance"]["tokenize_per_token_s"].startswith("prior")


@pytest.mark.parametrize("ov", [[], ["workload.max_concurrency=8"],
                                ["parallel.data_parallel_size=2"]])
def test_client_times_follow_the_engine(ov):
    r = run("workload.num_prompts=60", "workload.request_rate=20", "workload.output_len=24",
            *ov)
    q = r.requests
    ok = q["finished_reason"] == "length"
    assert ok.all()
    # each stage after the previous
    for a, b in (("send_s", "frontend_arrival_s"), ("frontend_arrival_s", "tokenized_s"),
                 ("tokenized_s", "queued_s"), ("queued_s", "first_scheduled_s"),
                 ("engine_first_token_s", "first_token_iter_s"),
                 ("first_token_iter_s", "first_token_s")):
        assert (q[b] >= q[a] - 1e-12).all(), (a, b)
    assert (q["e2el_s"] > q["engine_e2el_s"]).all()
    # client ITLs: the same total as the engine's, tokens delayed alike
    v, c = r.itl_values, r.itl_counts
    ev, ec = r.engine_itl.exact_sample()
    assert math.isclose((v * c).sum(), (ev * ec).sum(), rel_tol=1e-3)


def test_tokenizer_windows_by_hand():
    """vLLM's micro-batching tokenizer, event by event (unit u = 2^-10 s, so every time is
    exact): request work u, 16-token prompts tokenized in u, a window of 3u, 3 prompts per
    batch, IPC u/2. Worked by hand:

    - 4 prompts sent at 0 reach the tokenizer at 1, 2, 3, 4. The window opens at 1 with all
      4 queued and the 3rd arrived by the deadline 4: a full batch (0, 1, 2) closes at the
      3rd's arrival, 3, tokenized at 3 + 3 = 6. Prompt 3 opens the next window when the
      tokenizer is free (6); prompt 4 (sent at 7, queued at 8) arrives by its deadline 9:
      batch (3, 4), tokenized at 9 + 2 = 11.
    - Prompts 5-8 sent at 11, 11.25, 11.5, 11.75 queue at 12, 13, 14, 15; the window opens at
      12 (the tokenizer idle since 11), full by then with the 3rd at 14, before the deadline
      15: batch (5, 6, 7) closes at 14, tokenized at 17; prompt 8 waits for the tokenizer:
      window 17-20, tokenized at 21. Each batch reaches the engine u/2 later."""
    import simpy
    from servesim.simulator.frontend import Frontend
    from servesim.workloads.schema import RequestSpec

    u = 2.0 ** -10
    p = FrontendParams(request_s=u, tokenize_per_token_s=u / 16, ipc_s=u / 2,
                       detokenize_per_token_s=0.0, tokenizer_batch_wait_s=3 * u,
                       tokenizer_max_batch=3)
    env = simpy.Environment()
    got = {}
    fe = Frontend(env, p, 1, lambda spec, send, t, server, tok, queued: got.__setitem__(
        spec.extra["_index"], (tok / u, queued / u)), lambda r: None)
    sends = [0, 0, 0, 0, 7, 11, 11.25, 11.5, 11.75]

    def client():
        for i, t in enumerate(sends):
            if t * u > env.now:
                yield env.timeout(t * u - env.now)
            fe.submit(RequestSpec(t * u, 16, 1, extra={"_index": i}), env.now)

    env.process(client())
    env.run()
    tokenized = [6, 6, 6, 11, 11, 17, 17, 17, 21]
    assert got == {i: (t, t + 0.5) for i, t in enumerate(tokenized)}
    assert fe.num_batches == 4


class _Probe:
    """A frontend that only notes, at each send, the client's ``next_send``."""

    n = 1  # API servers

    def __init__(self, env, client_box):
        self.env, self.box, self.seen = env, client_box, []

    def submit(self, spec, send):
        self.seen.append((spec.request_id, send, self.box[0].next_send))


@pytest.mark.parametrize("mode", ["open", "max_concurrency", "sessions"])
def test_client_tells_the_frontend_its_next_send(mode):
    """``Client.next_send`` (the frontend closes a tokenizer window early when no prompt can
    join it): the next request's send time in an open loop, the end (inf) after the last;
    unknown (-inf) where sends follow finishes (max_concurrency) or session follow-ups, which
    are sent when their parent ends, from the first follow-up on."""
    import simpy
    from servesim.simulator.client import Client
    from servesim.simulator.recorder import Recorder
    from servesim.workloads.schema import RequestSpec

    env = simpy.Environment()
    specs = [RequestSpec(0.0, 8, 1, request_id="a", session_id="s" if mode == "sessions"
                         else None),
             RequestSpec(0.5, 8, 1, request_id="b"), RequestSpec(0.5, 8, 1, request_id="c"),
             RequestSpec(2.0, 8, 1, request_id="d")]
    if mode == "sessions":
        specs[2] = RequestSpec(0.5, 8, 1, request_id="c", session_id="s", parent_id="a")
    box: list = []
    probe = _Probe(env, box)
    box.append(Client(env, specs, [None], Recorder(), max_model_len=4096, num_gpu_blocks=100,
                      block_size=16, frontend=probe,
                      max_concurrency=9 if mode == "max_concurrency" else None))
    env.run()
    inf = math.inf
    want = {"open": [("a", 0.0, 0.5), ("b", 0.5, 0.5), ("c", 0.5, 2.0), ("d", 2.0, inf)],
            "max_concurrency": [("a", 0.0, -inf), ("b", 0.5, -inf), ("c", 0.5, -inf),
                                ("d", 2.0, -inf)],
            # c waits for a's end (never here); from b's send on, nothing is known
            "sessions": [("a", 0.0, 0.5), ("b", 0.5, -inf), ("d", 2.0, -inf)]}[mode]
    assert probe.seen == want
