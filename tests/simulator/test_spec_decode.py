"""Speculative decoding as vLLM 0.22.1 schedules it (``Scheduler.schedule`` running loop with
``num_tokens_with_spec`` and ``num_lookahead_tokens``, ``update_from_output``'s rejection
rollback, ``AsyncScheduler`` placeholders, ``make_spec_decoding_stats``), its acceptance
models, and its price (``costmodels/spec_decode.py``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servesim.costmodels import BatchShape, build_cost_model
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.errors import ConfigError
from servesim.simulator.runner import run_experiment
from servesim.simulator.spec_decode import (
    SpecDecoding,
    SpeculativeConfig,
    expected_acceptance_length,
)

from tests.simulator.harness import Harness


def spec(method="eagle", k=3, **acceptance):
    return SpeculativeConfig(method=method, num_speculative_tokens=k,
                             acceptance=acceptance or {"rate": 0.6})


def spec_harness(k=3, method="eagle", seed=0, **kw):
    acc = {key: kw.pop(key) for key in ("rate", "per_position", "column") if key in kw}
    h = Harness(**kw)
    h.sched.enable_spec_decode(SpecDecoding(spec(method, k, **acc), np.random.default_rng(seed)))
    return h


def engine_with_spec(arrivals, *, k=3, method="eagle", rate=1.0, seed=0, **kw):
    """run_engine with speculative decoding enabled on the harness scheduler."""
    import simpy
    from servesim.simulator.engine import Replica
    from servesim.simulator.recorder import Recorder

    h = spec_harness(k=k, method=method, rate=rate, seed=seed,
                     async_scheduling=kw.pop("async_scheduling", False), **kw)
    env = simpy.Environment()
    rep = Replica(env, h.sched, lambda shape: 1.0, Recorder(), h.finished.append,
                  async_scheduling=h.sched.params.async_scheduling)
    rep.trace = []

    def arrive():
        for t, rid, p, m in sorted(arrivals):
            if t > env.now:
                yield env.timeout(t - env.now)
            rep.add_request(h.make(rid, p, m))

    env.process(arrive())
    env.run()
    return h, rep.trace


# ---------------------------------------------------------------------------------------------
# Acceptance (issue 20)


def test_alpha_one_emits_k_plus_one_tokens_per_step_and_finishes_in_25_decode_steps():
    """vLLM Scheduler.schedule: a decoding request is scheduled num_tokens_with_spec −
    num_computed_tokens = 1 + k tokens; update_from_output keeps accepted + 1. α = 1, k = 3:
    4 tokens per decode step; 100 outputs = 1 (prefill) + 24·4 + 3 (trimmed at max_tokens)."""
    h = spec_harness(k=3, rate=1.0)
    r = h.add("r", 64, 100)
    outs = []
    steps = []
    while h.sched.has_unfinished_requests():
        steps.append(h.step().as_dict())
        outs.append(r.num_output_tokens)
    assert steps[0] == {"r": 64}
    assert all(s == {"r": 4} for s in steps[1:])
    assert len(steps) == 1 + 25
    assert outs[:4] == [1, 5, 9, 13]
    assert np.diff(outs)[:-1].tolist() == [4] * 24
    assert outs[-1] == 100 and r.num_tokens == 164
    assert r.status.name == "FINISHED_LENGTH_CAPPED"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_alpha_one_finish_time_sync_and_async(async_scheduling):
    """Same request through the engine loop (one-second steps): it finishes when its 25th
    decode step ends, with async scheduling too (vLLM's AsyncScheduler counts the drafts as
    output placeholders, so each batch in flight is followed by a 4-token batch)."""
    h, trace = engine_with_spec([(0.0, "r", 64, 100)], k=3, rate=1.0,
                                async_scheduling=async_scheduling)
    r = h.reqs["r"]
    assert r.num_output_tokens == 100
    assert r.finish_time == pytest.approx(26.0)
    assert trace[0][1] == {"r": 64}
    assert all(t[1] == {"r": 4} for t in trace[1:26])


def test_async_skips_the_request_whose_batch_in_flight_surely_reaches_max_tokens():
    """vLLM: a request is skipped while ``num_computed_tokens + 2 − num_output_placeholders
    ≥ prompt + max_tokens``, i.e. when the one token its batch in flight surely returns
    reaches max_tokens; it is scheduled (1 + k tokens, wasted) when only accepted drafts
    would. max_tokens 6, k 3, α 1: prefill → 1, decode → 5, decode → 6 (trimmed); the next
    schedule sees 5 known + 1 ≥ 6 and skips: no extra batch."""
    h, trace = engine_with_spec([(0.0, "r", 16, 6)], k=3, rate=1.0, async_scheduling=True)
    assert [t[1] for t in trace] == [{"r": 16}, {"r": 4}, {"r": 4}]
    # max_tokens 7: the last batch returns 2 (1 + 1 accepted, trimmed); vLLM knows only
    # 5 + 1 < 7 when scheduling the next one, so it schedules an extra 4-token row
    h, trace = engine_with_spec([(0.0, "r", 16, 7)], k=3, rate=1.0, async_scheduling=True)
    assert [t[1] for t in trace] == [{"r": 16}, {"r": 4}, {"r": 4}, {"r": 4}]
    assert h.reqs["r"].num_output_tokens == 7
    assert h.reqs["r"].finish_time == pytest.approx(3.0)


def test_alpha_zero_one_token_per_step_and_rejected_slots_rolled_back():
    """α = 0: every draft is rejected — one token per step, num_computed_tokens rolled back
    by k after each step (vLLM update_from_output), the blocks kept (no free, no leak)."""
    h = spec_harness(k=3, rate=0.0, block_size=16)
    r = h.add("r", 30, 40)
    h.step()
    assert r.num_output_tokens == 1 and r.num_computed_tokens == 30
    for i in range(24):  # (contexts 30..53: the lookahead crosses block boundaries)
        out = h.step()
        assert out.as_dict() == {"r": 4}
        assert out.shape.num_decode == 1 and out.shape.num_spec_tokens == 3
        assert out.shape.num_sampled == 4  # logits for every draft position
        assert r.num_output_tokens == 2 + i
        assert r.num_computed_tokens == r.num_tokens - 1
        # blocks for computed + 4 scheduled + 3 lookahead (EAGLE), nothing more
        need = r.num_computed_tokens - 1 + 4 + 3
        assert len(r.blocks) == -(-need // 16)
    stats = out.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 0)


def test_alpha_zero_step_costs_more_than_without_spec_decode():
    """The verification forward (4 query tokens per row, logits at each) plus the EAGLE
    head's passes make a step dearer than a plain decode step of the same batch."""
    base = load_config(None, ["hardware.name=h100-sxm"])
    on = load_config(None, ["hardware.name=h100-sxm", "speculative_config.method=eagle",
                            "speculative_config.num_speculative_tokens=3",
                            "speculative_config.acceptance={rate: 0.0}"])
    plain = build_cost_model(resolve_config(base))
    sd = build_cost_model(resolve_config(on))
    for nd, ctx in ((1, 1000), (32, 32 * 1500), (256, 256 * 2000)):
        t0 = plain.step_seconds(BatchShape(nd, ctx, ctx // nd, num_sampled=nd))
        t1 = sd.step_seconds(BatchShape(nd, ctx, ctx // nd, num_sampled=4 * nd,
                                        num_spec_tokens=3 * nd))
        assert t1 > t0
        names = [op.name for op in sd.step_time(BatchShape(
            nd, ctx, ctx // nd, num_sampled=4 * nd, num_spec_tokens=3 * nd)).breakdown]
        assert "drafter.eagle" in names
    # and a whole run at α = 0 takes longer than without spec decode
    sets = ["hardware.name=h100-sxm", "workload.num_prompts=20", "workload.output_len=64",
            "workload.request_rate=inf"]
    r0 = run_experiment(load_config(None, sets))
    r1 = run_experiment(load_config(None, sets + [
        "speculative_config.method=eagle", "speculative_config.num_speculative_tokens=3",
        "speculative_config.acceptance={rate: 0.0}"]))
    assert r1.counters["num_steps"] == r0.counters["num_steps"]
    assert r1.duration_s > r0.duration_s
    assert r1.counters["spec_decode_num_accepted_tokens"] == 0


@pytest.mark.parametrize("alpha,k", [(0.6, 3), (0.8, 5), (0.3, 2)])
def test_geometric_mean_acceptance_length(alpha, k):
    """Geometric α: vLLM's mean acceptance length (1 + accepted / drafts) matches
    (1 − α^(k+1)) / (1 − α) within 2% over a long run; per-position rates are α^i."""
    r = run_experiment(load_config(None, [
        "hardware.name=h100-sxm", "workload.num_prompts=200", "workload.input_len=256",
        "workload.output_len=256", "workload.request_rate=inf",
        "speculative_config.method=eagle", f"speculative_config.num_speculative_tokens={k}",
        f"speculative_config.acceptance={{rate: {alpha}}}"]))
    c = r.counters
    length = 1 + c["spec_decode_num_accepted_tokens"] / c["spec_decode_num_drafts"]
    assert length == pytest.approx(expected_acceptance_length(alpha, k), rel=0.02)
    per_pos = np.array(c["spec_decode_num_accepted_tokens_per_pos"]) / c[
        "spec_decode_num_drafts"]
    assert per_pos == pytest.approx([alpha ** i for i in range(1, k + 1)], abs=0.02)
    assert c["spec_decode_num_generation_tokens"] == 200 * 256


def test_per_position_and_synthetic_acceptance():
    """``per_position``: vLLM's unconditional per-position rates; vLLM's synthetic rejection
    sampler (``synthetic_acceptance_length``) reads as its minimum-variance schedule."""
    h = spec_harness(k=3, per_position=[0.9, 0.5, 0.1], seed=3)
    acc = h.sched.spec.acceptance
    u = np.random.default_rng(1).random(200_000)
    counts = np.bincount([acc.accepted(None, 3, 1.0 - x) for x in u], minlength=4)
    p_ge = counts[::-1].cumsum()[::-1] / len(u)
    assert p_ge[1:] == pytest.approx([0.9, 0.5, 0.1], abs=0.01)
    sc = SpeculativeConfig(method="eagle", num_speculative_tokens=3,
                           rejection_sample_method="synthetic",
                           synthetic_acceptance_length=2.5)
    sd = SpecDecoding(sc, np.random.default_rng(0))
    assert sd.acceptance.rates == [1.0, 0.5, 0.0]


@pytest.mark.filterwarnings("ignore:Async scheduling not supported")
def test_column_acceptance_reads_each_requests_rate(tmp_path):
    """``acceptance: {column: NAME}``: per-request α from a canonical trace column."""
    trace = tmp_path / "t.csv"
    rows = ["arrival_s,prompt_len,output_len,alpha"]
    rows += [f"{i * 0.01},128,200,{1.0 if i % 2 else 0.0}" for i in range(20)]
    trace.write_text("\n".join(rows) + "\n")
    r = run_experiment(load_config(None, [
        "hardware.name=h100-sxm", "workload.kind=trace", f"workload.path={trace}",
        "speculative_config.method=ngram", "speculative_config.num_speculative_tokens=2",
        "speculative_config.acceptance={column: alpha}"]))
    c = r.counters
    # α = 1 rows: 199 outputs after the prefill's in ceil(199 / 3) = 67 drafts of 2 accepted;
    # α = 0 rows: 199 drafts, none accepted
    assert c["spec_decode_num_drafts"] == 10 * 67 + 10 * 199
    assert c["spec_decode_num_accepted_tokens"] == 10 * 67 * 2


# ---------------------------------------------------------------------------------------------
# KV blocks never leak across rejections (property)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(1, 5), alpha=st.floats(0.0, 1.0), seed=st.integers(0, 1000),
       async_scheduling=st.booleans(), num_blocks=st.integers(24, 80),
       method=st.sampled_from(["eagle", "ngram", "draft_model"]),
       reqs=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 60), st.integers(0, 8)),
                     min_size=1, max_size=12))
def test_no_block_leak_across_rejections(k, alpha, seed, async_scheduling, num_blocks, method,
                                         reqs):
    """Random acceptance, small caches (preemption), sync and async: after every step each
    request holds at most the blocks for its tokens + drafts + lookahead (+ the drafts of a
    batch in flight), free ⟺ ref 0 holds, and at the end every block is free and every
    request produced exactly max_tokens outputs."""
    import simpy
    from servesim.simulator.engine import Replica
    from servesim.simulator.recorder import Recorder

    # (16 seats: a draft model's budget is 64 − 16 drafting slots, as vLLM resolves it)
    h = spec_harness(k=k, method=method, rate=alpha, seed=seed, num_blocks=num_blocks,
                     block_size=4, max_num_batched_tokens=64, max_model_len=256,
                     max_num_seqs=16, async_scheduling=async_scheduling)
    sched, kv = h.sched, h.kv
    env = simpy.Environment()
    la = sched.spec.num_lookahead_tokens

    def check(shape):
        kv.check_invariants()
        for r in sched.running:
            bound = r.num_tokens + 2 * k + la + (k + 1 if async_scheduling else 0)
            assert len(r.blocks) <= -(-min(bound, 256) // 4), r
        return 1.0

    rep = Replica(env, sched, check, Recorder(), h.finished.append,
                  async_scheduling=async_scheduling)

    def arrive():
        for i, (p, m, gap) in enumerate(reqs):
            if gap:
                yield env.timeout(gap)
            if -(-(p + m) // 4) <= num_blocks - 1:
                rep.add_request(h.make(str(i), p, m))

    env.process(arrive())
    env.run()
    kv.check_invariants()
    assert kv.get_num_free_blocks() == num_blocks - 1
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks if not b.is_null)
    for r in h.finished:
        assert r.num_output_tokens == r.max_tokens
        assert not r.blocks
    assert len(h.finished) == len(h.reqs)


# ---------------------------------------------------------------------------------------------
# vLLM's config resolution and CUDA graphs


def _resolved(*sets):
    return resolve_config(load_config(None, ["hardware.name=h100-sxm", *sets]))


@pytest.mark.parametrize("method,expect", [("eagle", True), ("eagle3", True), ("mtp", None),
                                           ("ngram_gpu", True), ("ngram", False),
                                           ("draft_model", False), ("medusa", False)])
def test_async_scheduling_resolution_follows_vllm_config(method, expect):
    """VllmConfig.__post_init__: async_scheduling=None stays on for EAGLE/MTP and ngram_gpu
    and turns off for other methods (draft_model included)."""
    sets = [f"speculative_config.method={method}", "speculative_config.num_speculative_tokens=2",
            "speculative_config.acceptance={rate: 0.5}"]
    if method == "mtp":
        with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
            build_cost_model(_resolved(*sets))
        c = _resolved(*sets, "model.name=deepseek-v3", "parallel.tensor_parallel_size=8",
                      "hardware.name=h200-sxm")
        assert c.scheduler.async_scheduling is True
        return
    if method == "draft_model":
        sets.append("speculative_config.model=llama-3.2-1b")
    with pytest.warns(UserWarning, match="Async scheduling not supported") if not expect \
            else _no_warning():
        c = _resolved(*sets)
    assert c.scheduler.async_scheduling is expect


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_async_explicitly_on_is_refused_for_ngram_but_allowed_for_draft_model():
    base = ["speculative_config.num_speculative_tokens=2",
            "speculative_config.acceptance={rate: 0.5}", "scheduler.async_scheduling=true"]
    with pytest.raises(ConfigError, match="async scheduling is only supported"):
        _resolved("speculative_config.method=ngram", *base)
    c = _resolved("speculative_config.method=draft_model",
                  "speculative_config.model=llama-3.2-1b", *base)
    assert c.scheduler.async_scheduling is True


@pytest.mark.parametrize("method, budget", [("draft_model", 2048 - 256), ("eagle", 2048)])
def test_draft_model_budget_leaves_a_drafting_slot_per_seat(method, budget):
    """``VllmConfig._set_max_num_scheduled_tokens``: max_num_scheduled_tokens =
    max_num_batched_tokens − max_num_new_slots_for_drafting · max_num_seqs, one slot per
    request for a draft model (A100 defaults: 2048 − 256 = 1792), none for EAGLE. A 5,000-token
    prompt alone is chunked at that budget."""
    sets = ["hardware.name=a100-sxm4-80gb", f"speculative_config.method={method}",
            "speculative_config.num_speculative_tokens=2", "speculative_config.acceptance={rate: 0.5}",
            "workload.num_prompts=1", "workload.input_len=5000", "workload.output_len=4",
            "scheduler.async_scheduling=false", "frontend.enable=false"]
    if method == "draft_model":
        sets.append("speculative_config.model=llama-3.2-1b")
    r = run_experiment(load_config(None, sets))
    assert list(r.steps["step_tokens"][:3]) == [budget, budget, 5000 - 2 * budget]


def test_draft_model_budget_must_leave_tokens():
    """In vLLM's order: max_num_batched_tokens ≥ max_num_seqs first (``SchedulerConfig``),
    then a budget left after the drafting slots, then (chunked prefill off) a budget of at
    least max_model_len."""
    sets = ["speculative_config.method=draft_model", "speculative_config.model=llama-3.2-1b",
            "speculative_config.num_speculative_tokens=2",
            "speculative_config.acceptance={rate: 0.5}", "scheduler.max_num_seqs=256"]
    with pytest.raises(ConfigError, match="must be greater than or equal to max_num_seqs"):
        _resolved(*sets, "scheduler.max_num_batched_tokens=100")
    with pytest.raises(ConfigError, match="max_num_scheduled_tokens is set to 0 based on the "
                       "speculative decoding settings"):
        _resolved(*sets, "scheduler.max_num_batched_tokens=256")
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(4096 less 256 draft-model "
                       r"drafting slots\) is smaller than max_model_len \(4000\)"):
        _resolved(*sets, "scheduler.max_num_batched_tokens=4096", "model.max_model_len=4000",
                  "scheduler.enable_chunked_prefill=false")
    _resolved(*sets, "scheduler.max_num_batched_tokens=4256", "model.max_model_len=4000",
              "scheduler.enable_chunked_prefill=false")


def test_lora_with_spec_decode_needs_a_budget_for_every_draft():
    """``EngineArgs.create_engine_config``: LoRA + speculative decoding is refused when
    max_num_batched_tokens < max_num_seqs · (k + 1): H100 defaults 8192 < 1024 · 9 at k = 8,
    accepted at k = 7 (8192 = 1024 · 8)."""
    sets = ["lora.enable_lora=true", "speculative_config.method=eagle",
            "speculative_config.acceptance={rate: 0.5}"]
    with pytest.raises(ConfigError, match=r"8192 < max_num_seqs \(1024\) x "
                       r"\(num_speculative_tokens \+ 1\) with LoRA"):
        _resolved(*sets, "speculative_config.num_speculative_tokens=8")
    c = _resolved(*sets, "speculative_config.num_speculative_tokens=7")
    assert c.scheduler.max_num_batched_tokens == 8192


def test_cudagraph_sizes_are_multiples_of_one_plus_k_and_uniform_decode_replays_full():
    """VllmConfig._set_cudagraph_sizes uses decode_query_len = 1 + k for the maximum;
    CompilationConfig.adjust_cudagraph_sizes_for_spec_decode rounds sizes up to multiples of
    1 + k; GPUModelRunner._is_uniform_decode: only batches whose rows all have 1 + k tokens
    replay the FULL decode graph."""
    c = _resolved("scheduler.max_num_seqs=16", "speculative_config.method=eagle",
                  "speculative_config.num_speculative_tokens=3",
                  "speculative_config.acceptance={rate: 0.5}")
    sizes = c.compilation.cudagraph_capture_sizes
    assert c.compilation.max_cudagraph_capture_size == 128  # min(2·16·4, 512)
    assert all(s % 4 == 0 for s in sizes) and sizes[0] == 4 and sizes[-1] == 128
    m = build_cost_model(c)
    uniform = BatchShape(5, 5000, 1000, num_sampled=20, num_spec_tokens=15)
    ragged = BatchShape(5, 5000, 1000, num_sampled=18, num_spec_tokens=13)
    assert m.step_time(uniform).cudagraph == "FULL" and m.step_time(uniform).padded_batch == 24
    assert sizes[:4] == [4, 8, 16, 24]  # 1, 2, 4 → 4; 8; 16; 24 (no 20: padded to 24)
    assert m.step_time(ragged).cudagraph == "PIECEWISE"


@pytest.mark.filterwarnings("ignore:Async scheduling not supported")
def test_drafter_and_lookahead_by_method():
    """num_lookahead_tokens = k for EAGLE/MTP/draft models, 0 for n-gram (Scheduler
    .__init__); the drafter's weights and KV enter the memory plan."""
    from servesim.costmodels import plan_memory

    assert SpecDecoding(spec("eagle", 4), np.random.default_rng(0)).num_lookahead_tokens == 4
    assert SpecDecoding(spec("ngram", 4), np.random.default_rng(0)).num_lookahead_tokens == 0
    base = plan_memory(_resolved())
    eagle = plan_memory(_resolved("speculative_config.method=eagle",
                                  "speculative_config.num_speculative_tokens=3",
                                  "speculative_config.acceptance={rate: 0.5}"))
    ngram = plan_memory(_resolved("speculative_config.method=ngram",
                                  "speculative_config.num_speculative_tokens=3",
                                  "speculative_config.acceptance={rate: 0.5}"))
    # no drafter memory for n-gram; the profile's dummy pass also runs the rejection sampler
    # (2 × 1024 rows of logits: 22 bytes per 1024 × vocab logit, not the sampler's 14), and
    # the CUDA-graph estimate moves: the 51 capture sizes rounded to multiples of 1 + k = 4
    # are 49 (each PIECEWISE and FULL), 4 graphs × 4 MiB fewer, the same 512-token capture
    assert base.activation_peak_bytes == 1024 * 128256 * 14
    assert ngram.activation_peak_bytes == eagle.activation_peak_bytes == 1024 * 128256 * 22
    assert ngram.cudagraph_captures == (("PIECEWISE", 49, 512), ("FULL", 49, 512))
    assert base.cudagraph_bytes - ngram.cudagraph_bytes == 4 * 4 * 2**20
    assert ngram.available_kv_bytes - base.available_kv_bytes == \
        4 * 4 * 2**20 - 1024 * 128256 * 8
    assert eagle.draft_kv_bytes_per_token == base.kv_bytes_per_token // 32  # one layer
    assert 0.3 < eagle.draft_weights_bytes / 2**30 < 0.6
    assert eagle.num_gpu_blocks < base.num_gpu_blocks


@pytest.mark.filterwarnings("ignore:Async scheduling not supported")
def test_config_errors_are_one_line():
    with pytest.raises(ConfigError, match="acceptance: required"):
        load_config(None, ["speculative_config.method=eagle",
                           "speculative_config.num_speculative_tokens=3"])
    with pytest.raises(ConfigError, match="non-increasing"):
        load_config(None, ["speculative_config.method=eagle",
                           "speculative_config.num_speculative_tokens=2",
                           "speculative_config.acceptance={per_position: [0.5, 0.7]}"])
    with pytest.raises(ConfigError, match="pipeline_parallel_size"):
        _resolved("speculative_config.method=eagle", "speculative_config.num_speculative_tokens=2",
                  "speculative_config.acceptance={rate: 0.5}", "parallel.pipeline_parallel_size=2")
    with pytest.raises(ConfigError, match="same vocabulary size|draft_model"):
        build_cost_model(_resolved("speculative_config.method=draft_model",
                                   "speculative_config.num_speculative_tokens=2",
                                   "speculative_config.acceptance={rate: 0.5}"))
    with pytest.raises(ConfigError, match=r"^speculative_config\.model: unknown model 'nope'"):
        build_cost_model(_resolved("speculative_config.method=draft_model",
                                   "speculative_config.model=nope",
                                   "speculative_config.num_speculative_tokens=2",
                                   "speculative_config.acceptance={rate: 0.5}"))
    with pytest.raises(ConfigError, match="runs its own scheduling loop"):
        run_experiment(load_config(None, ["scheduler.policy=sarathi", "workload.num_prompts=2",
                                          "speculative_config.method=eagle",
                                          "speculative_config.num_speculative_tokens=2",
                                          "speculative_config.acceptance={rate: 0.5}"]))


def test_expected_acceptance_length_formula():
    assert expected_acceptance_length(0.6, 3) == pytest.approx((1 - 0.6 ** 4) / 0.4)
    assert expected_acceptance_length(1.0, 3) == 4.0
    assert expected_acceptance_length(0.0, 3) == 1.0
    assert math.isclose(expected_acceptance_length(0.5, 1), 1.5)


def test_batch_shape_with_drafts_of_several_requests():
    """Two decoding requests verifying k = 3 drafts each: 2 decode rows, 6 draft tokens, logits
    at every position (2 · (1 + 3) = 8), contexts computed + 1 (the drafts are not context)."""
    h = spec_harness(k=3, rate=0.0, block_size=16)
    h.add("a", 30, 10)
    h.add("b", 20, 10)
    h.step()
    s = h.step().shape
    assert (s.num_decode, s.num_spec_tokens, s.num_sampled) == (2, 6, 8)
    assert (s.decode_context_sum, s.decode_context_max) == (31 + 21, 31)
    assert s.prefill_new_tokens == ()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_rows_capped_at_max_model_len_minus_one(async_scheduling):
    """vLLM ``Scheduler.schedule``: ``num_new_tokens = min(1 + k, max_model_len − 1 −
    num_computed_tokens)``. α = 0 (one token per decode step), k = 3, prompt 50, 13 outputs,
    max_model_len 64. Sync: computed before decode j is 50 + j − 1, so rows are 4 until
    j = 10, then 3 and 2. Async: vLLM's computed still holds the batch in flight, its drafts
    included (rejected only when it returns): 50 + (j − 2) + n(j−1), so the cap bites three
    steps earlier and shrinks as the rows in flight do: 3, 3, 2, 2, 1."""
    h, trace = engine_with_spec([(0.0, "r", 50, 13)], k=3, rate=0.0,
                                async_scheduling=async_scheduling, max_model_len=64)
    rows = [t[1]["r"] for t in trace]
    if async_scheduling:
        assert rows == [50] + [4] * 7 + [3, 3, 2, 2, 1]
    else:
        assert rows == [50] + [4] * 10 + [3, 2]
    assert h.reqs["r"].num_output_tokens == 13


@pytest.mark.filterwarnings("ignore:Async scheduling not supported")
def test_acceptance_counters_leave_warm_up_out():
    """``vllm bench serve`` reads the vllm:spec_decode_* counters before and after its
    measured run; with warm-up requests left out of the metrics, result.json's counters are
    the timeseries counters' growth from the first measured send to the last measured end
    (the last row before the start, the last at or before the end), not the run's totals."""
    from pathlib import Path

    from servesim.reports.bench_result import compute_bench_result

    eagle = str(Path(__file__).resolve().parents[2] / "configs" / "llama8b_h100_eagle.yaml")
    res = run_experiment(load_config(eagle, ["workload.num_prompts=120",
                                             "workload.warmup={num_requests: 40}"]))
    b = compute_bench_result(res)
    q = res.requests
    measured = ~np.asarray(q["warmup"], dtype=bool)
    t0 = float(np.min(np.asarray(q["send_s"])[measured]))
    t1 = float(np.max(np.asarray(q["finish_s"])[measured]))
    tt = np.asarray(res.steps["time_s"])
    before = tt < t0
    upto = tt <= t1

    def grown(col):
        v = np.asarray(res.steps[col])
        return int(v[upto][-1] - (v[before][-1] if before.any() else 0))

    drafts = grown("vllm:spec_decode_num_drafts_total")
    accepted = grown("vllm:spec_decode_num_accepted_tokens_total")
    assert b["num_warmup_requests"] == 40 and b["completed"] == 80
    assert (b["spec_decode_num_drafts"], b["spec_decode_accepted_tokens"]) == (drafts, accepted)
    assert b["spec_decode_draft_tokens"] == grown("vllm:spec_decode_num_draft_tokens_total")
    assert 0 < drafts < res.counters["spec_decode_num_drafts"]
    assert b["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    whole = compute_bench_result(run_experiment(load_config(eagle, ["workload.num_prompts=120"])))
    assert whole["spec_decode_num_drafts"] == res.counters["spec_decode_num_drafts"]
