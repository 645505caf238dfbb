"""Drivers for scheduler conformance tests: :class:`Harness` steps a scheduler by hand (no
SimPy, no cost model, synchronous scheduling); :func:`run_engine` runs the real engine loop
(``Replica``: sync, async two-deep or pipeline batch queue) with a constant step time."""

from __future__ import annotations

import simpy
from servesim.simulator.engine import Replica
from servesim.simulator.recorder import Recorder
from servesim.simulator.registry import get_kv_allocator, get_scheduler
from servesim.simulator.request import Request
from servesim.simulator.scheduler import SchedulerParams
from servesim.workloads.schema import RequestSpec


class Harness:
    """Drive any registered scheduler policy on any registered KV allocator step by step."""

    def __init__(self, *, num_blocks=1000, block_size=16, max_num_seqs=256,
                 max_num_batched_tokens=2048, max_model_len=4096, threshold=0,
                 enable_caching=True, policy="fcfs", allocator="paged", fast_path=True,
                 chunked=True, reserve_full_isl=True, async_scheduling=False, **policy_kw):
        self.kv = get_kv_allocator(allocator)(num_blocks, block_size, enable_caching,
                                              max_model_len)
        params = SchedulerParams(max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens,
                                 max_model_len=max_model_len, block_size=block_size,
                                 long_prefill_token_threshold=threshold,
                                 enable_chunked_prefill=chunked, policy=policy,
                                 reserve_full_isl=reserve_full_isl,
                                 async_scheduling=async_scheduling)
        self.sched = get_scheduler(policy)(params, self.kv, fast_path=fast_path,
                                           record_schedules=True, **policy_kw)
        self.max_model_len = max_model_len
        self.now = 0.0
        self.n = 0
        self.finished: list[Request] = []
        self.itl_e: list = []
        self.itl_w: list = []
        self.reqs: dict[str, Request] = {}

    def make(self, rid, prompt_len, max_tokens, *, token_ids=None, prefix_ids=None, priority=0,
             arrival=None, eos_after=None) -> Request:
        """A request of ``max_tokens`` outputs (``ignore_eos``), or one that stops on EOS
        after ``eos_after`` outputs (``max_tokens``: what fits in max_model_len)."""
        t = self.now if arrival is None else arrival
        spec = RequestSpec(arrival_s=t, prompt_len=prompt_len,
                           output_len=max_tokens if eos_after is None else eos_after,
                           request_id=rid, ignore_eos=eos_after is None,
                           prompt_token_ids=tuple(token_ids) if token_ids is not None else None,
                           prefix_block_ids=tuple(prefix_ids) if prefix_ids else None,
                           priority=priority)
        r = Request(spec, self.n, self.max_model_len, t)
        self.n += 1
        self.reqs[rid] = r
        return r

    def add(self, rid, prompt_len, max_tokens, **kw) -> Request:
        r = self.make(rid, prompt_len, max_tokens, **kw)
        self.sched.add_request(r)
        return r

    def step(self, dt=1.0):
        out = self.sched.schedule()
        self.now += dt
        done = self.sched.update_from_output(out, self.now, dt, self.itl_e, self.itl_w)
        for r in done:
            r.finish_time = self.now
        self.finished.extend(done)
        return out

    def run(self, max_steps=100000):
        """Run until idle; return the list of per-step {request_id: n} dicts."""
        steps = []
        while self.sched.has_unfinished_requests() and len(steps) < max_steps:
            out = Harness.step(self)
            steps.append(out.as_dict())
        return steps


def run_engine(arrivals, *, async_scheduling=False, step_s=1.0, pp=1, **harness_kw):
    """Run ``arrivals`` — (time, request_id, prompt_len, max_tokens[, Harness.make kwargs]) —
    through the real engine loop with every batch taking ``step_s``. Returns the harness
    (requests in ``h.reqs``, finished ones in ``h.finished``) and the engine's trace:
    [(time scheduled, {request_id: tokens}, [preempted ids])] per non-empty batch."""
    h = Harness(async_scheduling=async_scheduling, **harness_kw)
    env = simpy.Environment()
    step = step_s if callable(step_s) else (lambda shape: step_s)  # or a cost model
    rep = Replica(env, h.sched, step, Recorder(), h.finished.append,
                  max_concurrent_batches=pp, async_scheduling=async_scheduling)
    rep.trace = []

    def arrive():
        for a in sorted(arrivals, key=lambda a: a[0]):
            t, rid, p, m = a[:4]
            if t > env.now:
                yield env.timeout(t - env.now)
            h.now = env.now
            rep.add_request(h.make(rid, p, m, **(a[4] if len(a) > 4 else {})))

    env.process(arrive())
    env.run()
    h.now = env.now
    return h, rep.trace
