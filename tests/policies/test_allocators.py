"""The extra KV allocators: contiguous reservation, paged without prefix caching, LFU eviction."""

from __future__ import annotations

from policy_harness import PolicyHarness
from servesim.simulator.registry import get_kv_allocator
from servesim.simulator.request import Request
from servesim.workloads.schema import RequestSpec

BS = 16


def req(i, prompt_len, prefix=None, max_model_len=512):
    spec = RequestSpec(arrival_s=0.0, prompt_len=prompt_len, output_len=4, request_id=f"r{i}",
                       prefix_block_ids=tuple(prefix) if prefix else None)
    return Request(spec, i, max_model_len, 0.0)


def admitted(allocator: str) -> int:
    """64 arrivals using 32 tokens each, max_model_len 512, 4096 slots (+ the null block)."""
    kv = get_kv_allocator(allocator)(4096 // BS + 1, BS, False, 512)
    return sum(kv.allocate_slots(req(i, 32), 32) is not None for i in range(64))


def test_contiguous_admits_8_where_paged_admits_64():
    assert admitted("contiguous") == 8  # 8 × 512-token reservations = 4096 slots
    assert admitted("paged") == 64  # 64 × 2 blocks


def test_contiguous_in_the_scheduler_and_usage():
    h = PolicyHarness("fcfs", "contiguous", num_blocks=4096 // BS + 1, max_model_len=512,
                      max_num_seqs=64, max_num_batched_tokens=4096, enable_caching=False)
    for i in range(64):
        h.add(f"r{i}", 32, 8)
    assert len(h.step()) == 8
    assert h.kv.usage == 1.0  # reservations count as used
    assert sum(len(r.blocks) for r in h.sched.running) == 8 * 2  # ...but hold 2 blocks each
    h.run()
    assert len(h.finished) == 64 and h.kv.block_pool.num_reserved == 0
    assert h.kv.get_num_free_blocks() == 256 and h.kv.usage == 0.0
    assert h.sched.num_preemptions == 0  # a reservation never runs out


def test_contiguous_decode_fast_path_draws_from_reservations():
    for fast in (True, False):
        h = PolicyHarness("fcfs", "contiguous", num_blocks=65, block_size=4, max_model_len=64,
                          max_num_seqs=8, max_num_batched_tokens=256, fast_path=fast)
        for i in range(8):
            h.add(f"r{i}", 5, 40)  # decodes cross many block boundaries
        h.run()
        assert len(h.finished) == 8 and h.sched.num_preemptions == 0
        assert h.kv.block_pool.num_reserved == 0 and h.kv.get_num_free_blocks() == 64


def test_paged_no_prefix_ignores_enable_caching():
    for name, hits in (("paged", 32), ("paged_no_prefix", 0)):
        kv = get_kv_allocator(name)(100, BS, True, 512)
        a = req(0, 40, prefix=[1, 2])
        kv.allocate_slots(a, 40)
        b = req(1, 40, prefix=[1, 2])
        assert kv.get_computed_blocks(b)[1] == hits


def test_lfu_keeps_the_often_hit_block_that_lru_evicts():
    """Free cached blocks: P (hash of prefix 1, hit once, freed earlier) and Q (prefix 2, no
    hits, freed later). A 3-block allocation must evict one of them: LRU evicts P (freed
    first), LFU evicts Q (fewer hits)."""
    kept = {}
    for name in ("paged", "paged_lfu"):
        kv = get_kv_allocator(name)(5, 4, True, 64)  # 4 usable blocks of 4 tokens
        x = req(0, 5, prefix=[1], max_model_len=64)
        kv.allocate_slots(x, 5)
        h1 = x.block_hashes[0]
        kv.free(x)
        z = req(1, 5, prefix=[1], max_model_len=64)
        hits, n = kv.get_computed_blocks(z)
        assert n == 4
        kv.allocate_slots(z, 1, n, hits)
        kv.free(z)
        y = req(2, 5, prefix=[2], max_model_len=64)
        assert kv.get_computed_blocks(y)[1] == 0
        kv.allocate_slots(y, 5)
        h2 = y.block_hashes[0]
        kv.free(y)
        w = req(3, 9, prefix=[9], max_model_len=64)
        assert kv.allocate_slots(w, 9) is not None  # 3 blocks: evicts one cached block
        pool = kv.block_pool
        kept[name] = (pool.get_cached_block(h1) is not None, pool.get_cached_block(h2) is not None)
        kv.free(w)
        kv.check_invariants()
    assert kept["paged"] == (False, True)
    assert kept["paged_lfu"] == (True, False)
