"""``orca``: iteration-level scheduling (Yu et al., Orca, OSDI 2022; Vidur's ``orca``).

Rules, per step (one iteration):

1. Every running request gets its next token (after its prefill a request only decodes), in
   running order.
2. Then new requests join FCFS while ``len(running) < max_num_seqs``, each with its *whole*
   prompt in this iteration (no chunking; prefills and decodes share the iteration: Orca's
   selective batching). ``max_num_batched_tokens`` caps the prompt tokens that join one
   iteration, except that a prompt larger than the remaining budget joins when it is the
   iteration's first prompt (Orca itself has no token budget, only a batch size). The first
   request that does not fit (budget or KV) blocks the queue.

KV: whatever ``cache.allocator`` says; Orca reserved ``max_model_len`` per request, which is
``cache.allocator: contiguous``. With the paged allocator a decode that finds no free block
preempts the request admitted last (recompute), and nothing joins in that iteration.
``long_prefill_token_threshold`` and ``enable_chunked_prefill`` are ignored.
"""

from __future__ import annotations

from servesim.simulator.policies.base import PolicyScheduler
from servesim.simulator.scheduler_output import SchedulerOutput


class OrcaScheduler(PolicyScheduler):
    policy_name = "orca"
    whole_prompts = True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._decode_running(out, self.max_num_scheduled_tokens)
        if not out.preempted:
            self._admit_whole(out, budget)
        return self._finish(out)
