"""Differential test: servesim's engine against an independent reference of vLLM 0.22.1's
scheduling (``tests/reference/vllm_ref.py``, written from vLLM's source, sharing no code).

Hypothesis generates small workloads on tiny caches (block sizes 2–16, chunked prefill on and
off, FCFS and priority with ties, shared prefixes through explicit prompt token ids,
preemption, ``max_num_seqs`` and token-budget boundaries, EOS and length stops, prompts up to
``max_model_len - 1``, arrivals spread over time) and runs each through the reference and
through ``servesim.simulator.engine.Replica`` (a constant 1 s step, a minimal SimPy arrival
process), with the decode-group fast path and with the exact per-request loop. Every batch
must match: when it was scheduled, {request: tokens}, and which requests it preempted; every
request: finish time, outputs, preemptions, finish reason; and the order requests finish.

Arrival slot ``k`` arrives at ``k·63/64`` s: just before batch ``k`` of a busy engine, and never
on a batch boundary (boundaries lie at an arrival time plus a multiple of 1/pp s), so "seen by
the next schedule() call" has one meaning.

CI runs the default profile (``EXAMPLES`` workloads per test); ``SERVESIM_FUZZ=long`` runs
20× more.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st
from servesim_driver import run_servesim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference.ref_request import RequestSpec
from reference.ref_scheduler import Config
from reference.vllm_ref import Stall, simulate

# SERVESIM_FUZZ=long: 20x the examples (on demand); quick: a fifth (mutation testing)
SCALE = {"long": 20, "quick": 0.2}.get(os.environ.get("SERVESIM_FUZZ", ""), 1)
COMMON = {"deadline": None, "derandomize": True, "database": None,
          "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                    HealthCheck.filter_too_much]}


def requests(slots: int, prompt: tuple[int, int], output: tuple[int, int]):
    """(arrival slot, prompt length, output length, prefix family, priority, stops on EOS)."""
    return st.tuples(st.integers(0, slots), st.integers(*prompt), st.integers(*output),
                     st.integers(0, 3), st.integers(0, 3), st.booleans())


req_st = requests(24, (1, 60), (1, 20))

cfg_st = st.fixed_dictionaries({
    "block_size": st.sampled_from([2, 4, 8, 16]),
    "extra_blocks": st.integers(0, 24),
    "max_num_seqs": st.integers(1, 8),
    "max_num_batched_tokens": st.integers(1, 96),
    "threshold": st.sampled_from([0, 0, 1, 5, 17]),
    "policy": st.sampled_from(["fcfs", "priority"]),
    "chunked": st.sampled_from([True, True, False]),
    "caching": st.sampled_from([True, True, True, False]),
    "max_model_len": st.sampled_from([128, 128, 48, 24]),
})


def arrival_time(slot: int) -> float:
    """``slot·63/64`` s: two arrivals differ by a multiple of 1/pp s only if their slots
    differ by a multiple of 64, so no arrival ever ties with a batch boundary."""
    return slot * 0.984375


def build(reqs, cfg, *, reserve_full_isl=True, async_scheduling=False, pp=1, id_format="r{}"):
    """A (Config, [RequestSpec]) pair from a generated workload.

    Prompts are clipped below ``max_model_len`` (the API server refuses longer ones, and one
    of exactly ``max_model_len`` tokens: ``InputProcessor._validate_model_input``); a request
    that ignores EOS gets ``max_tokens`` clipped to fit (the API refuses more); one that stops
    on EOS gets the API default ``max_tokens = max_model_len - prompt_len`` and EOS as output
    number ``out``, which may lie past the length cap.
    """
    mml = cfg["max_model_len"]
    bs = cfg["block_size"]
    specs = []
    longest = 1
    for i, r in enumerate(reqs):
        slot, p, out, fam, prio = r[:5]
        eos = r[5] if len(r) > 5 else False
        p = min(p, mml - 1)
        toks = ([1000 * fam + j for j in range(p)] if fam
                else [10**6 + 1000 * i + j for j in range(p)])
        if eos:
            max_tokens, eos_after = mml - p, out
            final = min(p + out, mml)
        else:
            max_tokens, eos_after = min(out, mml - p), None
            final = p + max_tokens
        longest = max(longest, final)
        specs.append(RequestSpec(id_format.format(i), arrival_time(slot), tuple(toks), max_tokens,
                                 eos_after=eos_after, priority=prio))
    budget = cfg["max_num_batched_tokens"]
    if not cfg["chunked"]:
        budget = max(budget, mml)  # vLLM: without chunked prefill the budget covers a prompt
    config = Config(
        num_gpu_blocks=-(-longest // bs) + 1 + cfg["extra_blocks"],
        block_size=bs, max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=budget,
        max_model_len=mml, long_prefill_token_threshold=cfg["threshold"],
        enable_chunked_prefill=cfg["chunked"], enable_prefix_caching=cfg.get("caching", True),
        policy=cfg["policy"], scheduler_reserve_full_isl=reserve_full_isl,
        async_scheduling=async_scheduling, pipeline_parallel_size=pp)
    return config, specs


def describe(config, specs) -> str:
    return "\n".join([repr(config)] + [repr(s) for s in specs])


def assert_same(ref, real, config, specs, label):
    ctx = f"[{label}]\n{describe(config, specs)}"
    n = min(len(ref.batches), len(real.batches))
    for k in range(n):
        a, b = ref.batches[k], real.batches[k]
        if (a.time_scheduled, a.num_scheduled_tokens, a.preempted) != (
                b.time_scheduled, b.num_scheduled_tokens, b.preempted):
            raise AssertionError(
                f"batch {k} differs {ctx}\n  vLLM ref: {a}\n  servesim: {b}\n"
                f"  previous: {ref.batches[max(k - 3, 0):k]}")
    assert len(ref.batches) == len(real.batches), (
        f"batch count {len(ref.batches)} vs {len(real.batches)} {ctx}\n"
        f"  tail ref {ref.batches[n:n + 3]}\n  tail real {real.batches[n:n + 3]}")
    assert ref.requests == real.requests, f"per-request results differ {ctx}"
    # The order requests finish within a batch is the order their blocks are freed, which
    # decides the LRU free queue's order (update_from_output frees in the batch's row order).
    assert ref.finish_order == real.finish_order, f"finish order differs {ctx}"


# Real differences between vLLM 0.22.1 and servesim that this test found, reported to the lead;
# each has a strict-xfail reproducer in test_rules.py (it XPASSes, i.e. fails, once fixed).
# While an entry is here, workloads on which the reference saw that rule fire are discarded
# (the PP one instead runs the reference with empty batches dropped, as servesim does, since
# nearly every PP workload has one). Delete an entry when its fix lands.
# Differences with vLLM that a workload may show, each a ``vllm_ref`` event name; the
# differential test skips the workloads where the reference saw one. The four this test found
# (victim index, freeing order, empty batches in the queue, caching of in-flight tokens) are
# fixed; keep the mechanism for the next one, with a strict xfail in test_rules.py.
KNOWN_DIVERGENCES: set[str] = set()



def run_both(reqs, cfg, *, fast_paths=(True, False), **kw):
    """Reference vs servesim on one generated workload (inside a hypothesis test)."""
    config, specs = build(reqs, cfg, **kw)
    try:
        ref = simulate(config, specs)
    except Stall:
        reject()  # a workload vLLM itself cannot finish (none is known)
    if ref.events & KNOWN_DIVERGENCES:
        reject()
    for fast in fast_paths:
        real = run_servesim(config, specs, fast_path=fast)
        assert_same(ref, real, config, specs, f"fast_path={fast}")
    return ref


# The issue-12 fast-path divergence, in this test's format (arrival slot k = just before step
# k, max_model_len 128): at step 25 the decode-group fast path scheduled {r6: 1, r11: 4, r8: 1}
# where the exact loop (and vLLM) schedule {r6: 1, r11: 5, r8: 1}.
ISSUE12_REQS = [(0, 1, 1, 0, 0), (0, 1, 1, 0, 0), (0, 30, 20, 1, 3), (2, 1, 7, 3, 3),
                (0, 30, 13, 2, 3), (1, 2, 20, 0, 0), (2, 2, 12, 0, 2), (1, 11, 17, 1, 3),
                (7, 1, 3, 0, 3), (2, 1, 2, 1, 3), (3, 4, 1, 0, 2), (3, 37, 1, 2, 0)]
ISSUE12_CFG = {"block_size": 4, "extra_blocks": 19, "chunked": True, "max_num_seqs": 4,
               "max_num_batched_tokens": 15, "threshold": 5, "policy": "fcfs",
               "caching": True, "max_model_len": 128}
# Found by this test: the fast path freed two requests finishing in the same step in decode-
# group calendar order, not row order, so later LRU evictions (and a prefix hit) differed.
FREE_ORDER_REQS = [(0, 1, 1, 0, 0), (0, 1, 1, 0, 0), (0, 1, 1, 0, 0), (0, 1, 1, 0, 0),
                   (0, 1, 3, 0, 0), (0, 36, 5, 2, 0), (0, 20, 6, 0, 0), (0, 1, 1, 0, 0),
                   (0, 8, 2, 0, 0), (0, 1, 1, 0, 0), (0, 17, 1, 2, 0)]
FREE_ORDER_CFG = {"block_size": 8, "extra_blocks": 3, "chunked": True, "max_num_seqs": 2,
                  "max_num_batched_tokens": 10, "threshold": 5, "policy": "fcfs",
                  "caching": True, "max_model_len": 128}
# Found by this test: a request that preempts itself (PRIORITY victim = the current request)
# leaves an empty step; servesim then slept until the next arrival (here: forever).
SELF_PREEMPT_REQS = [(0, 1, 3, 0, 2), (1, 1, 3, 0, 1)]
SELF_PREEMPT_CFG = {"block_size": 2, "extra_blocks": 0, "chunked": True, "max_num_seqs": 2,
                    "max_num_batched_tokens": 2, "threshold": 0, "policy": "priority",
                    "caching": True, "max_model_len": 128}


@settings(max_examples=int(1000 * SCALE), **COMMON)
@given(st.lists(req_st, min_size=1, max_size=12), cfg_st)
@example(ISSUE12_REQS, ISSUE12_CFG)
@example(FREE_ORDER_REQS, FREE_ORDER_CFG)
@example(SELF_PREEMPT_REQS, SELF_PREEMPT_CFG)
def test_sync_matches_vllm_reference(reqs, cfg):
    """Sync scheduling (``EngineCore.step``), fast path and exact loop, against the reference
    with vLLM's default ``scheduler_reserve_full_isl=True``."""
    run_both(reqs, cfg)


@settings(max_examples=int(300 * SCALE), **COMMON)
@given(st.lists(req_st, min_size=1, max_size=12), cfg_st)
@example(ISSUE12_REQS, ISSUE12_CFG)  # these three were found without the admission check
@example(FREE_ORDER_REQS, FREE_ORDER_CFG)
@example(SELF_PREEMPT_REQS, SELF_PREEMPT_CFG)
def test_sync_without_full_isl_reservation(reqs, cfg):
    """``scheduler_reserve_full_isl=False``: admission checks only the first chunk."""
    run_both(reqs, cfg, reserve_full_isl=False)


@settings(max_examples=int(800 * SCALE), **COMMON)
@given(st.lists(req_st, min_size=1, max_size=12), cfg_st)
@example(ISSUE12_REQS, ISSUE12_CFG)
@example(SELF_PREEMPT_REQS, SELF_PREEMPT_CFG)
def test_async_matches_vllm_reference(reqs, cfg):
    """Async scheduling (``AsyncScheduler`` + ``step_with_batch_queue``, batch queue 2 deep),
    fast path and exact loop."""
    run_both(reqs, cfg, async_scheduling=True)


# Found by the long profile: requests stopping in one batch freed in running order, not row
# order, after a re-admission while the batch was in flight (async PP).
FREE_ROWS_REQS = [(0, 9, 20, 0, 1, False), (0, 44, 3, 0, 0, False), (8, 1, 19, 0, 0, False)]
FREE_ROWS_CFG = {"block_size": 2, "extra_blocks": 0, "max_num_seqs": 2,
                 "max_num_batched_tokens": 2, "threshold": 0, "policy": "priority",
                 "chunked": True, "caching": True, "max_model_len": 128}


@settings(max_examples=int(300 * SCALE), **COMMON)
@given(st.lists(req_st, min_size=1, max_size=10), cfg_st, st.sampled_from([2, 3, 4]),
       st.booleans())
@example(FREE_ROWS_REQS, FREE_ROWS_CFG, 4, True)
def test_pipeline_parallel_matches_vllm_reference(reqs, cfg, pp, async_scheduling):
    """Pipeline parallelism: the batch queue ``pp`` deep, each batch 1 s of latency holding a
    stage for 1/pp s. Sync PP advances computed tokens at schedule time and does not
    reschedule an in-flight decode; async PP reschedules decodes every micro-batch through
    output placeholders. (servesim runs PP on the exact loop only.)"""
    run_both(reqs, cfg, fast_paths=(False,), pp=pp, async_scheduling=async_scheduling)


# Long decodes among few requests, with arrivals spread out: the decode group runs alone for
# many steps (quiet steps: several batches back to back without a SimPy event, its members'
# counters and block calendar implicit), crosses many block boundaries (prefix-cached as they
# fill, then hit again by a recompute after a preemption in the tiny caches), and requests
# join and leave it mid-run.
long_req_st = requests(60, (1, 40), (20, 90))
long_cfg_st = cfg_st.map(lambda c: {**c, "max_model_len": 128, "caching": True})


@settings(max_examples=int(150 * SCALE), **COMMON)
@given(st.lists(long_req_st, min_size=1, max_size=6), long_cfg_st, st.booleans())
def test_long_decodes_match_vllm_reference(reqs, cfg, async_scheduling):
    """Sync and async scheduling on long decodes (quiet steps), fast path and exact loop."""
    run_both(reqs, cfg, async_scheduling=async_scheduling)
