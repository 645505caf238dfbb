"""Decisions of the extra scheduler policies on small traces (one dict per step:
{request_id: tokens scheduled})."""

from __future__ import annotations

import numpy as np
import pytest
from policy_harness import PolicyHarness
from servesim.simulator.registry import available

POLICIES = ("fcfs", "sarathi", "orca", "static", "spf")


def test_registered():
    names = available()
    assert {"sarathi", "orca", "static", "spf"} <= set(names["schedulers"])
    assert {"contiguous", "paged_no_prefix", "paged_lfu"} <= set(names["kv_allocators"])


# --- sarathi -----------------------------------------------------------------------------------


def test_sarathi_serves_decodes_before_an_earlier_prefill():
    """Same state for both: running = [B (prefill, 240 left), A (decode)], budget 64.
    vLLM V1 fcfs serves running order (B's chunk takes the whole budget: A stalls);
    Sarathi serves the decode first and gives B the rest."""
    steps = {}
    for policy in ("fcfs", "sarathi"):
        h = PolicyHarness(policy, max_num_batched_tokens=64, threshold=60, fast_path=False)
        h.add("B", 300, 4)
        h.add("A", 4, 8)
        assert h.step() == {"B": 60, "A": 4}
        assert [r.request_id for r in h.sched.running] == ["B", "A"]
        h.sched.threshold = 0  # now let a chunk use the whole budget
        steps[policy] = h.step()
    assert steps["fcfs"] == {"B": 64}
    assert steps["sarathi"] == {"A": 1, "B": 63}


def test_sarathi_packs_several_prefills_and_reserves_whole_prompt():
    h = PolicyHarness("sarathi", max_num_batched_tokens=64, num_blocks=1000)
    h.add("A", 20, 2)
    h.add("B", 20, 2)
    h.add("C", 300, 2)
    assert h.step() == {"A": 20, "B": 20, "C": 24}
    assert len(h.reqs["C"].blocks) == -(-300 // 16)  # whole prompt at admission
    g = PolicyHarness("fcfs", max_num_batched_tokens=64, num_blocks=1000)
    g.add("A", 20, 2)
    g.add("B", 20, 2)
    g.add("C", 300, 2)
    assert g.step() == {"A": 20, "B": 20, "C": 24}
    assert len(g.reqs["C"].blocks) == 2  # vLLM V1: chunk by chunk
    assert h.step() == {"A": 1, "B": 1, "C": 62}


def test_sarathi_watermark_blocks_admission():
    # 201 blocks (1 null): watermark int(0.01 * 201) = 2 free blocks must remain.
    h = PolicyHarness("sarathi", num_blocks=201, max_num_batched_tokens=64)
    h.add("A", 198 * 16, 1)  # 198 blocks: leaves 2 = watermark -> admitted
    assert h.step() == {"A": 64}
    h2 = PolicyHarness("sarathi", num_blocks=201, max_num_batched_tokens=64)
    h2.add("A", 199 * 16, 1)  # would leave 1 < 2
    assert h2.step() == {}


# --- orca --------------------------------------------------------------------------------------


def test_orca_whole_prompts_mixed_with_decodes():
    h = PolicyHarness("orca", max_num_batched_tokens=64)
    h.add("A", 10, 3)
    h.add("B", 100, 2)
    # B (100) does not fit the 54 left after A, and A is already this step's prompt
    assert h.step() == {"A": 10}
    # first prompt of the step: joins whole even though 100 > budget (no chunking ever)
    assert h.step() == {"A": 1, "B": 100}
    assert h.step() == {"A": 1, "B": 1}
    assert h.run() == []
    assert {r.request_id: r.num_output_tokens for r in h.finished} == {"A": 3, "B": 2}


def test_orca_max_num_seqs_and_head_of_line():
    h = PolicyHarness("orca", max_num_batched_tokens=4096, max_num_seqs=2)
    for i in range(3):
        h.add(f"R{i}", 10, 2)
    assert h.step() == {"R0": 10, "R1": 10}
    assert h.step() == {"R0": 1, "R1": 1}
    assert h.step() == {"R2": 10}  # joins at the iteration after a slot freed


# --- static ------------------------------------------------------------------------------------


def test_static_batch_runs_to_completion_before_next_forms():
    h = PolicyHarness("static", max_num_seqs=2, max_num_batched_tokens=4096)
    h.add("A", 10, 2)
    h.add("B", 10, 5)
    h.add("C", 10, 2)
    steps = h.run()
    assert steps[0] == {"A": 10, "B": 10}
    assert steps[1] == {"A": 1, "B": 1}  # A finishes here (2 outputs)
    assert steps[2:5] == [{"B": 1}] * 3  # C waits although a slot is free
    assert steps[5] == {"C": 10}
    assert steps[6] == {"C": 1}
    assert len(steps) == 7
    # continuous batching (orca) admits C as soon as A leaves
    o = PolicyHarness("orca", max_num_seqs=2, max_num_batched_tokens=4096)
    o.add("A", 10, 2)
    o.add("B", 10, 5)
    o.add("C", 10, 2)
    assert len(o.run()) < 7


# --- spf ---------------------------------------------------------------------------------------


def test_spf_admits_shortest_prompt_first():
    h = PolicyHarness("spf", max_num_seqs=1, max_num_batched_tokens=4096)
    for rid, n in (("L", 500), ("S", 10), ("M", 100)):
        h.add(rid, n, 1)
    order = [next(iter(s)) for s in h.run()]
    assert order == ["S", "M", "L"]
    f = PolicyHarness("fcfs", max_num_seqs=1, max_num_batched_tokens=4096)
    for rid, n in (("L", 500), ("S", 10), ("M", 100)):
        f.add(rid, n, 1)
    assert [next(iter(s)) for s in f.run()] == ["L", "S", "M"]


def test_spf_aging_bounds_overtaking():
    """A long prompt under a stream of short ones: overtaken by at most aging_admissions."""
    for aging in (2, 5):
        h = PolicyHarness("spf", max_num_seqs=1, max_num_batched_tokens=4096,
                          aging_admissions=aging)
        h.add("L", 500, 1)
        admitted = []
        for i in range(20):
            h.add(f"s{i}", 10, 1)  # a new short request every step
            admitted += [r for r, n in h.step().items() if n > 1]
        assert "L" in admitted
        assert admitted.index("L") == aging
    # without aging (huge bound) the long request starves while shorts keep coming
    h = PolicyHarness("spf", max_num_seqs=1, max_num_batched_tokens=4096,
                      aging_admissions=10**9)
    h.add("L", 500, 1)
    seen = []
    for i in range(20):
        h.add(f"s{i}", 10, 1)
        seen += list(h.step())
    assert "L" not in seen


def test_spf_preempted_requests_go_first():
    h = PolicyHarness("spf", num_blocks=5, block_size=4, max_num_batched_tokens=64,
                      max_num_seqs=4, enable_caching=False)
    h.add("A", 6, 8)  # 2 blocks
    h.add("B", 6, 8)  # 2 blocks: pool (4 usable) full
    h.step()
    h.add("S", 2, 1)  # short, waiting
    steps = h.run()
    pre = [r for r in h.reqs.values() if r.num_preemptions]
    assert pre and pre[0].request_id == "B"
    # B (preempted) is readmitted before the shorter S
    # the preempted B waits at the front: the shorter S is not admitted before it, even
    # while a block is free (head-of-line), and both join in the same step, B first
    joined = next(st for st in steps if "S" in st)
    assert list(joined) == ["B", "S"] and joined["B"] == 9


# --- all policies: conservation ---------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("allocator", ["paged", "contiguous", "paged_lfu", "paged_no_prefix"])
def test_every_request_finishes_with_its_tokens(policy, allocator):
    rng = np.random.default_rng(7)
    h = PolicyHarness(policy, allocator, num_blocks=120, block_size=16, max_num_seqs=8,
                      max_num_batched_tokens=256, max_model_len=512)
    want = {}
    for i in range(40):
        p, o = int(rng.integers(1, 300)), int(rng.integers(1, 60))
        h.add(f"r{i}", p, o, prefix_ids=(i % 3, 100 + i % 2) if i % 2 else None)
        want[f"r{i}"] = o
        h.step()
    h.run()
    assert {r.request_id: r.num_output_tokens for r in h.finished} == want
    assert h.kv.get_num_free_blocks() == 119
    h.kv.check_invariants()
