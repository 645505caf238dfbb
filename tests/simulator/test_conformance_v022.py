"""Conformance with vLLM 0.22.1 beyond the course's traces: the full-prompt admission check,
async scheduling (two batches in flight, output placeholders), chunked-prefill-off head-of-line
blocking, priority ties, the default batch limits, CUDA-graph capture sizes, logits rows, DP
load balancing and the API server's context-length refusal. Each test names the vLLM function
it follows (source: ``pip download --no-deps --no-binary :all: vllm==0.22.1``)."""

import types
from pathlib import Path

import pytest
import simpy
from harness import Harness, run_engine
from servesim.simulator.client import Client
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.engine import Replica
from servesim.simulator.request import Request, RequestStatus
from servesim.workloads.schema import RequestSpec

DECODES_A = [{"A": 1}] * 7


# -- KVCacheManager.allocate_slots(full_sequence_must_fit=True) ------------------------------

@pytest.mark.parametrize("fast_path", [True, False])
def test_full_prompt_admission_check(fast_path):
    """``Scheduler.schedule`` waiting loop → ``allocate_slots(full_sequence_must_fit=
    scheduler_reserve_full_isl)``: 10 usable blocks of 16, budget 64, two 96-token prompts
    (6 blocks each), 8 outputs each. Step 2 has 32 tokens of budget left for B, but B's whole
    prompt needs 6 blocks and only 10 − 6 = 4 are free: B waits until A finishes (A's 8th
    output needs a 7th block), with no preemption."""
    h = Harness(num_blocks=11, block_size=16, max_num_batched_tokens=64, fast_path=fast_path)
    h.add("A", 96, 8)
    h.add("B", 96, 8)
    steps = h.run()
    assert steps == [{"A": 64}, {"A": 32}] + DECODES_A + [{"B": 64}, {"B": 32}] + \
        [{"B": 1}] * 7
    assert h.sched.num_preemptions == 0


def test_first_chunk_admission_thrashes_without_the_check():
    """The same trace with ``reserve_full_isl: false`` (vLLM before the gate): B is admitted
    on its first chunk in step 2, and in step 3 B cannot get its next two blocks: it preempts
    itself (running.pop())."""
    h = Harness(num_blocks=11, block_size=16, max_num_batched_tokens=64, reserve_full_isl=False)
    h.add("A", 96, 8)
    h.add("B", 96, 8)
    assert h.step().as_dict() == {"A": 64}
    assert h.step().as_dict() == {"A": 32, "B": 32}
    out = h.step()
    assert out.as_dict() == {"A": 1} and [r.request_id for r in out.preempted] == ["B"]


def test_full_check_counts_hits_and_revived_blocks():
    """``get_num_blocks_to_allocate``: the whole-sequence need is ceil(num_tokens / 16) minus
    prefix-hit blocks, plus hit blocks that must be revived from the free queue."""
    h = Harness(num_blocks=9, block_size=16, max_num_batched_tokens=64)
    prefix = list(range(64))
    h.add("A", 64, 1, token_ids=prefix)  # 4 blocks, all full: cached
    assert h.run() == [{"A": 64}]
    # A is done: its 4 cached blocks are free (ref 0) but hold the prefix; 8 blocks free.
    b = h.add("B", 64 + 80, 1, token_ids=prefix + list(range(100, 180)))
    # B: 9 blocks in all, 4 hit → 5 new + 4 revived = 9 > 8 free: refused, though the first
    # chunk (4 hit blocks + 64 new tokens → 4 new blocks + 4 revived = 8) would fit.
    assert h.step().as_dict() == {}
    assert b.status == RequestStatus.WAITING
    h2 = Harness(num_blocks=10, block_size=16, max_num_batched_tokens=64)
    h2.add("A", 64, 1, token_ids=prefix)
    h2.run()
    h2.add("B", 144, 1, token_ids=prefix + list(range(100, 180)))
    assert h2.step().as_dict() == {"B": 64}  # 9 ≤ 9 free
    assert h2.reqs["B"].num_cached_tokens == 64


# -- async scheduling: EngineCore.step_with_batch_queue + AsyncScheduler ----------------------

def _first_batch_with(trace, rid):
    for i, (t, sched, _) in enumerate(trace):
        if rid in sched:
            return i, t
    raise AssertionError(f"{rid} never scheduled")


def test_arrival_runs_one_step_later_sync_two_async():
    """A request arriving during step k (here B at t=1.5, during the step [1, 2]) is first
    scheduled in step k+1 with synchronous scheduling (``EngineCore.step``) and in step k+2
    with async scheduling: batch k+1 was scheduled when batch k−1 returned (t=1), before B
    arrived (``step_with_batch_queue``, queue of 2)."""
    arrivals = [(0.0, "A", 16, 10), (1.5, "B", 16, 2)]
    h, trace = run_engine(arrivals, async_scheduling=False)
    assert [s for _, s, _ in trace[:3]] == [{"A": 16}, {"A": 1}, {"A": 1, "B": 16}]
    assert _first_batch_with(trace, "B") == (2, 2.0)  # runs [2, 3]
    assert h.reqs["B"].first_token_time == 3.0
    h, trace = run_engine(arrivals, async_scheduling=True)
    assert [t for t, _, _ in trace[:4]] == [0.0, 0.0, 1.0, 2.0]
    assert [s for _, s, _ in trace[:4]] == [{"A": 16}, {"A": 1}, {"A": 1}, {"A": 1, "B": 16}]
    assert _first_batch_with(trace, "B") == (3, 2.0)  # batch 4 runs [3, 4]
    assert h.reqs["B"].first_token_time == 4.0
    assert h.reqs["B"].first_scheduled_time == 2.0


@pytest.mark.parametrize("fast_path", [True, False])
def test_eos_stop_gets_one_extra_token_under_async(fast_path):
    """``AsyncScheduler``: the scheduler learns of an EOS stop only when the batch returns, so
    the request is scheduled once more (its token is discarded by ``update_from_output``).
    A stop at ``max_tokens`` is known: ``schedule()`` skips a request whose output in flight
    reaches max_tokens (``num_computed_tokens + 2 − num_output_placeholders ≥ prompt +
    max_tokens``)."""
    kw = {"fast_path": fast_path}
    h, trace = run_engine([(0.0, "A", 16, 0, {"eos_after": 3})], async_scheduling=True, **kw)
    assert [s for _, s, _ in trace] == [{"A": 16}, {"A": 1}, {"A": 1}, {"A": 1}]
    a = h.reqs["A"]
    assert (a.num_output_tokens, a.status, a.finish_time) == (3, RequestStatus.FINISHED_STOPPED,
                                                               3.0)
    h, trace = run_engine([(0.0, "A", 16, 3)], async_scheduling=True, **kw)
    assert [s for _, s, _ in trace] == [{"A": 16}, {"A": 1}, {"A": 1}]
    assert h.reqs["A"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    h, trace = run_engine([(0.0, "A", 16, 0, {"eos_after": 3})], async_scheduling=False, **kw)
    assert [s for _, s, _ in trace] == [{"A": 16}, {"A": 1}, {"A": 1}]
    assert h.reqs["A"].finish_time == 3.0


@pytest.mark.parametrize("fast_path", [True, False])
def test_finished_request_frees_its_seat_one_step_later_under_async(fast_path):
    """``max_num_seqs`` = 2: C decodes throughout; A (2 outputs) finishes with the step that
    ends at t=2. Sync: B takes A's seat in the step scheduled at t=2. Async: the batch
    scheduled at t=1 still counts A as running (its stop is in flight; A gets no token since
    its output in flight reaches max_tokens), so B is scheduled at t=2 into the batch that
    runs [3, 4]."""
    arrivals = [(0.0, "C", 16, 8), (0.0, "A", 16, 2), (0.0, "B", 16, 2)]
    kw = {"max_num_seqs": 2, "fast_path": fast_path}
    h, trace = run_engine(arrivals, async_scheduling=False, **kw)
    assert [s for _, s, _ in trace[:3]] == [{"C": 16, "A": 16}, {"C": 1, "A": 1},
                                            {"C": 1, "B": 16}]
    assert h.reqs["B"].first_token_time == 3.0
    h, trace = run_engine(arrivals, async_scheduling=True, **kw)
    assert [(t, s) for t, s, _ in trace[:4]] == [
        (0.0, {"C": 16, "A": 16}), (0.0, {"C": 1, "A": 1}), (1.0, {"C": 1}),
        (2.0, {"C": 1, "B": 16})]
    assert h.reqs["A"].finish_time == 2.0
    assert h.reqs["B"].first_token_time == 4.0


def test_async_full_admission_trace_matches_sync_decisions():
    """The admission trace under async scheduling: the same decisions; B is admitted by the
    schedule() call that follows A's last batch (A's blocks are freed when it returns)."""
    arrivals = [(0.0, "A", 96, 8), (0.0, "B", 96, 8)]
    h, trace = run_engine(arrivals, async_scheduling=True, num_blocks=11,
                          max_num_batched_tokens=64)
    assert [s for _, s, _ in trace] == [{"A": 64}, {"A": 32}] + DECODES_A + \
        [{"B": 64}, {"B": 32}] + [{"B": 1}] * 7
    assert h.sched.num_preemptions == 0
    assert h.reqs["A"].finish_time == 9.0
    assert _first_batch_with(trace, "B")[1] == 9.0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pipeline_parallel_batch_queue(async_scheduling):
    """pp = 2 (``max_concurrent_batches = pp``), each batch 1 s through both stages, a new
    batch every 0.5 s. Sync PP (plain ``Scheduler``): a decode in flight is not scheduled
    again until its token is back. Async PP (``AsyncScheduler``): output placeholders let the
    decode be scheduled in every micro-batch."""
    h, trace = run_engine([(0.0, "A", 8, 6)], async_scheduling=async_scheduling, pp=2)
    a = h.reqs["A"]
    assert a.num_output_tokens == 6 and a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    if not async_scheduling:
        assert [s for _, s, _ in trace] == [{"A": 8}] + [{"A": 1}] * 5
        assert [t for t, _, _ in trace] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    else:
        # Both micro-batches are scheduled at t=0; then one each time a batch returns, and
        # none once the output in flight reaches max_tokens (tokens at 1.0, 1.5, ..., 3.5).
        assert [(t, s) for t, s, _ in trace] == [(0.0, {"A": 8})] + [
            (t, {"A": 1}) for t in (0.0, 1.0, 1.5, 2.0, 2.5)]
        assert a.first_token_time == 1.0 and a.finish_time == 3.5


# -- Scheduler.schedule: chunked prefill off ----------------------------------------------------

@pytest.mark.parametrize("fast_path", [True, False])
def test_chunked_prefill_off_head_blocks_the_queue(fast_path):
    """Without chunked prefill a waiting head that does not fit the budget stops the waiting
    loop (``break``), it is not skipped: C (8 tokens) waits behind B (40) in step 1."""
    h = Harness(max_num_batched_tokens=64, chunked=False, fast_path=fast_path)
    h.add("A", 40, 3)
    h.add("B", 40, 3)
    h.add("C", 8, 3)
    assert h.run() == [{"A": 40}, {"A": 1, "B": 40, "C": 8}, {"A": 1, "B": 1, "C": 1},
                       {"B": 1, "C": 1}]


# -- Request.__lt__ and the priority victim -----------------------------------------------------

def test_priority_waiting_ties_break_on_request_id_string():
    """``PriorityRequestQueue`` orders by ``Request.__lt__``: (priority, arrival_time,
    request_id) — ids compare as strings, so "r10" is admitted before "r2"."""
    h = Harness(policy="priority", max_num_seqs=1)
    h.add("r2", 8, 1)
    h.add("r10", 8, 1)
    assert h.run() == [{"r10": 8}, {"r2": 8}]


@pytest.mark.parametrize("fast_path", [True, False])
def test_priority_victim_is_first_tied_in_running_order(fast_path):
    """``max(self.running, key=lambda r: (r.priority, r.arrival_time))`` returns the first of
    tied requests: with equal priority and arrival time the OLDEST running request X is the
    victim — here X was already scheduled this step, so its token goes back to the budget."""
    h = Harness(policy="priority", block_size=4, num_blocks=5, fast_path=fast_path)
    for rid in ("X", "Y", "Z"):
        h.add(rid, 4, 3)
    assert h.step().as_dict() == {"X": 4, "Y": 4, "Z": 4}
    out = h.step()
    assert [r.request_id for r in out.preempted] == ["X"]
    assert out.as_dict() == {"Y": 1, "Z": 1}


# -- EngineArgs defaults, VllmConfig._set_cudagraph_sizes -------------------------------------

def _resolved(*sets):
    return resolve_config(load_config(None, list(sets)))


def test_max_num_seqs_defaults_to_at_most_the_token_budget():
    """``_set_default_max_num_seqs_and_batched_tokens_args``: an unset max_num_seqs is
    min(default, max_num_batched_tokens): 512 on H100 with a 512-token budget."""
    c = _resolved("hardware.name=h100-sxm", "scheduler.max_num_batched_tokens=512")
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (512, 512)
    # An unset budget is at most max_num_seqs · max_model_len: 256 · 4 = 1024 on A100.
    c = _resolved("hardware.name=a100-sxm4-80gb", "model.max_model_len=4")
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (256, 1024)
    c = _resolved("hardware.name=h100-sxm")
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (1024, 8192)
    assert c.scheduler.async_scheduling is True


def test_cudagraph_capture_sizes():
    """Sizes [1, 2, 4] + 8..248 step 8 + 256..max step 16, max = min(budget, 2·max_num_seqs,
    512); the budget itself is captured when it is ≤ max; a user list is filtered by the budget
    only."""
    c = _resolved("hardware.name=a100-sxm4-80gb", "scheduler.max_num_batched_tokens=300")
    sizes = c.compilation.cudagraph_capture_sizes
    assert sizes == [1, 2, 4] + list(range(8, 256, 8)) + [256, 272, 288, 300]
    assert c.compilation.max_cudagraph_capture_size == 300
    c = _resolved("hardware.name=h100-sxm")
    assert c.compilation.cudagraph_capture_sizes[-3:] == [480, 496, 512]
    c = _resolved("hardware.name=a100-sxm4-80gb",
                  "compilation.cudagraph_capture_sizes=[4096, 1, 2, 1024]")
    assert c.compilation.cudagraph_capture_sizes == [1, 2, 1024]
    assert c.compilation.max_cudagraph_capture_size == 1024


@pytest.mark.parametrize("level, asked, expected", [
    (0, None, "NONE"), (1, None, "PIECEWISE"), (2, None, "FULL_AND_PIECEWISE"),
    (3, None, "FULL_AND_PIECEWISE"),
    # -O0 compiles nothing: modes with piecewise graphs need the compiled graph's pieces
    (0, "PIECEWISE", "NONE"), (0, "FULL_AND_PIECEWISE", "NONE"), (0, "FULL", "FULL"),
    (0, "FULL_DECODE_ONLY", "FULL_DECODE_ONLY"), (1, "FULL", "FULL"), (2, "NONE", "NONE"),
])
def test_optimization_level_sets_the_cudagraph_mode(level, asked, expected):
    """``OPTIMIZATION_LEVEL_0x["compilation_config"]["cudagraph_mode"]`` fills an unset mode;
    ``VllmConfig.__post_init__``: ``cudagraph_mode.requires_piecewise_compilation()`` with
    ``CompilationMode.NONE`` (what -O0 sets) → NONE."""
    sets = [f"optimization_level={level}"]
    if asked is not None:
        sets.append(f"compilation.cudagraph_mode={asked}")
    assert _resolved(*sets).compilation.cudagraph_mode == expected


def test_no_cuda_graph_resolves_as_vllm():
    """``VllmConfig``: --enforce-eager sets cudagraph_mode NONE, max_cudagraph_capture_size 0
    and no capture sizes (what it asked for is overridden); a NONE mode (-O0 here) resolves
    the sizes the same way (``_set_cudagraph_sizes``: no cudagraph in use)."""
    for sets in (["model.enforce_eager=true", "compilation.cudagraph_mode=FULL",
                  "compilation.max_cudagraph_capture_size=64"], ["optimization_level=0"]):
        comp = _resolved(*sets).compilation
        assert (comp.cudagraph_mode, comp.max_cudagraph_capture_size,
                comp.cudagraph_capture_sizes) == ("NONE", 0, [])


def test_optimization_level_reaches_the_memory_plan_and_the_step_time():
    """-O0 plans and steps exactly as cudagraph_mode NONE (every kernel launched from the CPU),
    -O1 as PIECEWISE (graph pieces between eager attention kernels); both differ from the
    default, whose one-row decode replays one full graph."""
    from servesim.costmodels import build_cost_model, plan_memory
    from servesim.costmodels.step import BatchShape

    def plan_and_step(*sets):
        c = _resolved(*sets)
        st = build_cost_model(c).step_time(BatchShape(
            num_decode=1, decode_context_sum=100, decode_context_max=100, num_sampled=1))
        launches = next(o.count for o in st.breakdown if o.name == "kernel_launch")
        return plan_memory(c).num_gpu_blocks, st.cudagraph, launches, st.seconds

    default = plan_and_step()
    eager = plan_and_step("optimization_level=0")
    piecewise = plan_and_step("optimization_level=1")
    assert eager == plan_and_step("compilation.cudagraph_mode=NONE")
    assert piecewise == plan_and_step("compilation.cudagraph_mode=PIECEWISE")
    assert plan_and_step("optimization_level=3") == default
    # an unresolved config (cudagraph_mode null) is read the same way
    raw = load_config(None, ["optimization_level=0"])
    assert raw.compilation.cudagraph_mode is None
    assert build_cost_model(raw).cudagraph_mode == "NONE"
    # Llama-3.1-8B, 32 layers; the LM head + sampler (1 + 8 kernels) run eagerly in every
    # mode: FULL one graph; PIECEWISE 33 graph pieces + 32 · 2 attention kernels; NONE 32 ·
    # 10 layer kernels (2 norms, rope, qkv, cache write + attention, o, gate_up, act, down)
    # + embedding + final norm
    assert [x[1:3] for x in (default, piecewise, eager)] == \
        [("FULL", 1 + 9), ("PIECEWISE", 33 + 64 + 9), ("NONE", 320 + 2 + 9)]


def test_performance_mode_throughput_doubles_the_unset_defaults():
    """``if self.performance_mode == "throughput"``: each limit left unset is doubled, before
    the max_model_len and budget caps; a limit the user set is kept."""
    c = _resolved("hardware.name=h100-sxm", "performance_mode=throughput")
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (2048, 16384)
    c = _resolved("hardware.name=a100-sxm4-80gb", "performance_mode=throughput")
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (512, 4096)
    c = _resolved("hardware.name=a100-sxm4-80gb", "performance_mode=throughput",
                  "scheduler.max_num_seqs=100")
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (100, 4096)
    # the budget cap min(max_num_seqs · max_model_len, ·) applies after doubling: 512 · 4
    c = _resolved("hardware.name=a100-sxm4-80gb", "performance_mode=throughput",
                  "model.max_model_len=4")
    assert (c.scheduler.max_num_seqs, c.scheduler.max_num_batched_tokens) == (512, 2048)
    # capture max = min(2 · 512, 512) = 512: the graphs are those of the balanced mode
    assert c.compilation.max_cudagraph_capture_size == 512
    assert c.performance_mode == "throughput"


def test_performance_mode_interactivity_captures_every_small_size():
    """``if self.performance_mode == "interactivity"``: sizes ``range(1, min(max, 32) + 1)``
    instead of [1, 2, 4], then the usual 8-steps from 8 (deduplicated) and 16-steps from 256;
    a user list is still only filtered by the budget."""
    c = _resolved("hardware.name=a100-sxm4-80gb", "performance_mode=interactivity")
    assert c.compilation.cudagraph_capture_sizes == \
        list(range(1, 33)) + list(range(40, 256, 8)) + list(range(256, 513, 16))
    c = _resolved("hardware.name=a100-sxm4-80gb", "performance_mode=interactivity",
                  "compilation.max_cudagraph_capture_size=20")
    assert c.compilation.cudagraph_capture_sizes == list(range(1, 21))
    c = _resolved("hardware.name=a100-sxm4-80gb", "performance_mode=interactivity",
                  "compilation.cudagraph_capture_sizes=[4, 64]")
    assert c.compilation.cudagraph_capture_sizes == [4, 64]


@pytest.mark.parametrize("key", ["max_num_partial_prefills", "max_long_partial_prefills"])
def test_partial_prefills_other_than_one_are_refused(key):
    """``EngineArgs._check_feature_supported``: a non-default partial-prefill count raises
    "Concurrent Partial Prefill is not supported" at start-up (the V1 scheduler has none;
    ``SchedulerConfig``'s 4%-threshold default behind it is never reached)."""
    from servesim.simulator.errors import ConfigError

    with pytest.raises(ConfigError, match=f"scheduler.{key}: 2: vLLM 0.22.1 refuses to start "
                       "with it \\(Concurrent Partial Prefill is not supported"):
        _resolved(f"scheduler.{key}=2")
    c = _resolved(f"scheduler.{key}=1")
    assert c.scheduler.long_prefill_token_threshold == 0


@pytest.mark.parametrize("hardware, sets, block", [
    ("b200", [], 32),  # FlashInfer-MLA: sizes 32, 64
    ("h200-sxm", [], 16),  # FlashAttention-MLA: multiples of 16
    ("h200-sxm", ["cache.cache_dtype=fp8"], 64),  # FlashAttention-MLA takes no fp8 KV: FlashMLA
    ("a100-sxm4-80gb", [], 16),  # Triton-MLA
    ("b200", ["cache.block_size=64"], 64),  # --block-size given: kept
])
def test_mla_block_size_is_the_attention_backends(hardware, sets, block):
    """``Platform._find_non_ssm_backend`` → ``get_preferred_block_size``: an unset block
    size is 16 unless the selected backend (``CudaPlatform`` MLA priorities by compute
    capability) does not take 16, then its smallest size. DeepSeek-V3 (qk_nope_head_dim 128)."""
    c = _resolved("model.name=deepseek-v3", "model.quantization=fp8",
                  "parallel.tensor_parallel_size=8", f"hardware.name={hardware}", *sets)
    assert c.cache.block_size == block


def test_mla_fp8_e5m2_kv_has_no_backend():
    """Every MLA backend lists auto / 16-bit / fp8 / fp8_e4m3 KV only: vLLM stops with "No
    valid attention backend found"."""
    from servesim.simulator.errors import ConfigError

    with pytest.raises(ConfigError, match="fp8_e5m2: no MLA attention backend"):
        _resolved("model.name=deepseek-v3", "model.quantization=fp8", "hardware.name=b200",
                  "parallel.tensor_parallel_size=8", "cache.cache_dtype=fp8_e5m2")


def test_non_mla_block_size_is_16_on_every_gpu():
    for hw in ("b200", "h100-sxm", "a100-sxm4-80gb", "mi300x"):
        assert _resolved(f"hardware.name={hw}").cache.block_size == 16


def test_vllm_default_flags_leave_the_config_hash_alone():
    """``optimization_level: 2`` and ``performance_mode: balanced`` are vLLM's defaults: written
    or not, the resolved config dumps (and hashes) the same, without the two keys."""
    plain = _resolved()
    spelled = _resolved("optimization_level=2", "performance_mode=balanced",
                        "compilation.cudagraph_mode=FULL_AND_PIECEWISE",
                        "scheduler.max_num_partial_prefills=1",
                        "scheduler.max_long_partial_prefills=1")
    assert plain.config_hash() == spelled.config_hash()
    example = Path(__file__).resolve().parents[2] / "configs" / "llama8b_a100.yaml"
    # (servesim 0f8260e, before these keys existed; the example then pinned utilization 0.9)
    assert resolve_config(load_config(example, ["cache.gpu_memory_utilization=0.9"])
                          ).config_hash() == "ecb515e4795560cd"
    assert "optimization_level" not in plain.dump_tree()
    assert _resolved("optimization_level=1").dump_tree()["optimization_level"] == 1


# -- GPUModelRunner: logits for every scheduled row --------------------------------------------

def test_logits_rows_include_partial_prefill_chunks():
    """``logits_indices = query_start_loc[1:] − 1``: one logits row per scheduled request,
    partial prefill chunks included (their sampled token is discarded)."""
    h = Harness(max_num_batched_tokens=20)
    h.add("A", 8, 4)
    h.step()
    h.add("B", 50, 2)
    out = h.step()
    assert out.as_dict() == {"A": 1, "B": 19}  # B is mid-prefill
    assert out.shape.num_sampled == 2


# -- DPLBAsyncMPClient.get_core_engine_for_request ---------------------------------------------

def _lb_client(num_engines: int, num_servers: int, engine_stats: bool = True):
    env = simpy.Environment()
    scheds = [types.SimpleNamespace(num_waiting=0, num_running=0) for _ in range(num_engines)]
    client = Client.__new__(Client)
    client.env = env
    client.replicas = [types.SimpleNamespace(scheduler=s) for s in scheds]
    client._lb_counts = [[[0, 0] for _ in scheds] for _ in range(num_servers)]
    client._lb_next = 0.0
    client._lb_engine_stats = engine_stats
    return env, scheds, client


def test_dp_load_balancer_scans_from_engine_zero_with_local_increments():
    """Score waiting·4 + running over the coordinator's last published counts (MoE ranks,
    ``DPEngineCoreProc``, publish theirs; refreshed every 100 ms), first minimum from engine
    0, then the chosen engine's waiting count += 1 locally (one API server)."""
    env, scheds, client = _lb_client(3, 1)
    assert [client._route() for _ in range(4)] == [0, 1, 2, 0]
    scheds[0].num_running = 9  # not seen until the next refresh
    assert client._route() == 1
    env.run(until=0.1)
    assert client._route() == 1  # refreshed: engine 0 scores 9, engines 1 and 2 score 0


def test_dense_dp_ranks_publish_no_counts_so_the_balancer_follows_its_own_picks():
    """vLLM 0.22.1 runs a dense model's DP ranks as independent ``EngineCoreProc``s that send
    the coordinator no request counts: it republishes [0, 0] every 5 s, which resets each
    API server's table; in between only the local increments steer the picks. Engine load
    is never seen: 3 engines, one server, picks 0, 1, 2, 0, 1 whatever the engines hold; at
    5 s the table resets and the scan starts again from engine 0 (engine 2 got one fewer)."""
    env, scheds, client = _lb_client(3, 1, engine_stats=False)
    scheds[0].num_waiting = 50
    assert [client._route() for _ in range(5)] == [0, 1, 2, 0, 1]
    env.run(until=4.999)
    assert client._route() == 2 and client._lb_counts == [[[2, 0], [2, 0], [2, 0]]]
    env.run(until=5.0)
    assert [client._route() for _ in range(2)] == [0, 1]
    assert client._lb_counts == [[[1, 0], [1, 0], [0, 0]]] and client._lb_next == 10.0
    env.run(until=12.5)  # (one publish or several since the last pick: the same zeros)
    assert client._route() == 0 and client._lb_next == 15.0


def test_dp_load_balancer_per_api_server():
    """``DPLBAsyncMPClient`` in each of ``client_count`` API servers: its own counts, the scan
    starting at ``num_engines · client_index // client_count``, and the local increment
    ``client_count``. 4 engines, 2 servers, alternating: server 0 from engine 0, server 1
    from engine 2; each next pick skips the engine it raised by 2 (score 8)."""
    env, scheds, client = _lb_client(4, 2)
    assert [client._route(s) for s in (0, 1, 0, 1, 0, 1)] == [0, 2, 1, 3, 2, 0]
    assert client._lb_counts == [[[2, 0], [2, 0], [2, 0], [0, 0]],
                                 [[2, 0], [0, 0], [2, 0], [2, 0]]]
    scheds[1].num_waiting = 5  # published at the next refresh, to both servers
    env.run(until=0.1)
    assert client._route(1) == 2 and client._route(0) == 0
    assert client._lb_counts[0][1] == client._lb_counts[1][1] == [5, 0]


@pytest.mark.parametrize("frontend", [True, False])
def test_dp_requests_route_through_their_api_servers_balancer(monkeypatch, frontend):
    """End to end, DP = 2 (so 2 API servers by default): each request is routed by the
    balancer of the API server that took it (the frontend's round robin; without the
    frontend model, the servers in turn), one count table per server."""
    from servesim.simulator.runner import run_experiment

    seen = []
    route = Client._route

    def spy(self, server=0):
        engine = route(self, server)
        seen.append((server, len(self._lb_counts), engine))
        return engine

    monkeypatch.setattr(Client, "_route", spy)
    res = run_experiment(load_config(None, [
        "parallel.data_parallel_size=2", "workload.num_prompts=40", "workload.request_rate=50",
        "workload.input_len=64", "workload.output_len=4", f"frontend.enable={str(frontend).lower()}"]))
    assert len(seen) == 40 and {n for _, n, _ in seen} == {2}
    assert [srv for srv, _, _ in seen].count(0) == [srv for srv, _, _ in seen].count(1) == 20
    # dense (Llama-3.1-8B), all within the first 5 s: each server alternates from its own
    # start engine (0 and 1), whatever the engines hold
    assert res.counters["sim_seconds"] < 5
    for srv in (0, 1):
        picks = [e for s, _, e in seen if s == srv]
        assert picks == [srv, 1 - srv] * 10


# -- TokenizeParams._token_len_check (API server) ---------------------------------------------

def _reject(prompt_len, output_len, ignore_eos, mml=4096):
    client = Client.__new__(Client)
    client.max_model_len, client.block_size, client.max_blocks = mml, 16, 10**6
    client.max_request_blocks = None
    spec = RequestSpec(arrival_s=0.0, prompt_len=prompt_len, output_len=output_len,
                       ignore_eos=ignore_eos)
    return client._reject_reason(Request(spec, 0, mml, 0.0))


def test_api_server_refuses_prompt_plus_max_tokens_over_max_model_len():
    """vLLM's message, whether or not ignore_eos is set; without ignore_eos max_tokens is
    what fits (at least 1), so a prompt of exactly max_model_len is refused, not stalled."""
    assert _reject(4000, 97, True) == (
        "This model's maximum context length is 4096 tokens. However, you requested 97 output "
        "tokens and your prompt contains 4000 input tokens, for a total of 4097 tokens. Please "
        "reduce the length of the input prompt or the number of requested output tokens.")
    assert _reject(4000, 96, True) == ""
    assert _reject(4096, 10, False).startswith(
        "This model's maximum context length is 4096 tokens. However, you requested 1 output "
        "tokens and your prompt contains 4096 input tokens, for a total of 4097 tokens.")
    assert _reject(4095, 10, False) == ""


# -- SlidingWindowManager (Mistral-7B v0.1: every layer attends over the last 4096 tokens) ------

def _sw_harness(**kw):
    h = Harness(block_size=2, fast_path=False, **kw)
    h.kv.set_sliding_window(8, h.sched.max_num_scheduled_tokens)
    return h


def test_sliding_window_frees_blocks_out_of_the_window():
    """``remove_skipped_blocks``: before each allocation, blocks wholly before the window of
    the next token ((computed − window + 1) // block_size of them) are freed, last first, and
    replaced by the null block. Window 8, blocks of 2: after 16 computed tokens, 4 blocks."""
    h = _sw_harness(num_blocks=100, max_num_batched_tokens=64)
    a = h.add("A", 16, 3)
    h.step()
    assert [b.block_id for b in a.blocks] == list(range(1, 9))
    free_before = h.kv.get_num_free_blocks()
    h.step()  # decode: computed 16 → 4 blocks out of the window, 1 new block
    assert [b.is_null for b in a.blocks] == [True] * 4 + [False] * 5
    assert h.kv.get_num_free_blocks() == free_before + 4 - 1
    tail = [b.block_id for b in h.kv.block_pool.free_block_queue.get_all_free_blocks()[-4:]]
    assert tail == [4, 3, 2, 1]  # freed in reverse order: the window's edge is evicted last
    h.run()
    h.kv.check_invariants()
    assert h.kv.get_num_free_blocks() == 99


def test_sliding_window_prefix_hit_needs_a_window_of_contiguous_blocks():
    """``SlidingWindowManager.find_longest_cache_hit``: scanning from the right, the hit ends
    at the first run of ceil((8 − 1) / 2) = 4 cached blocks; blocks before the run are out of
    the window (null). B shares A's first 12 tokens: blocks 2..5 are the run → 12 hit tokens,
    the first 2 blocks null (A freed them, but they are not needed)."""
    h = _sw_harness(num_blocks=100, max_num_batched_tokens=64)
    prefix = list(range(12))
    h.add("A", 16, 2, token_ids=prefix + [100, 101, 102, 103])
    assert h.run() == [{"A": 16}, {"A": 1}]
    b = h.add("B", 16, 2, token_ids=prefix + [200, 201, 202, 203])
    assert h.step().as_dict() == {"B": 4}
    assert b.num_cached_tokens == 12
    assert [x.is_null for x in b.blocks] == [True, True] + [False] * 6
    # Without a full window of cached blocks, only a run from the start counts: C shares 6
    # tokens (3 blocks < 4) of a prefix nobody else holds at the start → hit from block 0.
    h.run()
    c = h.add("C", 16, 2, token_ids=prefix[:6] + list(range(300, 310)))
    h.step()
    assert c.num_cached_tokens == 6


def test_eagle_prefix_hits_drop_their_last_matched_block():
    """``find_longest_cache_hit(use_eagle=True)`` (EAGLE, EAGLE-3, MTP): the hit drops its
    last matched block. Full attention, blocks of 16: B shares A's 64-token prefix (4
    blocks) → 48 hit tokens, not 64. Sliding window 8 on blocks of 2: the run needed is
    ceil(7 / 2) + 1 = 5 blocks, then the last is dropped: B shares 12 tokens (blocks 0-5),
    the run of 5 ends at block 5 → 5 blocks from block 1, minus the last → 10 tokens."""
    prefix = list(range(64))
    for eagle, want in ((False, 64), (True, 48)):
        h = Harness(fast_path=False)
        h.kv.use_eagle = eagle
        h.add("A", 80, 1, token_ids=prefix + list(range(100, 116)))
        h.run()
        b = h.add("B", 80, 1, token_ids=prefix + list(range(200, 216)))
        h.step()
        assert b.num_cached_tokens == want
    for eagle, want in ((False, 12), (True, 10)):
        h = _sw_harness(num_blocks=100, max_num_batched_tokens=64)
        h.kv.use_eagle = eagle
        h.add("A", 16, 2, token_ids=list(range(12)) + [100, 101, 102, 103])
        h.run()
        b = h.add("B", 16, 2, token_ids=list(range(12)) + [200, 201, 202, 203])
        h.step()
        assert b.num_cached_tokens == want
    # the scheduler sets the rule from the method (vLLM SpeculativeConfig.use_eagle)
    for method, eagle in (("eagle", True), ("eagle3", True), ("mtp", True), ("ngram", False),
                          ("draft_model", False), ("medusa", False)):
        h = Harness(fast_path=False)
        h.sched.enable_spec_decode(types.SimpleNamespace(method=method))
        assert h.kv.use_eagle is eagle


def test_sliding_window_admission_reserves_at_most_the_window():
    """``max_admission_blocks_per_request`` = ceil(min(8 − 1 + 16, 4096) / 2) + 1 = 13: a
    40-token prompt (20 blocks) is admitted with 13 free blocks, which it never exceeds."""
    h = _sw_harness(num_blocks=14, max_num_batched_tokens=16)
    assert h.kv.admission_cap == 13
    a = h.add("A", 40, 4)
    steps = h.run()
    assert steps[0] == {"A": 16} and a.num_output_tokens == 4
    assert h.sched.num_preemptions == 0


def test_sliding_window_memory_plan_blocks_per_request():
    from servesim.costmodels import plan_memory

    c = _resolved("model.name=mistral-7b-v0.1", "hardware.name=a100-sxm4-80gb")
    plan = plan_memory(c)
    # ceil(min(4096 − 1 + 2048, 32768) / 16) + 1
    assert plan.blocks_per_request == -(-(4096 - 1 + 2048) // 16) + 1 == 385


def test_cuda_graph_size_checks_as_vllm():
    """``VllmConfig._set_cudagraph_sizes`` with graphs in use: a maximum of 0 and an empty
    size list are refused with vLLM's messages; the max/list consistency is checked before
    the spec-decode rounding (EAGLE k = 3: [1, 2, 3, 5, 6] with max 6 is consistent, then
    rounds to multiples of 4 within 6: [4])."""
    from servesim.simulator.errors import ConfigError

    with pytest.raises(ConfigError, match="Maximum cudagraph size should be greater than or "
                       "equal to 1 when using cuda graph"):
        _resolved("compilation.max_cudagraph_capture_size=0")
    with pytest.raises(ConfigError, match="cudagraph_capture_sizes should contain at least one "
                       "element when using cuda graph"):
        _resolved("compilation.cudagraph_capture_sizes=[]")
    eagle = Path(__file__).resolve().parents[2] / "configs" / "llama8b_h100_eagle.yaml"
    comp = resolve_config(load_config(eagle, ["compilation.cudagraph_capture_sizes=[1,2,3,5,6]",
                                              "compilation.max_cudagraph_capture_size=6"])
                          ).compilation
    assert (comp.cudagraph_capture_sizes, comp.max_cudagraph_capture_size) == ([4], 4)
    with pytest.raises(ConfigError, match=r"\(5\) should be consistent with the max value of "
                       r"cudagraph_capture_sizes \(6\)"):
        resolve_config(load_config(eagle, ["compilation.cudagraph_capture_sizes=[1,2,3,5,6]",
                                           "compilation.max_cudagraph_capture_size=5"]))


# -- EngineCoreProc.run_busy_loop: new requests taken in between steps --------------------------

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_are_taken_in_between_steps(async_scheduling):
    """vLLM's engine loop drains its input queue (``_process_input_queue``) between steps: a
    request that reaches the engine core during a step is QUEUED (stamped and counted as
    waiting) when that step (async: the batch being waited for) ends; one that reaches an idle
    engine, at once. Steps of 1 s: A at 0 (idle: queued 0), B at 0.4 (during A's prefill
    step [0, 1]: queued 1, first scheduled at 1 either way), C at 5 after everything ended
    (idle: queued 5). The waiting gauge of the step ending at 1 leaves B out."""
    from servesim.simulator.recorder import Recorder

    h = Harness(async_scheduling=async_scheduling)
    env = simpy.Environment()
    rec = Recorder()
    rep = Replica(env, h.sched, lambda shape: 1.0, rec, h.finished.append,
                  max_concurrent_batches=1, async_scheduling=async_scheduling)
    reqs = {}

    def arrive():
        for t, rid in ((0.0, "A"), (0.4, "B"), (5.0, "C")):
            yield env.timeout(t - env.now)
            reqs[rid] = h.make(rid, 8, 2)
            rep.add_request(reqs[rid])

    env.process(arrive())
    env.run()
    assert [reqs[r].queued_time for r in "ABC"] == [0.0, 1.0, 5.0]
    assert [reqs[r].first_scheduled_time for r in "ABC"] == [0.0, 1.0, 5.0]
    steps = rec.step
    i = list(steps["time_s"]).index(1.0)
    assert steps["waiting"][i] == 0  # (B is in the scheduler's queue, not yet in vLLM's)
    assert h.sched.num_waiting == 0 and len(h.finished) == 3


def test_num_cached_tokens_are_the_last_admission_before_the_first_output():
    """vLLM's prefill stats (``request.prefill_stats.set`` at every admission that looks the
    prefix up, taken by the request's first output): a request preempted before its first
    token reports the hits of its re-admission; one preempted after it keeps the first. 13
    blocks of 4 tokens, a 4-token step budget, B decoding: A (40 tokens) is preempted
    mid-prefill and comes back with its first block cached → 4; A of 32 tokens is preempted
    after its first token and comes back with 4 hits → still 0."""
    for plen, want_first_out, want in ((40, 0, 4), (32, 1, 0)):
        h = Harness(num_blocks=13, block_size=4, max_num_batched_tokens=4, max_num_seqs=4,
                    fast_path=False, max_model_len=128)
        admissions = []
        admit = h.sched._admit

        def spy(out, n, num_computed, admit=admit, admissions=admissions):
            r = admit(out, n, num_computed)
            admissions.append((r.request_id, num_computed, r.num_output_tokens))
            return r

        h.sched._admit = spy
        h.add("B", 4, 40)
        h.step()
        a = h.add("A", plen, 2)
        h.run()
        assert [x[1:] for x in admissions if x[0] == "A"] == [(0, 0), (4, want_first_out)]
        assert a.num_preemptions == 1 and a.num_cached_tokens == want
