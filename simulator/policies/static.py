"""``static``: request-level (static) batching, as FasterTransformer served requests (Vidur's
``faster_transformer`` replica scheduler); the pre-Orca baseline.

Rules:

1. When nothing is running, a batch is formed: waiting requests join FCFS, up to
   ``max_num_seqs``, each with its whole prompt, all prefilled in the batch's first step (no
   token budget: FasterTransformer batches by count; ``max_num_batched_tokens`` is ignored);
   the first request whose KV does not fit closes the batch.
2. Then the batch decodes, one token per request per step, until *every* request in it has
   finished; finished requests leave (their KV is freed) but nobody joins until the batch is
   empty. (FasterTransformer also pads the batch to its longest request; the cost model sees
   only the live requests, so the padding compute is not charged: a favourable bound.)

A decode that finds no free KV block preempts the request admitted last (recompute); it
waits at the front of the queue for the next batch. ``long_prefill_token_threshold`` and
``enable_chunked_prefill`` are ignored.
"""

from __future__ import annotations

from servesim.simulator.policies.base import PolicyScheduler
from servesim.simulator.scheduler_output import SchedulerOutput


class StaticBatchScheduler(PolicyScheduler):
    policy_name = "static"
    whole_prompts = True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.running:
            self._decode_running(out, self.max_num_scheduled_tokens)
        else:
            self._admit_whole(out, 1 << 62)
        return self._finish(out)
