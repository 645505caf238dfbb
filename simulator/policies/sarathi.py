"""``sarathi``: Sarathi-Serve stall-free batching (Agrawal et al., OSDI 2024, arXiv 2403.02310),
as its vLLM-v0-based implementation and Vidur's ``sarathi`` replica scheduler run it.

Rules, per step, with token budget ``max_num_batched_tokens`` (Sarathi's "token budget"):

1. Decodes first: every running request one token behind gets its token, in running order.
2. Then ongoing (partially computed) prefills, in running order, each a chunk of
   ``min(remaining, budget left)`` tokens (also clamped by ``long_prefill_token_threshold``).
3. Then new requests, FCFS, while ``len(running) < max_num_seqs`` and budget remains, each with
   a chunk that fills the rest of the budget (several prompts may join one step). Admission
   reserves KV blocks for the *whole* prompt (vLLM v0's ``can_allocate``) and keeps a watermark
   of ``WATERMARK`` (1%) of the blocks free; the first request that does not fit blocks the
   queue (head-of-line).

Prefill is always chunked (``enable_chunked_prefill`` is ignored). When a decode cannot get a
block, the request admitted last is preempted (recompute), and nothing is admitted that step.

How this differs from vLLM V1 ``fcfs`` (which adopted chunked prefill from Sarathi): V1 serves
running requests purely in admission order (a prefill ahead of a decode in ``running`` takes
its chunk first) and allocates KV chunk by chunk, with no watermark. So the two agree on light
load and differ when KV is tight (V1 admits more prompts, then preempts more).
"""

from __future__ import annotations

from servesim.simulator.policies.base import PolicyScheduler
from servesim.simulator.scheduler_output import SchedulerOutput

WATERMARK = 0.01  # vLLM v0 BlockSpaceManager watermark, as a fraction of the GPU blocks


class SarathiScheduler(PolicyScheduler):
    policy_name = "sarathi"

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.chunked = True
        self.watermark_blocks = int(WATERMARK * self.kv.num_gpu_blocks)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_scheduled_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        stop = False
        for group in (decodes, prefills):
            for req in group:
                if budget <= 0 or stop:
                    break
                if req not in self.running:  # preempted as a victim this step
                    continue
                n = self._clamp(req, budget)
                if n <= 0:
                    continue
                ok, refund = self._allocate_or_preempt(req, n, out)
                budget += refund
                if not ok:
                    stop = True
                    break
                out.scheduled.append((req, n, req.num_computed_tokens))
                budget -= n
        if not out.preempted:
            self._admit_new(out, budget)
        return self._finish(out)

    def _admit_new(self, out: SchedulerOutput, budget: int) -> None:
        waiting, running, kv = self.waiting, self.running, self.kv
        bs = self.block_size
        while len(waiting) and budget > 0 and len(running) < self.max_num_running_reqs:
            req = waiting.peek_request()
            hits, num_computed = self._prefix_head_start(req)
            remaining = req.num_tokens - num_computed
            n = remaining
            if 0 < self.threshold < n:
                n = self.threshold
            n = min(n, budget)
            whole = -(-min(req.num_tokens, self.max_model_len) // bs) - len(hits)
            if kv.get_num_free_blocks() - whole < self.watermark_blocks:
                break
            if kv.allocate_slots(req, n, num_computed - req.num_computed_tokens, hits,
                                 num_lookahead_tokens=remaining - n) is None:
                break
            self._admit(out, n, num_computed)
            budget -= n
