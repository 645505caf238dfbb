"""Property tests over random workloads and cache sizes (hypothesis)."""

from harness import Harness
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servesim.simulator.request import RequestStatus

req_st = st.tuples(
    st.integers(0, 12),   # arrival step
    st.integers(1, 60),   # prompt length
    st.integers(1, 20),   # max_tokens
    st.integers(0, 3),    # prefix family (shared leading tokens)
    st.integers(0, 3),    # priority
)

cfg_st = st.fixed_dictionaries({
    "block_size": st.sampled_from([1, 2, 4, 16]),
    "extra_blocks": st.integers(0, 40),
    "max_num_seqs": st.integers(1, 8),
    "max_num_batched_tokens": st.integers(8, 96),
    "threshold": st.sampled_from([0, 0, 5, 17]),
    "policy": st.sampled_from(["fcfs", "priority"]),
    "chunked": st.sampled_from([True, True, False]),
})


def simulate(reqs, cfg, *, fast_path, enable_caching=True):
    bs = cfg["block_size"]
    longest = max(p + m for _, p, m, _, _ in reqs)
    budget = cfg["max_num_batched_tokens"]
    if not cfg["chunked"]:
        budget = max(budget, 80)
    h = Harness(block_size=bs, num_blocks=-(-longest // bs) + 1 + cfg["extra_blocks"],
                max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=budget,
                max_model_len=128, threshold=cfg["threshold"], policy=cfg["policy"],
                fast_path=fast_path, enable_caching=enable_caching, chunked=cfg["chunked"])
    pending = sorted(enumerate(reqs), key=lambda x: (x[1][0], x[0]))
    steps, step = [], 0
    while pending or h.sched.has_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, p, m, fam, prio) = pending.pop(0)
            toks = [1000 * fam + j for j in range(p)] if fam else [10**6 + 1000 * i + j
                                                                    for j in range(p)]
            h.add(f"r{i}", p, m, token_ids=toks, priority=prio)
        if h.sched.has_requests():
            out = h.step()
            steps.append((out.as_dict(), [r.request_id for r in out.preempted]))
            h.kv.check_invariants()
        step += 1
        assert step < 5000, "no progress"
    return h, steps


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(req_st, min_size=1, max_size=12), cfg_st)
def test_invariants_and_fast_path_equivalence(reqs, cfg):
    h, steps = simulate(reqs, cfg, fast_path=True)
    h_exact, steps_exact = simulate(reqs, cfg, fast_path=False)
    # The decode-group fast path makes exactly the decisions of the per-request loop.
    assert steps == steps_exact
    for rid, r in h.reqs.items():
        e = h_exact.reqs[rid]
        assert (r.num_output_tokens, r.num_preemptions, r.num_cached_tokens, r.finish_time) == (
            e.num_output_tokens, e.num_preemptions, e.num_cached_tokens, e.finish_time)
    # Every request accounted for; outputs exactly max_tokens (never more).
    for i, (_, p, m, _, _) in enumerate(reqs):
        r = h.reqs[f"r{i}"]
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert r.num_output_tokens == m
        assert r.num_tokens == p + m
    # No block leaked: everything is free at the end (null block excluded).
    pool = h.kv.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)
    # Token conservation for requests never preempted: prompt + max_tokens - 1, less hits.
    for i, (_, p, m, _, _) in enumerate(reqs):
        r = h.reqs[f"r{i}"]
        if r.num_preemptions == 0:
            total = sum(s.get(r.request_id, 0) for s, _ in steps)
            assert total == p + m - 1 - r.num_cached_tokens


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(req_st, min_size=1, max_size=10), cfg_st)
def test_prefix_caching_changes_timing_not_outputs(reqs, cfg):
    h_on, _ = simulate(reqs, cfg, fast_path=True, enable_caching=True)
    h_off, _ = simulate(reqs, cfg, fast_path=True, enable_caching=False)
    for rid in h_on.reqs:
        assert h_on.reqs[rid].num_output_tokens == h_off.reqs[rid].num_output_tokens
        assert h_off.reqs[rid].num_cached_tokens in (0, -1)
