"""Self-checks of the reference (``vllm_ref.py``) that do not involve servesim: the block
pool's structures, and invariants over generated workloads (every block accounted for after
every step, all blocks free at the end, token conservation, outputs)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .ref_block_pool import BlockHashToBlockMap, FreeKVCacheBlockQueue, KVCacheBlock
from .ref_request import RequestSpec
from .ref_scheduler import Config
from .vllm_ref import Engine


def test_free_queue_is_lru_with_middle_removal():
    """``FreeKVCacheBlockQueue``: popleft from the front, append_n at the back, O(1) removal
    from the middle (a prefix hit reviving a free block)."""
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert [b.block_id for b in q.popleft_n(2)] == [0, 1]
    q.remove(blocks[3])
    q.append_n([blocks[1], blocks[0]])
    assert [b.block_id for b in q.get_all_free_blocks()] == [2, 4, 1, 0]
    assert q.num_free_blocks == 4


def test_block_hash_map_returns_the_first_inserted_block():
    """``BlockHashToBlockMap``: no dedup; ``get_one_block`` returns the first block still
    holding the hash."""
    m = BlockHashToBlockMap()
    a, b = KVCacheBlock(1), KVCacheBlock(2)
    m.insert(7, a)
    m.insert(7, b)
    assert m.get_one_block(7) is a
    assert m.pop(7, 1) is a
    assert m.get_one_block(7) is b
    assert m.pop(7, 2) is b and m.get_one_block(7) is None


req_st = st.tuples(st.integers(0, 12), st.integers(1, 40), st.integers(1, 12),
                   st.integers(0, 2), st.integers(0, 2), st.booleans())


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(req_st, min_size=1, max_size=10), st.sampled_from([2, 4, 16]),
       st.integers(0, 10), st.integers(1, 40), st.sampled_from(["fcfs", "priority"]),
       st.booleans(), st.sampled_from([1, 2, 3]), st.booleans())
def test_invariants(reqs, bs, extra, budget, policy, async_scheduling, pp, caching):
    mml = 64
    specs = []
    for i, (slot, p, out, fam, prio, eos) in enumerate(reqs):
        p = min(p, mml - 1)
        toks = tuple(1000 * fam + j for j in range(p)) if fam else tuple(
            10**6 * (i + 1) + j for j in range(p))
        if eos:
            specs.append(RequestSpec(f"r{i}", slot * 0.75, toks, mml - p, eos_after=out,
                                     priority=prio))
        else:
            specs.append(RequestSpec(f"r{i}", slot * 0.75, toks, min(out, mml - p),
                                     priority=prio))
    longest = max(min(len(s.prompt_token_ids) + (s.eos_after or s.max_tokens), mml)
                  for s in specs)
    cfg = Config(num_gpu_blocks=-(-longest // bs) + 1 + extra, block_size=bs,
                 max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=mml,
                 policy=policy, async_scheduling=async_scheduling,
                 pipeline_parallel_size=pp, enable_prefix_caching=caching)
    eng = Engine(cfg)
    kv = eng.scheduler.kv_cache_manager
    schedule = eng.scheduler.schedule

    def checked_schedule():
        kv.check_invariants()
        out = schedule()
        kv.check_invariants()
        return out

    eng.scheduler.schedule = checked_schedule
    res = eng.run(specs)
    pool = kv.block_pool
    assert pool.get_num_free_blocks() == cfg.num_gpu_blocks - 1
    assert not kv.req_to_blocks and not eng.scheduler.requests
    scheduled = {s.request_id: 0 for s in specs}
    for b in res.batches:
        for rid, n in b.num_scheduled_tokens.items():
            scheduled[rid] += n
    for s in specs:
        r = res.requests[s.request_id]
        p = len(s.prompt_token_ids)
        if s.eos_after is not None and s.eos_after <= s.max_tokens:
            assert (r.num_output_tokens, r.finish_reason) == (s.eos_after, "stop")
        else:
            assert (r.num_output_tokens, r.finish_reason) == (s.max_tokens, "length")
        if r.num_preemptions == 0 and not caching:
            assert scheduled[s.request_id] >= p + r.num_output_tokens - 1
        if r.num_preemptions == 0 and not async_scheduling:
            # Synchronous: never a wasted row, hits aside: at most prompt + outputs − 1.
            assert scheduled[s.request_id] <= p + r.num_output_tokens - 1
