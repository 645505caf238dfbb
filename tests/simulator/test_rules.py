"""One worked trace per vLLM 0.22.1 scheduling rule, schedules computed by hand.

Each test names the vLLM function it follows (``/tmp/src/vllm-0.22.1``, ``vllm/v1/...``),
derives the expected schedule step by step in comments, and checks that both the independent
reference (``tests/reference/vllm_ref.py``) and servesim's real engine (``Replica``, a 1 s
step, fast path and exact loop) produce exactly it. Notation: ``c`` = num_computed_tokens,
``ph`` = num_output_placeholders, ``oN`` = the N-th output token, ``free`` = free blocks
(the null block excluded), blocks written as their token contents.

The last tests pin real differences between vLLM and servesim found by the differential test
(``test_differential.py``): strict xfails that start failing (XPASS) once servesim is fixed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from harness import Harness
from servesim_driver import run_servesim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference.ref_request import BlockHasher, Request, RequestSpec
from reference.ref_scheduler import Config, Scheduler
from reference.vllm_ref import simulate

BOTH = pytest.mark.parametrize("fast_path", [True, False])


def req(rid, t, prompt, max_tokens, *, eos_after=None, priority=0, mml=128):
    """A request; ``prompt`` is a tuple of token ids or a length (unique tokens). With
    ``eos_after`` it stops on EOS and gets the API default max_tokens = mml − prompt."""
    if isinstance(prompt, int):
        prompt = tuple(10**6 * (1 + sum(map(ord, rid))) + j for j in range(prompt))
    if eos_after is not None:
        max_tokens = mml - len(prompt)
    return RequestSpec(rid, t, tuple(prompt), max_tokens, eos_after=eos_after,
                       priority=priority)


def cfg(**kw):
    base = {"num_gpu_blocks": 1000, "block_size": 16, "max_num_seqs": 256,
            "max_num_batched_tokens": 2048, "max_model_len": 128}
    base.update(kw)
    return Config(**base)


def trace(result, with_time=False, with_preempted=False):
    out = []
    for b in result.batches:
        item = [b.num_scheduled_tokens]
        if with_time:
            item.insert(0, b.time_scheduled)
        if with_preempted:
            item.append(b.preempted)
        out.append(tuple(item) if len(item) > 1 else item[0])
    return out


def check(config, specs, expected, *, fast_path=True, **trace_kw):
    """The reference and servesim both give ``expected``; returns (reference, servesim)."""
    ref = simulate(config, specs)
    assert trace(ref, **trace_kw) == expected, "the reference disagrees with the hand trace"
    real = run_servesim(config, specs, fast_path=fast_path)
    assert trace(real, **trace_kw) == expected
    assert real.requests == ref.requests
    return ref, real


# -- Scheduler.schedule ---------------------------------------------------------------------------

@BOTH
def test_clamp_order_threshold_then_budget(fast_path):
    """``Scheduler.schedule``: a row gets ``num_tokens − c``, then
    ``min(long_prefill_token_threshold)``, then ``min(token_budget)``, then
    ``min(max_model_len − 1 − c)``; running requests first, then waiting ones (same clamps,
    ``max_model_len`` aside). Budget 6, threshold 4; A = 10 tokens, B = 5, one output each."""
    # step 0: waiting A: 10 → threshold 4 → budget 6: 4 (budget 2 left);
    #         waiting B: 5 → threshold 4 → budget 2: 2.
    # step 1: running A: 6 → 4 → 4 (budget 2 left); running B: 3 → 3 → budget 2: 2.
    # step 2: A: 2 (c = 10: samples o1, done); B: 1 (samples o1, done).
    check(cfg(max_num_batched_tokens=6, long_prefill_token_threshold=4),
          [req("A", 0, 10, 1), req("B", 0, 5, 1)],
          [{"A": 4, "B": 2}, {"A": 4, "B": 2}, {"A": 2, "B": 1}], fast_path=fast_path)


def test_clamp_max_model_len_minus_one():
    """``Scheduler.schedule`` running loop: ``min(num_new_tokens, max_model_len − 1 − c)``.
    A prompt of exactly max_model_len (8) tokens — the API server refuses it
    (``InputProcessor._validate_model_input``: prompt + at least one output must fit), but the
    scheduler alone, budget 3, gives:"""
    # schedule 1 (waiting loop, no max_model_len clamp): 8 → budget 3: 3.   c = 3
    # schedule 2: 5 → budget 3 → min(3, 8 − 1 − 3 = 4): 3.                  c = 6
    # schedule 3: 2 → min(2, 8 − 1 − 6 = 1): 1.                             c = 7
    # schedule 4+: min(1, 8 − 1 − 7 = 0) = 0: skipped, for ever (vLLM too: hence the refusal).
    expected = [{"A": 3}, {"A": 3}, {"A": 1}, {}, {}]
    config = cfg(max_model_len=8, max_num_batched_tokens=3, block_size=4)
    sched = Scheduler(config)
    sched.add_request(Request(req("A", 0, 8, 1, mml=8), BlockHasher(4)))
    got = []
    for _ in range(5):
        out = sched.schedule()
        sched.update_from_output(out)
        got.append(out.num_scheduled_tokens)
    assert got == expected
    h = Harness(max_model_len=8, max_num_batched_tokens=3, block_size=4)
    h.add("A", 8, 1)
    assert [h.step().as_dict() for _ in range(5)] == expected


@BOTH
def test_max_num_seqs_caps_running(fast_path):
    """``Scheduler.schedule`` waiting loop: ``if len(self.running) == max_num_running_reqs:
    break``. max_num_seqs 2; A, B, C at t=0 (4 tokens, 2 outputs each)."""
    # step 0: A: 4, B: 4; C: running is full.  step 1: A: 1, B: 1 (both done at t=2).
    # step 2: C: 4.  step 3: C: 1.
    check(cfg(max_num_seqs=2),
          [req("A", 0, 4, 2), req("B", 0, 4, 2), req("C", 0, 4, 2)],
          [{"A": 4, "B": 4}, {"A": 1, "B": 1}, {"C": 4}, {"C": 1}], fast_path=fast_path)


@BOTH
def test_chunked_prefill_off_head_of_line_break(fast_path):
    """``Scheduler.schedule`` waiting loop: ``if not enable_chunked_prefill and num_new_tokens
    > token_budget: break`` — the head blocks the queue, later requests that would fit wait.
    Budget 32; A = 20 tokens (3 outputs), B = 20, C = 4 (1 output)."""
    # step 0: A: 20 (budget 12 left); B: 20 > 12: break (C: 4 would fit, but waits).
    # step 1: A: 1 (31 left); B: 20 (11 left); C: 4.
    # step 2: A: 1, B: 1.  step 3: B: 1.
    check(cfg(max_num_batched_tokens=32, enable_chunked_prefill=False),
          [req("A", 0, 20, 3), req("B", 0, 20, 3), req("C", 0, 4, 1)],
          [{"A": 20}, {"A": 1, "B": 20, "C": 4}, {"A": 1, "B": 1}, {"B": 1}],
          fast_path=fast_path)


# -- KVCacheManager ---------------------------------------------------------------------------------

@BOTH
def test_full_sequence_must_fit_for_a_resumed_request(fast_path):
    """``KVCacheManager.allocate_slots(full_sequence_must_fit=scheduler_reserve_full_isl)``:
    a resumed request is admitted only when the free blocks cover its whole sequence so far
    (prompt + outputs: ``min(request.num_tokens, max_model_len)``), not only its next chunk.
    Block size 2, 3 usable blocks, budget 2, no prefix caching. A: 1 token, 6 outputs;
    B: 2 tokens, 4 outputs."""
    # t=0: A: 1 (1 block; budget 1 left). B: whole prompt 1 block ≤ 2 free: chunk 1.
    #      free 1. A → o1.
    # t=1: A: c 1→2 (same block) → o2. B: 1 (c = 2 = num_tokens) → o1.
    # t=2: A: c 2→3 takes the last block → o3. B: c 2→3 needs one: none: running.pop() = B
    #      itself: preempted (its block freed), step over: {A:1}, preempted [B]. free 1.
    # t=3: A: c 3→4 → o4. Waiting B = (b1 b2 o1), c = 0: chunk 1 would need 1 block (1 free),
    #      but the whole 3 tokens need 2: refused.
    # t=4: A: c 4→5 takes the last block → o5. B refused (2 > 0).
    # t=5: A: c 5→6 → o6, done: its 3 blocks are freed after the step.
    # t=6: B: 3 → budget 2: 2 (whole sequence 2 blocks ≤ 3).  t=7: B: 1 → o2.
    # t=8, t=9: B: 1 → o3, o4.
    ref, _ = check(cfg(num_gpu_blocks=4, block_size=2, max_num_batched_tokens=2,
                       enable_prefix_caching=False),
                   [req("A", 0, 1, 6), req("B", 0, 2, 4)],
                   [({"A": 1, "B": 1}, []), ({"A": 1, "B": 1}, []), ({"A": 1}, ["B"]),
                    ({"A": 1}, []), ({"A": 1}, []), ({"A": 1}, []), ({"B": 2}, []),
                    ({"B": 1}, []), ({"B": 1}, []), ({"B": 1}, [])],
                   fast_path=fast_path, with_preempted=True)
    assert ref.requests["B"].num_preemptions == 1
    # Without the gate (vLLM's scheduler_reserve_full_isl=False) B comes back in step 3 on
    # its first chunk alone.
    no_gate = simulate(cfg(num_gpu_blocks=4, block_size=2, max_num_batched_tokens=2,
                           enable_prefix_caching=False, scheduler_reserve_full_isl=False),
                       [req("A", 0, 1, 6), req("B", 0, 2, 4)])
    assert trace(no_gate)[3] == {"A": 1, "B": 1}


@BOTH
def test_prefix_hit_cap_and_full_blocks_only(fast_path):
    """``KVCacheManager.get_computed_blocks``: hits are whole cached blocks along the hash
    chain, capped at ``num_tokens − 1`` tokens (the last token is recomputed for its logits),
    so ``(num_tokens − 1) // block_size`` blocks at most. Block size 4; T = 8 tokens."""
    t = tuple(range(100, 109))
    # t=0 A = T[:8]: no hit: 8. Blocks [T0-3] [T4-7] cached at allocation. A done at t=1.
    # t=1 B = T[:8] (same prompt): cap 7 → 1 block: 4 hits, 4 scheduled.
    # t=2 C = T[:9]: cap 8 → 2 blocks: 8 hits, 1 scheduled.
    # t=3 D = T[:6]: cap 5 → 1 block: 4 hits, 2 scheduled (the partial block never hits).
    check(cfg(block_size=4),
          [req("A", 0, t[:8], 1), req("B", 0.5, t[:8], 1), req("C", 1.5, t[:9], 1),
           req("D", 2.5, t[:6], 1)],
          [(0.0, {"A": 8}), (1.0, {"B": 4}), (2.0, {"C": 1}), (3.0, {"D": 2})],
          fast_path=fast_path, with_time=True)


@BOTH
def test_eager_caching_shares_within_one_step(fast_path):
    """``KVCacheManager.allocate_slots`` caches the newly full blocks at allocation
    (``cache_blocks(request, min(computed + new, num_tokens))``), before their KV is
    computed: a request admitted later in the same ``schedule()`` call already hits them.
    Block size 4; A and B both = the same 8 tokens, at t=0."""
    # waiting A: no hit: 8 (blocks [0-3] [4-7] cached now). waiting B: hit cap 7 → 1 block
    # (held by A, not evictable): 4 scheduled.
    t = tuple(range(200, 208))
    check(cfg(block_size=4), [req("A", 0, t, 1), req("B", 0, t, 1)], [{"A": 8, "B": 4}],
          fast_path=fast_path)


@BOTH
def test_free_queue_lru_and_reverse_order_free(fast_path):
    """``FreeKVCacheBlockQueue`` (LRU: allocation pops the front, freed blocks go to the
    back), ``KVCacheManager.free`` → ``BlockPool.free_blocks(reversed(blocks))`` (a request's
    tail block before its head) and ``update_from_output`` (requests finishing in one step
    are freed in the batch's row order). Block size 2, 4 usable blocks (ids 1–4).
    A = (1 2 3 4), B = (5 6 7 8), one output each."""
    # t=0: {A:4, B:4}: A gets blocks 1 [1 2], 2 [3 4]; B gets 3 [5 6], 4 [7 8]. Both done at
    #      t=1, freed A then B, each tail first: free queue [2, 1, 4, 3] (hashes kept).
    # t=1: C = (9 10): 1 block from the front: block 2 — A's tail [3 4] is evicted.
    #      C done at t=2: free queue [1, 4, 3, 2].
    # t=2: D = (1 2 3 4 5): hit chain [1 2] → block 1 ✓, [3 4] ✗: 2 hits, 3 scheduled
    #      (needs 3 blocks: block 1 revived + 2 new from the front: 4 and 3 — B's blocks go).
    #      E = (5 6 7 8 9): no hit left (B's blocks were just evicted): 3 blocks > 1 free.
    # t=3: D done: E: 5.
    check(cfg(num_gpu_blocks=5, block_size=2),
          [req("A", 0, (1, 2, 3, 4), 1), req("B", 0, (5, 6, 7, 8), 1),
           req("C", 0.5, (9, 10), 1), req("D", 1.5, (1, 2, 3, 4, 5), 1),
           req("E", 1.5, (5, 6, 7, 8, 9), 1)],
          [{"A": 4, "B": 4}, {"C": 2}, {"D": 3}, {"E": 5}], fast_path=fast_path)


@BOTH
def test_requests_finishing_together_are_freed_in_row_order(fast_path):
    """``Scheduler.update_from_output`` frees stopped requests in the batch's row order (the
    running order), which fixes their blocks' LRU order. Here A and B finish in the same
    step, B having joined servesim's decode group first (A's prompt took two chunks):
    freeing must still go A then B. Block size 2, 6 usable blocks, threshold 3, admission on
    the first chunk (``scheduler_reserve_full_isl=False``)."""
    # t=0: A: 5 → threshold 3: 3 (blocks [1 2] [3 _]); B: 1 → o1 (B joins the decode group).
    # t=1: A: 2 → c=5 (3rd block [5 _]) → o1; B: 1 → o2.
    # t=2: A: 1 → o2 ([5 o1] full); B: 1 (2nd block) → o3.
    # t=3: A: 1 (4th block [o2 _]) → o3, done; B: 1 → o4, done. Freed A then B, each tail
    #      first: free queue [A4 A3 A2 A1 B2 B1] (no block was left unused).
    # t=4.5 C = 8 tokens: 3 (takes A4, A3).  t=5.5: 3 (A2: [3 4] evicted).
    # t=6.5: C: 2 (A1: [1 2] evicted). D = (1 2 3 4 5 6), arrived at 6.4: no hit left:
    #      6 → threshold 3: 3 (2 blocks: B2, B1).  t=7.5: D: 3 → o1.
    # Freed B then A instead, C would have taken B2 B1 A4 A3 and D would hit [1 2] [3 4].
    check(cfg(num_gpu_blocks=7, block_size=2, max_num_batched_tokens=16,
              long_prefill_token_threshold=3, scheduler_reserve_full_isl=False),
          [req("A", 0, (1, 2, 3, 4, 5), 3), req("B", 0, (100,), 4),
           req("C", 4.5, tuple(range(200, 208)), 1), req("D", 6.4, (1, 2, 3, 4, 5, 6), 1)],
          [(0.0, {"A": 3, "B": 1}), (1.0, {"A": 2, "B": 1}), (2.0, {"A": 1, "B": 1}),
           (3.0, {"A": 1, "B": 1}), (4.5, {"C": 3}), (5.5, {"C": 3}),
           (6.5, {"C": 2, "D": 3}), (7.5, {"D": 3})],
          fast_path=fast_path, with_time=True)


@BOTH
def test_fcfs_preemption_recomputes_and_hits_own_blocks(fast_path):
    """``Scheduler.schedule`` allocate-or-preempt (FCFS victim ``self.running.pop()``, the
    most recently admitted) and ``_preempt_request`` (free its blocks, ``c = 0``, outputs
    kept, back to the FRONT of waiting); no waiting admission in a step that preempted;
    resumed, it re-prefills prompt + outputs, hitting its own blocks that are still cached.
    Block size 2, 3 usable blocks. A: 1 token, 4 outputs; B: (7 8), 4 outputs; C (1 token,
    1 output) arrives at t=1.5."""
    # t=0: {A:1, B:2}: A 1 block; B 1 block [7 8] (full: cached). free 1. A o1, B o1.
    # t=1: A: c 1→2, same block. B: c 2→3 takes the last block. {A:1, B:1} → o2, o2.
    # t=2: A: c 2→3 needs a block, none: victim = running.pop() = B (not A): B's blocks go
    #      back tail first ([o1] then [7 8]); A takes the front one ([o1]'s block): {A:1},
    #      preempted [B]; waiting = [B, C]: no admission this step. A → o3.
    # t=3: A: 1 → o4, done. Waiting head B = (7 8 o1 o2): hit cap 3 → block [7 8] still
    #      cached: 2 hits; whole sequence 2 blocks − 1 hit + 1 revived = 2 > 1 free: refused,
    #      and C behind it waits too (head-of-line).
    # t=4: A's 2 blocks are free: B: 2 scheduled (2 hits); C: 1.  t=5: B: 1 → o4.
    ref, _ = check(cfg(num_gpu_blocks=4, block_size=2),
                   [req("A", 0, 1, 4), req("B", 0, (7, 8), 4), req("C", 1.5, 1, 1)],
                   [({"A": 1, "B": 2}, []), ({"A": 1, "B": 1}, []), ({"A": 1}, ["B"]),
                    ({"A": 1}, []), ({"B": 2, "C": 1}, []), ({"B": 1}, [])],
                   fast_path=fast_path, with_preempted=True)
    assert ref.requests["B"].num_output_tokens == 4
    assert ref.requests["B"].num_preemptions == 1


@BOTH
def test_self_preemption_leaves_an_empty_step_then_schedules_again(fast_path):
    """``Scheduler.schedule``, PRIORITY: the victim ``max(running, key=(priority,
    arrival_time))`` can be the request being scheduled; then the running loop stops and the
    step is empty, and ``EngineCore`` steps again at once (vLLM does not wait for an
    arrival). Block size 2, 2 usable blocks, budget 2. X: priority 2, 1 token, 3 outputs;
    Y: priority 1, 1 token, 3 outputs, arrives at t=0.5."""
    # t=0: {X:1} → o1.  t=1: X: 1 (c 1→2, same block); Y admitted: 1 → {X:1, Y:1}. free 0.
    # t=2: X: c 2→3 needs a block: victim = max((2, 0), (1, 0.5)) = X itself: preempted,
    #      loop ends: empty step. Again at t=2: Y: 1 (c 1→2); X waiting (x o1 o2): hit
    #      [x o1] (cached, free) 2 tokens, whole sequence 2 blocks − 1 + 1 = 2 > 1 free.
    # t=3: Y: c 2→3 takes the free block (X's cached one: evicted) → o3, done.
    # t=4: X: no hit any more: 3 → budget 2.  t=5: X: 1 → o3.
    ref, _ = check(cfg(num_gpu_blocks=3, block_size=2, max_num_batched_tokens=2,
                       policy="priority"),
                   [req("X", 0, 1, 3, priority=2), req("Y", 0.5, 1, 3, priority=1)],
                   [(0.0, {"X": 1}), (1.0, {"X": 1, "Y": 1}), (2.0, {"Y": 1}),
                    (3.0, {"Y": 1}), (4.0, {"X": 2}), (5.0, {"X": 1})],
                   fast_path=fast_path, with_time=True)
    assert ref.requests["X"].num_preemptions == 1


@BOTH
def test_priority_victim_scheduled_this_step_returns_its_budget(fast_path):
    """``Scheduler.schedule``, PRIORITY: a victim already scheduled in this step is taken out
    of it (``scheduled_running_reqs.remove``, its tokens back to the budget, ``req_index −=
    1``). Block size 2, 3 usable blocks. Y: priority 1, (y1 y2), 5 outputs; Z: priority 0,
    2 tokens, 5 outputs, arrives at t=0.5 (running order Y, Z)."""
    # t=0: {Y:2}: block [y1 y2] (cached) → o1.
    # t=1: Y: c 2→3 takes a 2nd block; Z: whole prompt 1 block ≤ 1 free: 2 → o1. free 0.
    # t=2: Y: c 3→4, no new block: scheduled. Z: c 2→3 needs a block: none: victim =
    #      max((1, 0), (0, 0.5)) = Y, already scheduled: taken out, preempted (frees its 2
    #      blocks, tail first); Z takes Y's tail block: {Z:1}, preempted [Y].
    # t=3: Z: c 3→4 → o3. Y = (y1 y2 o1 o2): hit [y1 y2] (still cached, free): 2 tokens,
    #      whole sequence 2 blocks − 1 + 1 revived = 2 > 1 free: refused.
    # t=4: Z: c 4→5 takes the free block (Y's [y1 y2]: evicted) → o4.  t=5: Z → o5, done.
    # t=6: Y: no hit: 4 → o3.  t=7, t=8: Y: 1 → o4, o5.
    ref, _ = check(cfg(num_gpu_blocks=4, block_size=2, policy="priority"),
                   [req("Y", 0, (1, 2), 5, priority=1), req("Z", 0.5, 2, 5)],
                   [({"Y": 2}, []), ({"Y": 1, "Z": 2}, []), ({"Z": 1}, ["Y"]), ({"Z": 1}, []),
                    ({"Z": 1}, []), ({"Z": 1}, []), ({"Y": 4}, []), ({"Y": 1}, []),
                    ({"Y": 1}, [])],
                   fast_path=fast_path, with_preempted=True)
    assert ref.requests["Y"].num_preemptions == 1


# -- AsyncScheduler / EngineCore.step_with_batch_queue ---------------------------------------------

@BOTH
def test_async_placeholders_and_max_tokens_skip(fast_path):
    """``AsyncScheduler._update_after_schedule``: a row that completes the known sequence
    gets an output placeholder (``ph += 1``), so the next ``schedule()`` — made while the
    batch is in flight — schedules the decode again (``num_tokens + ph − c``); the running
    loop skips a request whose output in flight reaches max_tokens (``c + 2 − ph ≥ prompt +
    max_tokens``). Batch queue 2 deep (``step_with_batch_queue``). A: 4 tokens, 3 outputs."""
    # S1 t=0: {A:4}: c=4, ph=1.  Queue [S1] has room: return, schedule again at once.
    # S2 t=0: 4+2−1 = 5 < 7: A: 4+1−4 = 1: c=5, ph=2. Queue full: wait for S1 (t=1): o1, ph=1.
    # S3 t=1: 5+2−1 = 6 < 7: {A:1}: c=6, ph=2. Wait for S2 (t=2): o2, ph=1.
    # S4 t=2: 6+2−1 = 7 ≥ 7: skipped — an empty batch. Wait for S3 (t=3): o3, done at t=3.
    ref, _ = check(cfg(async_scheduling=True), [req("A", 0, 4, 3)],
                   [(0.0, {"A": 4}), (0.0, {"A": 1}), (1.0, {"A": 1})],
                   fast_path=fast_path, with_time=True)
    assert ref.requests["A"].finish_time == 3.0


@BOTH
def test_async_eos_is_learned_one_batch_late(fast_path):
    """``AsyncScheduler`` + ``update_from_output``: an EOS stop is known only when its batch
    returns, so the request has one more row in flight, whose token is dropped (the request
    is finished when that batch returns). A: 4 tokens, EOS as its 2nd output."""
    # S1 t=0 {A:4} ph=1; S2 t=0 {A:1} ph=2; S1 back t=1: o1. S3 t=1 {A:1} (max_tokens is
    # 124: no skip). S2 back t=2: o2 = EOS: finished, freed. S4 t=2: nothing. S3 back t=3:
    # A is finished: its row is ignored.
    ref, _ = check(cfg(async_scheduling=True), [req("A", 0, 4, 0, eos_after=2)],
                   [(0.0, {"A": 4}), (0.0, {"A": 1}), (1.0, {"A": 1})],
                   fast_path=fast_path, with_time=True)
    assert (ref.requests["A"].finish_time, ref.requests["A"].finish_reason) == (2.0, "stop")


def test_pipeline_parallel_sync_and_async():
    """``EngineCore.step_with_batch_queue`` with pp = 2 (``max_concurrent_batches``), each
    batch 1 s of latency holding a stage for 0.5 s; ``_update_after_schedule`` advances
    ``c`` at schedule time. A: 2 tokens, 3 outputs."""
    # Sync (plain Scheduler): S1 t=0 {A:2}, c=2. Schedule again at t=0: num_tokens − c = 0:
    # nothing (an in-flight decode is not rescheduled); wait for S1 (t=1): o1. t=1: {A:1};
    # again nothing; S2 back at t=2: o2. t=2: {A:1}; back at t=3: o3, done.
    ref, _ = check(cfg(pipeline_parallel_size=2), [req("A", 0, 2, 3)],
                   [(0.0, {"A": 2}), (1.0, {"A": 1}), (2.0, {"A": 1})],
                   fast_path=False, with_time=True)
    assert ref.requests["A"].finish_time == 3.0
    # Async (AsyncScheduler): S1 t=0 {A:2}: c=2, ph=1. S2 t=0: 2+2−1 = 3 < 5: {A:1}: c=3,
    # ph=2 (starts at 0.5, back at 1.5); queue full: S1 back at 1: o1, ph=1.
    # S3 t=1: 3+2−1 = 4 < 5: {A:1}: c=4, ph=2 (starts at 1, back at 2). S2 back at 1.5: o2.
    # t=1.5: 4+2−1 = 5 ≥ 5: skipped (empty). S3 back at 2: o3, done.
    ref, _ = check(cfg(pipeline_parallel_size=2, async_scheduling=True), [req("A", 0, 2, 3)],
                   [(0.0, {"A": 2}), (0.0, {"A": 1}), (1.0, {"A": 1})],
                   fast_path=False, with_time=True)
    assert ref.requests["A"].finish_time == 2.0


# -- Known differences (found by test_differential.py; reported) ---------------------------------

VICTIM_INDEX_SPECS = [req("X", 0, 1, 3, priority=1), req("Y", 0.5, 2, 5), req("Z", 0.5, 1, 5)]
VICTIM_INDEX_CFG = cfg(num_gpu_blocks=5, block_size=2, policy="priority", async_scheduling=True,
                       enable_prefix_caching=False)
# S1, S2 at t=0: {X:1}, {X:1}: X c=2, ph=2; X back at 1: o1.
# S3 t=1: X: 2+2−1 = 3 < 4: X: 1 (c=3: a 2nd block); Y: 2 (1 block), Z: 1 (1 block). free 0.
# S4 t=2 (S2 back: X o2, ph=1): running [X, Y, Z]. X: 3+2−1 = 4 ≥ 4: skipped (its last
#   output is in flight). Y: c 2→3 needs a block, none: victim max(...) = X (priority 1),
#   which sits before Y but was not scheduled this step: vLLM leaves req_index alone, Y is
#   scheduled, req_index moves past Z: {Y:1}, preempted [X]. Z waits a step.
VICTIM_INDEX_TRACE = [(0.0, {"X": 1}, []), (0.0, {"X": 1}, []),
                      (1.0, {"X": 1, "Y": 2, "Z": 1}, []), (2.0, {"Y": 1}, ["X"])]


def test_reference_priority_victim_before_index_skips_the_next_request():
    """The vLLM trace of the next test, on the reference (``Scheduler.schedule``: the PRIORITY
    branch moves ``req_index`` back only for a victim in ``scheduled_running_reqs``)."""
    ref = simulate(VICTIM_INDEX_CFG, VICTIM_INDEX_SPECS)
    assert trace(ref, with_time=True, with_preempted=True)[:4] == VICTIM_INDEX_TRACE


def test_priority_victim_before_index_skips_the_next_request():
    real = run_servesim(VICTIM_INDEX_CFG, VICTIM_INDEX_SPECS, fast_path=False)
    assert trace(real, with_time=True, with_preempted=True)[:4] == VICTIM_INDEX_TRACE


INFLIGHT_SPECS = [req("A", 0, (1000,), 3), req("B", 0, (2000,), 3)]
INFLIGHT_CFG = cfg(num_gpu_blocks=4, block_size=2, async_scheduling=True)
# S1, S2 at t=0: {A:1, B:1} twice (c=2, ph=2 each, one block each, free 1); S1 back at 1: o1.
# S3 t=1: A: c 2→3 takes the last block; B: needs one: running.pop() = B: preempted, {A:1}.
# S2 back at 2: B (preempted) still gets o2 — but AsyncScheduler caches blocks only for
#   RUNNING requests, and allocate_slots cached only up to num_tokens (o1 was a placeholder
#   then): B's block [2000 o1] was never cached.
# S4 t=2: A: 3+2−1 = 4 ≥ 4: skipped; B (2000 o1 o2): whole sequence 2 blocks > 1 free.
# S3 back at 3: A o3, done. S5 t=3: B: no hit: 3.
INFLIGHT_TRACE = [(0.0, {"A": 1, "B": 1}), (0.0, {"A": 1, "B": 1}), (1.0, {"A": 1}),
                  (3.0, {"B": 3})]


def test_reference_token_to_a_preempted_request_is_not_cached():
    """The vLLM trace of the next test, on the reference (``AsyncScheduler.
    _update_request_with_output`` caches only when ``status_before_update == RUNNING``)."""
    assert trace(simulate(INFLIGHT_CFG, INFLIGHT_SPECS), with_time=True) == INFLIGHT_TRACE


def test_token_to_a_preempted_request_is_not_cached():
    real = run_servesim(INFLIGHT_CFG, INFLIGHT_SPECS, fast_path=False)
    assert trace(real, with_time=True) == INFLIGHT_TRACE


EMPTY_SLOT_SPECS = [req("A", 0, 1, 2), req("B", 0, 1, 2)]
EMPTY_SLOT_CFG = cfg(num_gpu_blocks=3, block_size=2, max_num_seqs=1, max_num_batched_tokens=1,
                     pipeline_parallel_size=4, async_scheduling=True)
# pp = 4: a batch every 0.25 s, each back 1 s after it starts.
# t=0: S1 {A:1} (c=1, ph=1), S2 {A:1} (c=2, ph=2), S3: A: 2+2−2 = 2 < 3: {A:1} (c=3 takes
#   the 2nd block), S4 {A:1} (c=4): the queue is full (4). S1 back at 1: o1.
# t=1: S5: A: c 4→5 needs a 3rd block: preempts itself; B: no admission this step: an
#   EMPTY batch, which still takes a queue slot. S2 back at 1.25: o2 → A done.
# t=1.25: S6 {B:1}; the queue [S6, E, S4, S3] is full: wait for S3 (1.5). t=1.5: S7 {B:1}
#   (servesim, dropping E, had scheduled it at 1.25 already). ...
EMPTY_SLOT_TRACE = [(0.0, {"A": 1}), (0.0, {"A": 1}), (0.0, {"A": 1}), (0.0, {"A": 1}),
                    (1.25, {"B": 1}), (1.5, {"B": 1})]


def test_reference_empty_batch_takes_a_batch_queue_slot():
    """The vLLM trace of the next test, on the reference (``EngineCore.step_with_batch_queue``
    appends every ``SchedulerOutput``, empty ones included, to the batch queue)."""
    ref = simulate(EMPTY_SLOT_CFG, EMPTY_SLOT_SPECS)
    assert trace(ref, with_time=True)[:6] == EMPTY_SLOT_TRACE


def test_empty_batch_takes_a_batch_queue_slot():
    real = run_servesim(EMPTY_SLOT_CFG, EMPTY_SLOT_SPECS, fast_path=False)
    assert trace(real, with_time=True)[:6] == EMPTY_SLOT_TRACE


def _unique(i, n):
    return tuple(10**6 * (i + 1) + j for j in range(n))


FREE_ROWS_SPECS = [RequestSpec("r0", 0.0, _unique(0, 9), 20, priority=1),
                   RequestSpec("r1", 0.0, _unique(1, 44), 3),
                   RequestSpec("r2", 7.875, _unique(2, 1), 19)]
FREE_ROWS_CFG = cfg(num_gpu_blocks=25, block_size=2, max_num_seqs=2, max_num_batched_tokens=2,
                    policy="priority", async_scheduling=True, pipeline_parallel_size=4)
# (Found by the long differential profile.) r0 (priority 1) is preempted twice by r1 and r2
# and re-admitted after r2 — while the batch scheduled at t=12.5 with rows [r0, r2] is in
# flight. That batch returns at 13.5 with both last outputs: vLLM frees r0 then r2 (row
# order); servesim sorts by its running order (r2 was admitted before r0's last admission).
# The reference runs with empty batches dropped, as servesim does, to isolate this.


def test_reference_requests_stopping_together_freed_in_row_order():
    """``Scheduler.update_from_output`` calls ``_free_request`` inside its loop over the
    returning batch's rows, so blocks reach the free queue in row order."""
    ref = simulate(FREE_ROWS_CFG, FREE_ROWS_SPECS)
    assert [(b.time_scheduled, b.num_scheduled_tokens) for b in ref.batches
            if b.time_scheduled == 12.5] == [(12.5, {"r0": 1, "r2": 1})]
    assert ref.requests["r0"].finish_time == ref.requests["r2"].finish_time == 13.5
    assert ref.requests["r0"].num_preemptions == 1
    assert ref.finish_order == ["r1", "r0", "r2"]


def test_requests_stopping_together_freed_in_row_order():
    ref = simulate(FREE_ROWS_CFG, FREE_ROWS_SPECS)
    real = run_servesim(FREE_ROWS_CFG, FREE_ROWS_SPECS, fast_path=False)
    assert real.batches == ref.batches
    assert real.finish_order == ["r1", "r0", "r2"]
