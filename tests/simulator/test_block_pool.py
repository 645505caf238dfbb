"""The production KV cache (``kv_cache.py`` and ``block_pool.py``: ids, a positioned free queue,
request-unique content cached implicitly) against a straightforward per-block reference of
vLLM's (``ref_block_pool``): random admissions with prefix hits, prefill chunks, decodes,
preemptions (own-block hits on resume) and finishes, with and without prefix caching and
sliding windows. After every operation both must agree on every return value, every block
table, the free queue's exact LRU order, every block's reference count, evictions and
prefix-cache statistics."""

import os

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from ref_block_pool import RefKVCacheManager
from servesim.simulator.kv_cache import KVCacheManager
from servesim.simulator.request import Request
from servesim.workloads.schema import RequestSpec

# SERVESIM_FUZZ=long: 20x the examples (on demand); quick: a fifth (mutation testing)
SCALE = {"long": 20, "quick": 0.2}.get(os.environ.get("SERVESIM_FUZZ", ""), 1)

MML = 64

req_st = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 12),  # outputs
    st.sampled_from(["unique", "unique", "tokens", "prefix_ids"]),  # content
    st.integers(0, 2),  # content family (shared leading content)
)
op_st = st.tuples(
    # 0 admit the waiting head, 1-2 step a running request, 3 preempt, 4 finish
    st.sampled_from([0, 0, 0, 1, 1, 1, 1, 1, 3, 3, 4]),
    st.integers(0, 1000),  # which request
    st.integers(1, 40),  # chunk size
    st.booleans(),  # full_sequence_must_fit on admission
)
cfg_st = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4]),
    "num_blocks": st.integers(3, 30),
    "caching": st.sampled_from([True, True, False]),
    "window": st.sampled_from([None, None, None, 3, 6, 9]),
    "bulk_decode": st.booleans(),
})


def make_request(i: int, spec_tuple, bs: int) -> Request:
    p, m, content, fam = spec_tuple
    toks = ids = None
    if content == "tokens":
        toks = tuple(1000 * fam + j for j in range(p))
    elif content == "prefix_ids":
        ids = tuple(100 * fam + j for j in range(p // bs))
    spec = RequestSpec(arrival_s=0.0, prompt_len=p, output_len=m, request_id=f"r{i}",
                       prompt_token_ids=toks, prefix_block_ids=ids or None)
    r = Request(spec, i, MML, 0.0)
    r.max_tokens = min(m, MML - p) if p < MML else 1
    return r


def snapshot_prod(kv: KVCacheManager, reqs) -> dict:
    pool = kv.block_pool
    free = pool.free_ids()
    free_set = set(free)
    refs = [pool._ref.get(b, 0 if b in free_set else 1) for b in range(1, pool.num_gpu_blocks)]
    # blocks held by requests' tables count once per table for request-unique content
    st = kv.prefix_cache_stats
    return {"free": free, "refs": refs, "evictions": pool.num_evictions,
            "tables": [list(r.block_ids) for r in reqs],
            "stats": (st.requests, st.queries, st.hits, st.preempted_requests,
                      st.preempted_queries, st.preempted_hits)}


def snapshot_ref(ref: RefKVCacheManager, reqs) -> dict:
    pool = ref.pool
    return {"free": pool.queue.ids(),
            "refs": [b.ref_cnt for b in pool.blocks[1:]], "evictions": pool.num_evictions,
            "tables": [ref.table(r) for r in reqs],
            "stats": (ref.requests, ref.queries, ref.hits, ref.preempted_requests,
                      ref.preempted_queries, ref.preempted_hits)}


def run_case(reqs_spec, ops, cfg):
    bs, n, caching, window = cfg["block_size"], cfg["num_blocks"], cfg["caching"], cfg["window"]
    budget = 16
    kv = KVCacheManager(n, bs, caching, MML)
    ref = RefKVCacheManager(n, bs, caching, MML, sliding_window=window,
                            max_num_batched_tokens=budget)
    if window:
        kv.set_sliding_window(window, budget)
    reqs = [make_request(i, s, bs) for i, s in enumerate(reqs_spec)]
    waiting = list(reqs)
    running: list[Request] = []
    for kind, pick, chunk, full in ops:
        if kind == 0:  # admit the head of the waiting queue
            if not waiting:
                continue
            r = waiting[0]
            hits_p, nh_p = kv.get_computed_blocks(r)
            hits_r, nh_r = ref.get_computed_blocks(r)
            assert hits_p == [b.block_id for b in hits_r] and nh_p == nh_r
            num = min(r.num_tokens - nh_p, chunk, budget)
            new_p = kv.allocate_slots(r, num, nh_p, hits_p, 0, full)
            new_r = ref.allocate_slots(r, num, nh_r, hits_r, 0, full)
            assert (new_p is None) == (new_r is None)
            if new_p is None:
                continue
            assert new_p == [b.block_id for b in new_r]
            waiting.pop(0)
            running.append(r)
            r.num_computed_tokens = nh_p
            advance(r, num)
        elif kind in (1, 2):  # schedule a running request (prefill chunk or decode)
            if not running:
                continue
            r = running[pick % len(running)]
            num = min(r.num_tokens - r.num_computed_tokens, chunk, budget,
                      MML - 1 - r.num_computed_tokens)
            if num <= 0:
                continue
            if (cfg["bulk_decode"] and num == 1 and not window and
                    r.num_computed_tokens % bs == 0 and
                    r.num_computed_tokens // bs >= r.num_shared_blocks(bs) and
                    len(r.block_ids) == r.num_computed_tokens // bs and
                    kv.get_num_free_blocks() >= 1):
                # the scheduler's decode group: one new block, caching implicit
                kv.append_decode_blocks([r])
                if caching:
                    r.num_cached_blocks = (r.num_computed_tokens + 1) // bs
                new_r = ref.allocate_slots(r, 1)
                assert new_r is not None and len(new_r) == 1
                assert r.block_ids[-1] == new_r[0].block_id
            else:
                new_p = kv.allocate_slots(r, num)
                new_r = ref.allocate_slots(r, num)
                assert (new_p is None) == (new_r is None)
                if new_p is None:
                    continue
                assert new_p == [b.block_id for b in new_r]
            advance(r, num)
        elif kind == 3:  # preempt: recompute later, own blocks may still be hit
            if not running:
                continue
            r = running.pop(pick % len(running))
            kv.free(r)
            ref.free(r)
            r.num_computed_tokens = 0
            r.num_preemptions += 1
            waiting.insert(0, r)
        else:  # finish
            if not running:
                continue
            r = running.pop(pick % len(running))
            kv.free(r)
            ref.free(r)
        kv.check_invariants()
        assert snapshot_prod(kv, reqs) == snapshot_ref(ref, reqs)
        for r in list(running):  # requests that produced all their outputs finish
            if r.num_output_tokens >= r.max_tokens:
                running.remove(r)
                kv.free(r)
                ref.free(r)
        assert snapshot_prod(kv, reqs) == snapshot_ref(ref, reqs)
    # the public per-block views agree too: reference counts (the null block: never freed)
    # and, for every hash in the index (request-unique content is cached implicitly, not
    # indexed; the reference hashes differently), a lookup returns a block the reference
    # holds cached under one hash shared by every block the index lists for it
    pool = kv.block_pool
    assert [pool.blocks[b].ref_cnt for b in range(1, n)] == [
        b.ref_cnt for b in ref.pool.blocks[1:]]
    assert pool.blocks[0].ref_cnt > 1 << 40
    for h, v in pool.cached_block_hash_to_block.items():
        ids = [v] if type(v) is int else list(v)
        got = pool.get_cached_block(h).block_id
        assert got == ids[0]
        ref_hashes = {ref.pool.blocks[b].block_hash for b in ids}
        assert len(ref_hashes) == 1 and None not in ref_hashes
    return kv, ref


def advance(r: Request, num: int) -> None:
    r.num_computed_tokens += num
    if r.num_computed_tokens == r.num_tokens:
        r.num_tokens += 1
        r.num_output_tokens += 1


@settings(max_examples=int(500 * SCALE), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(req_st, min_size=1, max_size=10), st.lists(op_st, min_size=10, max_size=150),
       cfg_st)
@example([(20, 8, "unique", 0), (20, 8, "unique", 0)],
         [(0, 0, 40, False), (0, 0, 40, False), (1, 0, 1, False), (3, 1, 1, False),
          (0, 0, 40, False), (1, 1, 1, False), (0, 0, 40, False)],
         {"block_size": 4, "num_blocks": 14, "caching": True, "window": None,
          "bulk_decode": False})
# Duplicate blocks (vLLM keeps both): r1 hits r0's first chunk and computes the rest of the same
# prompt itself; r0's next chunk then fills blocks with the content r1 already cached.
@example([(24, 4, "tokens", 0), (24, 4, "tokens", 0)],
         [(0, 0, 8, False), (0, 0, 40, False), (1, 0, 16, False), (4, 1, 1, False),
          (0, 0, 40, False)],
         {"block_size": 4, "num_blocks": 20, "caching": True, "window": None,
          "bulk_decode": False})
def test_block_pool_matches_reference(reqs_spec, ops, cfg):
    run_case(reqs_spec, ops, cfg)


def test_preempted_request_hits_its_surviving_own_blocks():
    """A preempted request's unique blocks stay cached while free: on resume it hits those the
    front of the free queue has not reached (tail blocks are evicted first), including the one
    at the very front (the pool was full)."""
    cfg = {"block_size": 4, "num_blocks": 6, "caching": True, "window": None,
           "bulk_decode": False}
    ops = [(0, 0, 40, False), (1, 0, 40, False),  # A: 20-token prompt in two chunks
           (3, 0, 1, False),  # A preempted: its 5 full blocks freed, tail first
           (0, 0, 40, False)]  # A (prepended to waiting) resumes: 5 own blocks hit
    kv, ref = run_case([(20, 8, "unique", 0), (8, 4, "unique", 1)], ops, cfg)
    assert kv.prefix_cache_stats.preempted_hits == 20  # all 5 prompt blocks were still free
    assert ref.preempted_hits == 20


def test_long_run_matches_reference_across_free_queue_compaction():
    """Thousands of frees and allocations (one token per block): the positioned free queue
    passes 4096 positions and compacts its consumed front, more than once; every operation
    still agrees with the reference (tables, LRU order, reference counts, evictions, hits)."""
    import random

    rng = random.Random(12)
    reqs = [(rng.randint(20, 40), rng.randint(4, 12),
             rng.choice(["unique", "tokens", "prefix_ids"]), rng.randint(0, 2))
            for _ in range(160)]
    ops = [(rng.choice([0, 0, 1, 1, 1, 1, 3, 4]), rng.randint(0, 1000), rng.randint(8, 40),
            rng.random() < 0.5) for _ in range(6000)]
    kv, _ = run_case(reqs, ops, {"block_size": 1, "num_blocks": 120, "caching": True,
                                 "window": None, "bulk_decode": True})
    assert kv.block_pool._base > 4096  # compacted (the front moved past 4096 positions)


def test_check_invariants_catches_a_reference_count_out_of_step():
    """The invariant the property tests lean on is itself checked: a block that is in use
    (not free) but counted 0 references, or free but referenced, is reported (block 1, the
    first after the null block, included)."""
    import pytest

    kv = KVCacheManager(4, 16, True, MML)
    r = make_request(0, (20, 4, "unique", 0), 16)
    assert kv.allocate_slots(r, 20) == [1, 2]
    kv.check_invariants()
    pool = kv.block_pool
    pool._ref[1] = 0  # in use, yet no reference
    with pytest.raises(AssertionError):
        kv.check_invariants()
    del pool._ref[1]
    kv.check_invariants()
    pool._ref[3] = 1  # free, yet referenced
    with pytest.raises(AssertionError):
        kv.check_invariants()
