"""A step-by-step driver for scheduler conformance tests (no SimPy, no cost model)."""

from __future__ import annotations

from servesim.simulator.registry import get_kv_allocator, get_scheduler
from servesim.simulator.request import Request
from servesim.simulator.scheduler import SchedulerParams
from servesim.workloads.schema import RequestSpec


class Harness:
    """Drive any registered scheduler policy on any registered KV allocator step by step."""

    def __init__(self, *, num_blocks=1000, block_size=16, max_num_seqs=256,
                 max_num_batched_tokens=2048, max_model_len=4096, threshold=0,
                 enable_caching=True, policy="fcfs", allocator="paged", fast_path=True,
                 chunked=True, **policy_kw):
        self.kv = get_kv_allocator(allocator)(num_blocks, block_size, enable_caching,
                                              max_model_len)
        params = SchedulerParams(max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens,
                                 max_model_len=max_model_len, block_size=block_size,
                                 long_prefill_token_threshold=threshold,
                                 enable_chunked_prefill=chunked, policy=policy)
        self.sched = get_scheduler(policy)(params, self.kv, fast_path=fast_path,
                                           record_schedules=True, **policy_kw)
        self.max_model_len = max_model_len
        self.now = 0.0
        self.n = 0
        self.finished: list[Request] = []
        self.itl_e: list = []
        self.itl_w: list = []
        self.reqs: dict[str, Request] = {}

    def add(self, rid, prompt_len, max_tokens, *, token_ids=None, prefix_ids=None, priority=0,
            arrival=None):
        spec = RequestSpec(arrival_s=self.now if arrival is None else arrival,
                           prompt_len=prompt_len, output_len=max_tokens, request_id=rid,
                           prompt_token_ids=tuple(token_ids) if token_ids is not None else None,
                           prefix_block_ids=tuple(prefix_ids) if prefix_ids else None,
                           priority=priority)
        r = Request(spec, self.n, self.max_model_len, self.now if arrival is None else arrival)
        self.n += 1
        self.reqs[rid] = r
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
        while self.sched.has_requests() and len(steps) < max_steps:
            out = Harness.step(self)
            steps.append(out.as_dict())
        return steps
