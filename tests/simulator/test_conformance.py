"""Conformance with vLLM V1's scheduler and KV cache manager: the course's worked traces
(shared/reference/vllm-course-digest-1-core.md §2, §3, §6)."""

import pytest
from harness import Harness
from servesim.simulator.request import RequestStatus


@pytest.mark.parametrize("fast_path", [True, False])
def test_token_budget_trace(fast_path):
    """Budget 8, A=11 tokens, B=7, max_tokens=4 (L1836)."""
    h = Harness(max_num_batched_tokens=8, fast_path=fast_path)
    h.add("A", 11, 4)
    h.add("B", 7, 4)
    assert h.run() == [{"A": 8}, {"A": 3, "B": 5}, {"A": 1, "B": 2}, {"A": 1, "B": 1},
                       {"A": 1, "B": 1}, {"B": 1}]


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize("threshold,expected_head", [(0, [257]), (32, [33] * 8)])
def test_long_prompt_lands_on_decoding_stream(fast_path, threshold, expected_head):
    """A 256-token prompt landing on a decoding stream (L3874): the decoding request's
    per-step batch is [257, 2, 1, ...] unchunked and [33×8, 2, 1, ...] at threshold 32."""
    h = Harness(max_num_batched_tokens=2048, threshold=threshold, fast_path=fast_path)
    h.add("victim", 8, 30)
    for _ in range(3):  # the victim is decoding
        h.step()
    h.add("long", 256, 2)
    sizes = []
    while h.reqs["victim"].status == RequestStatus.RUNNING:
        out = h.step()
        assert out.as_dict().get("victim") == 1
        sizes.append(out.total_num_scheduled_tokens)
    n = len(expected_head)
    assert sizes[:n + 3] == expected_head + [2, 1, 1]


def _shared_prefix_run(enable_caching, fast_path=True):
    """Block 4, 64-token shared prefix, 8 prompts of 65 tokens, max_tokens 4 (L3957)."""
    h = Harness(block_size=4, num_blocks=400, enable_caching=enable_caching,
                fast_path=fast_path)
    prefix = list(range(1000, 1064))
    for i in range(8):
        h.add(f"r{i}", 65, 4, token_ids=prefix + [i])
    steps = h.run()
    return sum(sum(s.values()) for s in steps), h


@pytest.mark.parametrize("fast_path", [True, False])
def test_prefix_caching_exact_savings(fast_path):
    no_cache, _ = _shared_prefix_run(False, fast_path)
    cached, h = _shared_prefix_run(True, fast_path)
    assert no_cache == 544  # 8 × (65 + 4 − 1)
    assert cached == 68 + 7 * 4  # = 96: the other seven hit 64 tokens each
    assert [h.reqs[f"r{i}"].num_cached_tokens for i in range(8)] == [0] + [64] * 7
    stats = h.kv.prefix_cache_stats
    assert (stats.queries, stats.hits) == (8 * 65, 7 * 64)


def test_share_and_evict():
    """Block 4, 32-token prompt (L2868): identical second request gets cached=28 with ref
    counts [2,2,2,2,2,2,2,1]; one diverging at token 16 gets cached=16; tails are evicted
    before the shared head."""
    h = Harness(block_size=4, num_blocks=64)
    toks = list(range(32))
    a = h.add("a", 32, 10, token_ids=toks)
    h.step()
    b = h.add("b", 32, 2, token_ids=toks)
    h.step()
    assert b.num_cached_tokens == 28
    assert [blk.ref_cnt for blk in b.blocks[:8]] == [2, 2, 2, 2, 2, 2, 2, 1]
    c = h.add("c", 32, 2, token_ids=toks[:16] + [99] * 16)
    h.step()
    assert c.num_cached_tokens == 16
    h.run()
    for r in (a, b, c):
        assert r.is_finished
    h.kv.check_invariants()
    # All blocks are free now; eviction order (free-queue front first) puts each request's
    # tail ahead of its head, so the shared head blocks are evicted last among a's blocks.
    order = [blk.block_id for blk in h.kv.block_pool.free_block_queue.get_all_free_blocks()]
    a_ids = [blk for blk in range(1, 64) if blk in order]
    head = h.kv.block_pool.get_cached_block(a.block_hashes[0])
    tail = h.kv.block_pool.get_cached_block(a.block_hashes[6])
    assert head is not None and tail is not None and a_ids
    assert order.index(tail.block_id) < order.index(head.block_id)


def test_fragmentation_paged_admits_all():
    """4096 slots, 64 arrivals reserving 512 and using 32, block 16 (L2588): paged admits 64
    (contiguous would admit 8)."""
    h = Harness(block_size=16, num_blocks=4096 // 16 + 1, max_num_batched_tokens=4096,
                max_model_len=512)
    for i in range(64):
        h.add(f"r{i}", 32, 2)
    out = h.sched.schedule()
    assert len(out.scheduled) == 64
    assert h.kv.get_num_free_blocks() == 256 - 64 * 2  # 2 blocks each, no reservation


@pytest.mark.parametrize("fast_path", [True, False])
def test_preemption_newest_victim_recomputes_and_hits_own_blocks(fast_path):
    """Tiny cache: the newest running request is preempted (FCFS running.pop()), goes to the
    front of waiting with num_computed_tokens = 0, keeps its outputs, re-prefills prompt +
    outputs and hits its own surviving cached blocks."""
    h = Harness(block_size=4, num_blocks=11, max_num_batched_tokens=64, fast_path=fast_path)
    old = h.add("old", 16, 12)
    new = h.add("new", 16, 12)
    preempted_at = None
    for i in range(200):
        if not h.sched.has_unfinished_requests():
            break
        out = h.step()
        if out.preempted and preempted_at is None:
            preempted_at = i
            assert out.preempted == [new]
            assert new.status == RequestStatus.PREEMPTED
            assert new.num_computed_tokens == 0 and new.num_output_tokens > 0
            assert h.sched.waiting.peek_request() is new
            outputs_at_preemption = new.num_output_tokens
            queries_before = h.kv.prefix_cache_stats.preempted_queries
    assert preempted_at is not None
    assert old.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert new.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert new.num_output_tokens == 12 and new.num_preemptions >= 1
    assert outputs_at_preemption > 0
    # The re-admission queried prompt + outputs and hit blocks it had cached before.
    stats = h.kv.prefix_cache_stats
    assert stats.preempted_queries > queries_before
    assert stats.preempted_hits > 0
    h.kv.check_invariants()


def test_priority_victim_is_lowest_priority():
    h = Harness(block_size=4, num_blocks=11, max_num_batched_tokens=64, policy="priority")
    urgent = h.add("urgent", 16, 12, priority=0)
    lazy = h.add("lazy", 16, 12, priority=5)
    victims = []
    while h.sched.has_unfinished_requests():
        victims += h.step().preempted
    assert victims and all(v is lazy for v in victims)
    assert urgent.num_preemptions == 0


def test_fully_cached_prompt_still_scheduled_one_token():
    h = Harness(block_size=4, num_blocks=64)
    toks = list(range(16))
    h.add("a", 16, 1, token_ids=toks)
    h.run()
    b = h.add("b", 16, 1, token_ids=toks)
    out = h.step()
    # 16 tokens = 4 full blocks; the hit is capped at num_tokens - 1 → 3 blocks (12 tokens).
    assert out.as_dict() == {"b": 4}
    assert b.num_cached_tokens == 12


def test_token_conservation_and_sampling_guard():
    h = Harness(max_num_batched_tokens=40, threshold=16)
    lens = [(50, 7), (3, 1), (33, 5), (16, 16)]
    for i, (p, m) in enumerate(lens):
        h.add(f"r{i}", p, m)
    steps = h.run()
    for i, (p, m) in enumerate(lens):
        total = sum(s.get(f"r{i}", 0) for s in steps)
        assert total == p + m - 1
        assert h.reqs[f"r{i}"].num_output_tokens == m


def test_max_num_seqs_and_head_of_line_blocking():
    h = Harness(max_num_seqs=2, max_num_batched_tokens=1000)
    for i in range(4):
        h.add(f"r{i}", 10, 3)
    out = h.step()
    assert set(out.as_dict()) == {"r0", "r1"}
    # A big head request that does not fit blocks smaller ones behind it (no skipping).
    h2 = Harness(block_size=4, num_blocks=9, max_num_batched_tokens=1000)
    h2.add("small0", 4, 30)
    h2.step()
    h2.add("big", 28, 1)
    h2.add("small1", 4, 1)
    out = h2.step()
    assert set(out.as_dict()) == {"small0"}
