"""A scheduler step's output (vLLM ``v1/core/sched/output.py``): :class:`SchedulerOutput`,
what ``Scheduler.schedule()`` decided, and :class:`QuietStep`, a quiet step's batch read
the same way by the engine's per-step consumers."""

from __future__ import annotations

from servesim.costmodels.batch import BatchShape
from servesim.simulator.request import Request


class SchedulerOutput:
    """One step's decisions.

    ``scheduled``: (request, num_new_tokens, num_computed_before) for explicitly scheduled rows, in
    order. ``num_group``: decode-group members that were scheduled one token each implicitly
    (fast steps only). ``shape``: the batch as the cost model sees it.
    """

    __slots__ = (
        "advanced",
        "fast",
        "group_members",
        "num_chunks",
        "num_group",
        "num_new_tokens",
        "preempted",
        "sampled",
        "sampled_tokens",
        "sampling",
        "scheduled",
        "scheduled_at",
        "seq",
        "shape",
        "spec_decoding_stats",
        "total_num_scheduled_tokens",
    )

    def __init__(self):
        self.scheduled: list[tuple[Request, int, int]] = []
        self.num_group = 0
        self.preempted: list[Request] = []
        self.shape: BatchShape | None = None
        self.total_num_scheduled_tokens = 0
        self.fast = False
        self.group_members: list[Request] | None = None  # only when recording schedules
        # True when num_computed_tokens advanced right after schedule() (several batches in
        # flight under pipeline parallelism), as vLLM's _update_after_schedule does; then
        # ``sampling[i]`` says whether row i returns a token (not a partial prefill chunk).
        self.advanced = False
        self.sampling: list[bool] | None = None
        self.scheduled_at: float | None = None  # engine time of the schedule() call
        self.seq = -1  # schedule() call number (set by _build_shape)
        # Requests of ``scheduled`` that got a token, in row order (set by update_from_output)
        self.sampled: list[Request] | None = None
        # Tokens this step generated (first tokens and decode-group members included; with
        # speculative decoding accepted + 1 per row): vLLM's iteration num_generation_tokens
        # (set by update_from_output)
        self.num_new_tokens = 0
        # speculative decoding: this step's vLLM SpecDecodingStats (update_from_output), and
        # ``sampled_tokens``: the tokens of each ``sampled`` row (unset without it: one each);
        # ``num_chunks``: SSE chunks the API server sent (set by it under stream_interval > 1)
        self.spec_decoding_stats = None

    def as_dict(self) -> dict[str, int]:
        """{request_id: num_scheduled_tokens} (tests; needs ``record_schedules``)."""
        d = {r.request_id: 1 for r in (self.group_members or ())}
        for r, n, _ in self.scheduled:
            d[r.request_id] = n
        return d


class QuietStep:
    """A quiet step's batch (``Scheduler.quiet_step``: the decode group alone, one token per
    member) as the engine's per-step consumers read a :class:`SchedulerOutput`; its counts
    double as its ``BatchShape``."""

    __slots__ = ("group_members", "num_decode", "num_group", "num_new_tokens", "num_sampled",
                 "num_tokens", "scheduled_at", "seq", "total_num_scheduled_tokens")

    fast = True
    advanced = False
    scheduled = ()
    sampled = ()
    preempted = ()
    num_spec_tokens = 0
    spec_decoding_stats = None
    as_dict = SchedulerOutput.as_dict

    def __init__(self, n: int, seq: int):
        self.num_decode = self.num_group = self.num_sampled = self.num_tokens = n
        self.num_new_tokens = self.total_num_scheduled_tokens = n
        self.seq = seq
        self.scheduled_at: float | None = None
        self.group_members: list[Request] | None = None

    @property
    def shape(self) -> QuietStep:
        return self
