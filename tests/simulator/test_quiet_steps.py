"""Quiet steps (decode group only, advanced back to back) and inline stepping (no SimPy event
per step) change nothing: a run gives the same records, bit for bit, as one stepping every
batch through ``schedule()`` / ``update_from_output`` and yielding to SimPy every step."""

import numpy as np
import pytest
import simpy
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.runner import run_experiment
from servesim.simulator.scheduler import Scheduler

CASES = [
    ["workload.num_prompts=150", "workload.request_rate=10"],
    ["workload.num_prompts=150", "workload.request_rate=10", "scheduler.async_scheduling=false"],
    ["workload.num_prompts=200", "workload.request_rate=inf"],
    ["workload.num_prompts=150", "workload.request_rate=20", "cache.num_gpu_blocks_override=300",
     "model.max_model_len=4800"],
    ["workload.num_prompts=150", "workload.request_rate=20", "cache.num_gpu_blocks_override=300",
     "model.max_model_len=4800", "scheduler.async_scheduling=false"],
    ["workload.num_prompts=100", "workload.max_concurrency=8", "workload.request_rate=inf"],
    ["workload.kind=sessions", "workload.num_sessions=15", "workload.turns=3",
     "workload.session_rate=1"],
    ["workload.num_prompts=150", "workload.request_rate=20", "parallel.data_parallel_size=2"],
    # without the API-server frontend; client timeouts (aborts) and retries; load stages with
    # warm-up and a grace period; the CPU offload tier (every caching step eager);
    # pipeline parallelism (inline stepping only)
    ["workload.num_prompts=150", "workload.request_rate=10", "frontend.enable=false"],
    ["workload.num_prompts=150", "workload.request_rate=10", "frontend.enable=false",
     "scheduler.async_scheduling=false"],
    ["workload.num_prompts=120", "workload.input_len=1024", "workload.output_len=60",
     "workload.request_rate=12", "client.request_timeout_s=2", "client.max_retries=1",
     "scheduler.max_num_seqs=32"],
    ["workload.num_prompts=150", "workload.input_len=400", "workload.output_len=120",
     ("workload.stages=[{rate: 10, num_requests: 50}, {concurrency: 12, duration_s: 5, "
     "grace_s: 1}]"), "workload.warmup={num_requests: 3}"],
    ["workload.kind=sessions", "workload.num_sessions=15", "workload.turns=3",
     "workload.session_rate=2", "cache.num_gpu_blocks_override=500", "model.max_model_len=8000",
     "cache.kv_offload={cpu_bytes: 2GiB}"],
    ["workload.num_prompts=100", "workload.request_rate=10", "parallel.pipeline_parallel_size=2"],
]
NO_QUIET = ("parallel.data_parallel_size=2", "parallel.pipeline_parallel_size=2")


def _run(overrides, plain: bool, monkeypatch):
    cfg = resolve_config(load_config(None, overrides))
    steps = {"quiet": 0}
    orig = Scheduler.quiet_step

    def counted(self, *a, **k):
        steps["quiet"] += 1
        return orig(self, *a, **k)

    with monkeypatch.context() as m:
        if plain:  # every step through schedule(), every step a SimPy event
            m.setattr(Scheduler, "quiet_steps", lambda self: 0)
            m.setattr(simpy.Environment, "peek", lambda self: -np.inf)
        else:
            m.setattr(Scheduler, "quiet_step", counted)
        r = run_experiment(cfg, resolved=True)
    return r, steps["quiet"]


@pytest.mark.parametrize("overrides", CASES)
def test_quiet_and_inline_steps_give_identical_records(overrides, monkeypatch):
    fast, n_quiet = _run(overrides, False, monkeypatch)
    plain, _ = _run(overrides, True, monkeypatch)
    for k, v in plain.requests.items():
        assert np.array_equal(np.asarray(v), np.asarray(fast.requests[k]),
                              equal_nan=np.asarray(v).dtype.kind == "f"), k
    for k, v in plain.steps.items():
        assert np.array_equal(v, fast.steps[k]), k
    assert np.array_equal(plain.itl_values, fast.itl_values)
    assert np.array_equal(plain.itl_counts, fast.itl_counts)
    assert {k: v for k, v in plain.counters.items() if k != "wall_seconds"} == \
        {k: v for k, v in fast.counters.items() if k != "wall_seconds"}
    for (name, a), (_, b) in zip(plain.instances, fast.instances):
        for k, v in a.steps.items():
            assert np.array_equal(v, b.steps[k]), (name, k)
    if not any(o in NO_QUIET for o in overrides):
        assert n_quiet > 0  # the path under test was taken


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_batch_shape_contexts_match_the_exact_loop(async_scheduling):
    """A cost model reading every ``BatchShape`` field a plugin may use, the decode contexts'
    sum and maximum included (``decode_context_max``: split-KV heuristics), sees the same
    shapes from the decode group (its contexts kept implicitly: a running sum and a heap of
    join-time contexts, pruned as members leave) as from the per-request loop: hundreds of
    requests joining and leaving give identical batches and times."""
    import random

    from harness import run_engine

    rng = random.Random(5)
    arrivals = [(round(rng.uniform(0, 4), 3), f"r{i}", rng.randint(1, 300),
                 rng.randint(1, 120)) for i in range(400)]

    def cost(shape):
        return (2e-3 + 1e-6 * shape.num_tokens + 3e-7 * shape.decode_context_sum
                + 2e-6 * shape.decode_context_max + 1e-5 * shape.num_decode)

    kw = {"async_scheduling": async_scheduling, "step_s": cost, "block_size": 16,
          "num_blocks": 4000, "max_num_seqs": 64, "max_num_batched_tokens": 512,
          "max_model_len": 1024}
    h_fast, t_fast = run_engine(arrivals, fast_path=True, **kw)
    h_exact, t_exact = run_engine(arrivals, fast_path=False, **kw)
    assert t_fast == t_exact
    assert {r: (q.first_token_time, q.finish_time) for r, q in h_fast.reqs.items()} == {
        r: (q.first_token_time, q.finish_time) for r, q in h_exact.reqs.items()}
    assert max(len(b[1]) for b in t_exact) > 8  # decodes batched together
