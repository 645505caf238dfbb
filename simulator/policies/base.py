"""Shared plumbing for the extra scheduler policies.

Every policy here is a :class:`~servesim.simulator.scheduler.Scheduler` (same request lifecycle,
``update_from_output``, KV calls and ``BatchShape``) that replaces the per-step decision, and
runs the exact per-request path (no decode-group fast path: its invariants are vLLM's
running-first order). Preemption is vLLM's: recompute, victim ``running.pop()`` (the request
admitted last), victims to the front of the waiting queue, no admission in a step that
preempted.
"""

from __future__ import annotations

from dataclasses import replace

from servesim.simulator.kv_cache import KVCacheManager
from servesim.simulator.request import Request
from servesim.simulator.scheduler import Scheduler, SchedulerParams
from servesim.simulator.scheduler_output import SchedulerOutput


class PolicyScheduler(Scheduler):
    """Base for policies that override :meth:`schedule`."""

    policy_name = "policy"
    # Prefill whole prompts: long_prefill_token_threshold and chunked prefill do not apply.
    whole_prompts = False

    def __init__(self, params: SchedulerParams, kv_cache_manager: KVCacheManager,
                 fast_path: bool = False, record_schedules: bool = False):
        super().__init__(replace(params, policy="fcfs"), kv_cache_manager, fast_path=False,
                         record_schedules=record_schedules)
        self.params = replace(params, policy=self.policy_name)
        if self.whole_prompts:
            self.threshold = 0
            self.chunked = False

    # -- helpers -------------------------------------------------------------------------------
    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> tuple[bool, int]:
        """``allocate_slots(req, n)``, preempting ``running.pop()`` until it fits.

        Returns (scheduled?, tokens refunded): a victim already scheduled this step is taken
        out of ``out.scheduled`` and its tokens returned to the budget. False when ``req``
        itself was preempted."""
        refund = 0
        running = self.running
        while self.kv.allocate_slots(req, n) is None:
            victim = running.pop()
            for j, (r, m, _) in enumerate(out.scheduled):
                if r is victim:
                    refund += m
                    del out.scheduled[j]
                    break
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False, refund
        return True, refund

    def _admit_whole(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests FCFS with their *whole* remaining prompt (no chunking) while
        ``len(running) < max_num_seqs``; stop at the first that does not fit (head-of-line).

        The token budget caps the step's prompts, except that a prompt larger than the
        remaining budget is admitted when it would be the step's first prompt (so a prompt
        longer than ``max_num_batched_tokens`` runs alone instead of never)."""
        waiting, running, kv = self.waiting, self.running, self.kv
        admitted = 0
        while len(waiting) and len(running) < self.max_num_running_reqs:
            req = waiting.peek_request()
            hits, num_computed = self._prefix_head_start(req)
            n = req.num_tokens - num_computed
            cap = self.max_model_len - 1 - num_computed
            n = min(n, cap) if cap > 0 else n
            if n > budget and admitted:
                break
            if kv.allocate_slots(req, n, num_computed - req.num_computed_tokens, hits) is None:
                break
            self._admit(out, n, num_computed)
            budget -= n
            admitted += 1
        return budget

    def _decode_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give every running request its remaining tokens (1 for a decode), in running order,
        preempting for blocks; returns the budget left."""
        for req in list(self.running):
            if req not in self.running:  # preempted as a victim this step
                continue
            n = self._clamp(req, 1 << 62)
            if n <= 0:
                continue
            ok, refund = self._allocate_or_preempt(req, n, out)
            budget += refund
            if not ok:
                break
            out.scheduled.append((req, n, req.num_computed_tokens))
            budget -= n
        return budget

    def _finish(self, out: SchedulerOutput) -> SchedulerOutput:
        out.total_num_scheduled_tokens = sum(n for _, n, _ in out.scheduled)
        self._build_shape(out)
        return out
