"""vLLM V1 scheduler (``v1/core/sched/scheduler.py``), policies ``fcfs`` and ``priority``.

``schedule()`` follows vLLM v0.22 line by line (course digest §2):

Phase A, RUNNING first, in ``running`` order while budget remains::

    n = num_tokens - num_computed_tokens
    if 0 < long_prefill_token_threshold < n: n = long_prefill_token_threshold
    n = min(n, token_budget)
    n = min(n, max_model_len - 1 - num_computed_tokens)
    allocate_slots(req, n) or preempt: FCFS victim running.pop(), PRIORITY victim
    max(running, key=(priority, arrival_time)); victims go to the front of waiting with
    num_computed_tokens = 0 (outputs kept); if the victim is the request itself, stop.

Phase B, WAITING, only if nothing was preempted this step: while budget remains and
``len(running) < max_num_seqs``: peek the head, prefix-cache head start (``get_computed_blocks``),
``n = num_tokens - computed`` clamped by the threshold and the budget, ``allocate_slots`` (with
``full_sequence_must_fit``: the whole sequence must fit) or stop (head-of-line blocking).
Without chunked prefill, a head that does not fit the budget stops the loop too.

Async scheduling (vLLM's default): outputs in flight count as placeholders in the clamp, and a
request whose output in flight reaches ``max_tokens`` is skipped; with one batch in flight the
engine advances counters at schedule time and applies stops a batch later
(``update_from_output(defer=True)`` / ``finish_pending``), with several (pipeline parallelism)
``advance_after_schedule`` keeps vLLM's placeholders literally. The full list of vLLM rules
modelled, with their source functions, is in ``DEVELOPERS.md``.

Speed (DESIGN §7: hot loops touch running sums, not per-request objects): requests in steady
decode — exactly one token behind — form the *decode group*. As long as every member gets its
one token in a step (enough budget, enough free blocks: checked before anything changes), the
group's counters advance implicitly with a step counter; only members that cross a block
boundary (a new block every ``block_size`` steps) or finish (a finish calendar) are touched.
Any other step runs the exact per-request loop above on materialised counters. Both paths make
identical decisions; ``tests/simulator/test_properties.py`` checks it on random workloads.
"""

from __future__ import annotations

import heapq
from bisect import insort
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

from servesim.costmodels.batch import BatchShape
from servesim.simulator.kv_cache import KVCacheManager
from servesim.simulator.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerParams:
    """The engine arguments a scheduler policy reads (vLLM ``SchedulerConfig`` names)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    # vLLM ``scheduler_reserve_full_isl``: admit a new or resumed request only when the free
    # blocks cover its whole sequence so far, not only its first chunk.
    reserve_full_isl: bool = True
    # vLLM ``async_scheduling`` (``AsyncScheduler``): outputs in flight are placeholders.
    async_scheduling: bool = False


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
        "num_group",
        "preempted",
        "sampling",
        "scheduled",
        "scheduled_at",
        "shape",
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

    def as_dict(self) -> dict[str, int]:
        """{request_id: num_scheduled_tokens} (tests; needs ``record_schedules``)."""
        d = {r.request_id: 1 for r in (self.group_members or ())}
        for r, n, _ in self.scheduled:
            d[r.request_id] = n
        return d


class _FCFSQueue(deque):
    """FCFS waiting queue: a deque (victims are prepended); ``len`` and membership in C."""

    add_request = deque.append
    prepend_request = deque.appendleft
    pop_request = deque.popleft

    def peek_request(self) -> Request:
        return self[0]


class _PriorityQueue:
    """PRIORITY waiting queue: a heap ordered as vLLM's ``Request.__lt__``:
    (priority, arrival_time, request_id) — ids compare as strings."""

    def __init__(self):
        self._heap: list[tuple[int, float, str, int, Request]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def add_request(self, req: Request) -> None:
        heapq.heappush(self._heap,
                       (req.priority, req.arrival_time, req.request_id, req.index, req))

    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0][4]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[4]

    def __contains__(self, req: Request) -> bool:
        return any(e[4] is req for e in self._heap)

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[4] is not req]
        heapq.heapify(self._heap)


def _WaitingQueue(priority: bool):  # (a factory where a class used to be)
    """FCFS: a deque (victims are prepended). PRIORITY: a heap ordered as vLLM's
    ``Request.__lt__``: (priority, arrival_time, request_id) — ids compare as strings."""
    return _PriorityQueue() if priority else _FCFSQueue()


class Scheduler:
    """vLLM V1 ``Scheduler``: ``policy == "priority"`` orders waiting requests and picks
    victims by (priority, arrival); any other name behaves as ``fcfs`` (subclasses that keep
    vLLM's decisions but change one rule register under their own names)."""

    def __init__(self, params: SchedulerParams, kv_cache_manager: KVCacheManager,
                 fast_path: bool = True, record_schedules: bool = False):
        self.params = params
        self.kv = kv_cache_manager
        self.priority = params.policy == "priority"
        self.waiting = _WaitingQueue(self.priority)
        self.running: list[Request] = []
        self.max_num_running_reqs = params.max_num_seqs
        self.max_num_scheduled_tokens = params.max_num_batched_tokens
        self.max_model_len = params.max_model_len
        self.block_size = params.block_size
        self.threshold = params.long_prefill_token_threshold
        self.chunked = params.enable_chunked_prefill
        self.reserve_full_isl = params.reserve_full_isl
        self.fast_path = fast_path
        self.record_schedules = record_schedules
        self.num_preemptions = 0
        self._run_seq = 0  # admission counter: running order as a sort key
        # Decode group (fast path) state.
        self._k = 0  # fast-step counter: members' counters are stale by (_k - d_mark)
        self._group: dict[Request, None] = {}
        self._partials: list[Request] = []  # running requests not in the group, in order
        self._alloc_buckets: list[set[Request]] = [set() for _ in range(self.block_size)]
        # Members whose decode fills blocks of shareable content (a session's prefix ids run
        # on into its output): cached eagerly, by step mod block_size.
        self._cache_buckets: list[set[Request]] = [set() for _ in range(self.block_size)]
        self._finish_at: dict[int, list[Request]] = {}
        self._ctx_sum = 0  # Σ (num_computed + 1) over members at step _k
        self._ctx_heap: list[tuple[int, int, int, Request]] = []
        self._last_fast_end = float("nan")

    # ------------------------------------------------------------------------------------------
    # Queue management
    def add_request(self, req: Request) -> None:
        self.waiting.add_request(req)

    def has_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------------------------------
    # Decode group bookkeeping
    def _target_outputs(self, req: Request) -> tuple[int, RequestStatus]:
        """Outputs after which ``req`` stops, and how (EOS is checked before length)."""
        t = req.target
        if t is None:
            cap = min(req.max_tokens, self.max_model_len - req.prompt_len)
            if req.eos_after is not None and req.eos_after <= cap:
                t = req.eos_after, RequestStatus.FINISHED_STOPPED
            else:
                t = cap, RequestStatus.FINISHED_LENGTH_CAPPED
            req.target = t
        return t

    def _join(self, req: Request) -> None:
        """Add a running request that is exactly one token behind to the decode group."""
        k = self._k
        bs = self.block_size
        c0 = req.num_computed_tokens
        req.d_mark = k
        req.d_computed = c0
        self._group[req] = None
        self._alloc_buckets[(k - c0) % bs].add(req)
        if req.num_shared_blocks(bs) > c0 // bs:
            self._cache_buckets[(k - c0 - 1) % bs].add(req)
        target, _ = self._target_outputs(req)
        fin = k + target - req.num_output_tokens - 1
        lst = self._finish_at.get(fin)
        if lst is None:
            self._finish_at[fin] = [req]
        else:
            lst.append(req)
        self._ctx_sum += c0 + 1
        heap = self._ctx_heap
        heapq.heappush(heap, (k - c0, req.index, k, req))
        if len(heap) > 2 * len(self._group) + 64:  # drop entries of members that left
            self._ctx_heap = [e for e in heap if e[3].d_mark == e[2]]
            heapq.heapify(self._ctx_heap)

    def _sync(self, req: Request) -> None:
        """Materialise a member's counters and take it out of the group."""
        j = self._k - req.d_mark
        bs = self.block_size
        if j:
            req.num_computed_tokens += j
            req.num_tokens += j
            req.num_output_tokens += j
            req.last_token_time = self._last_fast_end
            # Each of those steps cached the blocks its token filled (eager caching at
            # allocation); decode blocks hold request-unique content, so the count is all.
            req.num_cached_blocks = req.num_computed_tokens // bs
        self._alloc_buckets[(req.d_mark - req.d_computed) % bs].discard(req)
        self._cache_buckets[(req.d_mark - req.d_computed - 1) % bs].discard(req)
        self._ctx_sum -= req.num_computed_tokens + 1
        del self._group[req]
        req.d_mark = -1

    def _dissolve_group(self) -> None:
        """Materialise every member (before an exact step)."""
        for req in list(self._group):
            self._sync(req)
        self._finish_at.clear()
        self._ctx_heap.clear()
        self._ctx_sum = 0
        self._partials = [r for r in self.running if r.d_mark < 0]

    def _group_ctx_max(self) -> int:
        heap = self._ctx_heap
        while heap:
            neg_off, _, mark, req = heap[0]
            if req.d_mark == mark:
                return self._k - neg_off + 1
            heapq.heappop(heap)
        return 0

    # ------------------------------------------------------------------------------------------
    # Quiet steps (the engine advances several in one event)
    def quiet_steps(self) -> int:
        """Whether the next steps are *quiet* (0 when not, else a large count): ``schedule()``
        would take the fast path with the decode group alone: no partial row (the only
        partials allowed are requests whose stop is in flight at ``max_tokens``, which vLLM's
        async scheduler skips), nothing to admit (the waiting queue is empty or the running
        seats are full, so vLLM's waiting loop stops before looking at it). Free blocks for
        members crossing a block boundary are checked step by step
        (:meth:`quiet_blocks_ok`). Such a step changes nothing but the group's counters and,
        at the calendar's steps, finishes members (:meth:`quiet_step`), so the engine may run
        them back to back (``Replica``), re-checking after every step."""
        if not self._group:
            return 0
        for r in self._partials:
            if r.stop_pending is None or r.num_output_tokens < r.max_tokens:
                return 0
        if len(self.waiting) and len(self.running) < self.max_num_running_reqs:
            return 0
        if len(self._group) > self.max_num_scheduled_tokens:
            return 0
        return 1 << 62

    def quiet_blocks_ok(self) -> bool:
        """Whether the free blocks cover this quiet step's block-boundary members."""
        return len(self._alloc_buckets[self._k % self.block_size]) <= \
            self.kv.get_num_free_blocks()

    def quiet_shape(self) -> tuple[int, int, int]:
        """(num_decode, decode_context_sum, decode_context_max) of this quiet step's batch."""
        return len(self._group), self._ctx_sum, self._group_ctx_max()

    def quiet_step(self, end: float, itl_dt: float, itl_weighted: list,
                   defer: bool = False) -> tuple[int, list[Request]]:
        """Apply one quiet step, as ``schedule()`` + ``update_from_output(defer=defer)`` would:
        members at a block boundary get their block (running order), shareable full blocks
        are indexed, the group's counters advance, members whose last output this is finish
        (``defer``: their stop is pending, as in ``update_from_output``); the step ends at
        ``end``, ``itl_dt`` after the previous output. Returns (rows scheduled, the requests
        that finished)."""
        k = self._k
        bs = self.block_size
        bucket = self._alloc_buckets[k % bs]
        if bucket:
            self.kv.append_decode_blocks(
                sorted(bucket, key=_by_run_seq) if len(bucket) > 1 else list(bucket))
        cache = self._cache_buckets[k % bs]
        if cache and self.kv.enable_caching:
            self._cache_members(cache, k)
        n = len(self._group)
        self._k = k + 1
        self._ctx_sum += n
        self._last_fast_end = end
        itl_weighted.append((itl_dt, n))
        finished: list[Request] = []
        cal = self._finish_at.pop(k, None)
        if cal:
            for req in cal:
                if req.d_mark < 0:
                    continue
                self._sync(req)
                _, status = self._target_outputs(req)
                if defer:  # it stays running, explicitly (partials are in running order)
                    req.stop_pending = status
                    insort(self._partials, req, key=_by_run_seq)
                else:
                    req.status = status
                finished.append(req)
            if finished and not defer:
                self._remove_finished(finished, end)
        return n, finished

    def _cache_members(self, cache: set[Request], k: int) -> None:
        bs = self.block_size
        kv = self.kv
        for r in list(cache):
            num_full = (r.d_computed + k - r.d_mark + 1) // bs
            if num_full > r.num_cached_blocks:
                kv.cache_blocks(r, num_full)
            if num_full >= r.num_shared_blocks(bs):
                cache.discard(r)

    # ------------------------------------------------------------------------------------------
    def _clamp(self, req: Request, budget: int) -> int:
        """Tokens to schedule for a running request (vLLM's running loop, in order): what it
        lacks (outputs in flight count as placeholders), the long-prefill threshold, the
        budget, ``max_model_len − 1 − computed``. 0 when async scheduling already has the
        output that reaches ``max_tokens`` in flight (vLLM skips such a request)."""
        ph = req.num_output_placeholders
        if ph and req.num_computed_tokens + 2 - ph >= req.prompt_len + req.max_tokens:
            return 0  # several batches in flight (pipeline parallelism)
        if req.num_output_tokens >= req.max_tokens:
            return 0  # one batch in flight: its counters already hold that output
        n = req.num_tokens + ph - req.num_computed_tokens
        if 0 < self.threshold < n:
            n = self.threshold
        if n > budget:
            n = budget
        cap = self.max_model_len - 1 - req.num_computed_tokens
        return cap if n > cap else n

    def _blocks_needed(self, req: Request, n: int) -> int:
        need = req.num_computed_tokens + n
        if need > self.max_model_len:
            need = self.max_model_len
        return -(-need // self.block_size) - len(req.block_ids)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_scheduled_tokens
        fast = self.fast_path and self._group and self._try_fast_running(out, budget)
        if fast:
            budget -= out.total_num_scheduled_tokens
        else:
            if self._group:
                self._dissolve_group()
            budget = self._schedule_running_exact(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.fast = bool(fast)
        self._build_shape(out)
        return out

    def _try_fast_running(self, out: SchedulerOutput, budget: int) -> bool:
        """Phase A when every decode-group member gets its token; False (and nothing changed)
        when that cannot be guaranteed, so the exact loop runs instead."""
        n_group = len(self._group)
        partials = self._partials
        # Budget: members must not be starved. Sufficient: everything fits, or all partial rows
        # come after every member in ``running`` (then members are served first).
        plan: list[tuple[Request, int]] = []
        plan_blocks = 0
        if partials:
            clamp = self._clamp
            wants = [clamp(r, 1 << 62) for r in partials]
            if n_group + sum(wants) > budget:
                running = self.running
                # (partials are in running order: they are its tail iff the first is there)
                if n_group > budget or running[len(running) - len(partials)] is not partials[0]:
                    return False
            left = budget - n_group
            bs = self.block_size
            mml = self.max_model_len
            for r, n in zip(partials, wants):
                if left <= 0:
                    break
                if n > 0:  # (_clamp with the budget left: the same, capped by it)
                    if n > left:
                        n = left
                    plan.append((r, n))
                    left -= n
                    need = r.num_computed_tokens + n
                    nb = -(-(need if need < mml else mml) // bs) - len(r.block_ids)
                    if nb > 0:
                        plan_blocks += nb
        elif n_group > budget:
            return False
        # Blocks: all allocations must succeed without preemption.
        k = self._k
        bucket = self._alloc_buckets[k % self.block_size]
        if len(bucket) + plan_blocks > self.kv.get_num_free_blocks():
            return False
        # Commit: new blocks are handed out in running order, as the exact loop does (block
        # ids decide where a later free puts which cached block in the LRU queue).
        kv = self.kv
        if bucket:
            members = sorted(bucket, key=_by_run_seq) if len(bucket) > 1 else list(bucket)
            if plan_blocks:  # members and partial rows interleave in running order
                i = 0
                nm = len(members)
                for r, n in plan:  # (plan rows are in running order)
                    seq = r.run_seq
                    j = i
                    while j < nm and members[j].run_seq < seq:
                        j += 1
                    if j > i:
                        kv.append_decode_blocks(members[i:j])
                        i = j
                    kv.allocate_slots(r, n)
                if i < nm:
                    kv.append_decode_blocks(members[i:] if i else members)
            else:
                kv.append_decode_blocks(members)
        # Members' newly full blocks of request-unique content are cached implicitly (their
        # num_cached_blocks is brought up to date when they leave the group, ``_sync``);
        # shareable ones (sessions) are indexed now, as at any allocation.
        cache = self._cache_buckets[k % self.block_size]
        if cache and kv.enable_caching:
            self._cache_members(cache, k)
        out.num_group = n_group
        total = n_group
        allocated = bucket and plan_blocks
        scheduled = out.scheduled
        for r, n in plan:
            if not allocated:
                kv.allocate_slots(r, n)
            scheduled.append((r, n, r.num_computed_tokens))
            total += n
        out.total_num_scheduled_tokens = total
        if self.record_schedules:
            out.group_members = sorted(self._group, key=_by_index)
        return True

    def _schedule_running_exact(self, out: SchedulerOutput, budget: int) -> int:
        running = self.running
        kv = self.kv
        scheduled = out.scheduled
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = self._clamp(req, budget)
            if n <= 0:
                i += 1
                continue
            while True:
                new_blocks = kv.allocate_slots(req, n)
                if new_blocks is not None:
                    break
                if self.priority:
                    victim = max(running, key=_priority_key)  # first of the tied, as vLLM
                    vi = running.index(victim)
                    running.pop(vi)
                    if vi < i:  # already scheduled this step: give its tokens back
                        for j, (r, m, _) in enumerate(scheduled):
                            if r is victim:
                                budget += m
                                del scheduled[j]
                                break
                        i -= 1
                else:
                    victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if new_blocks is None:
                break
            scheduled.append((req, n, req.num_computed_tokens))
            budget -= n
            i += 1
        # (vLLM advances num_computed_tokens in _update_after_schedule; update_from_output
        # does it here, from the (request, n, computed_before) records.)
        out.total_num_scheduled_tokens = sum(n for _, n, _ in scheduled)
        return budget

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(req)
        if req in self._partials:
            self._partials.remove(req)

    def _prefix_head_start(self, req: Request) -> tuple[list, int]:
        """(hit blocks, computed tokens) for the waiting head: a prefix-cache lookup when it
        has no computed tokens (new or preempted), as vLLM's schedule() does."""
        if req.num_computed_tokens == 0:
            return self.kv.get_computed_blocks(req)
        return [], req.num_computed_tokens

    def _admit(self, out: SchedulerOutput, n: int, num_computed: int) -> Request:
        """Move the head of ``waiting`` to ``running``, scheduled for ``n`` new tokens after
        ``num_computed`` (prefix hits); its KV slots are already allocated."""
        req = self.waiting.pop_request()
        self.running.append(req)
        req.run_seq = self._run_seq
        self._run_seq += 1
        self._partials.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
        out.scheduled.append((req, n, num_computed))
        out.total_num_scheduled_tokens += n
        return req

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """vLLM's waiting loop: head of the queue only (head-of-line blocking); without
        chunked prefill a head that does not fit the budget stops the loop (``break``); with
        ``reserve_full_isl`` the whole sequence must fit in free blocks
        (``allocate_slots(full_sequence_must_fit=True)``)."""
        waiting = self.waiting
        running = self.running
        kv = self.kv
        full = self.reserve_full_isl
        while len(waiting) and budget > 0:
            if len(running) == self.max_num_running_reqs:
                break
            req = waiting.peek_request()
            hits, num_computed = self._prefix_head_start(req)
            n = req.num_tokens - num_computed
            if 0 < self.threshold < n:
                n = self.threshold
            if n > budget:
                if not self.chunked:
                    break
                n = budget
            if kv.allocate_slots(req, n, num_computed - req.num_computed_tokens, hits, 0,
                                 full) is None:
                break
            self._admit(out, n, num_computed)
            budget -= n

    def _build_shape(self, out: SchedulerOutput) -> None:
        nd = out.num_group
        ctx_sum = self._ctx_sum if nd else 0
        ctx_max = self._group_ctx_max() if nd else 0
        pre_new: list[int] = []
        pre_ctx: list[int] = []
        # The model runner computes logits for every scheduled row (partial prefill chunks
        # included; their token is discarded): ``logits_indices = query_start_loc[1:] - 1``.
        sampled = nd + len(out.scheduled)
        for req, n, c in out.scheduled:
            if n == 1:
                nd += 1
                ctx_sum += c + 1
                if c + 1 > ctx_max:
                    ctx_max = c + 1
            else:
                pre_new.append(n)
                pre_ctx.append(c)
        out.shape = BatchShape(nd, ctx_sum, ctx_max, tuple(pre_new), tuple(pre_ctx), sampled)

    # ------------------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, now: float, dt: float,
                           itl_explicit: list, itl_weighted: list,
                           defer: bool = False) -> list[Request]:
        """Advance counters after the step that ends at ``now`` (``dt`` after the previous
        step ended); return the requests that finished. ITL samples go to ``itl_explicit``
        (single values) and ``itl_weighted`` ((value, count) pairs).

        ``defer`` (async scheduling, one batch in flight): called right after ``schedule()``
        with the batch's known end time, so the next ``schedule()`` sees this batch's outputs
        as vLLM's ``AsyncScheduler`` sees its placeholders. A request that reaches its stop
        here stays running with ``stop_pending`` set (vLLM learns of the stop only when the
        batch returns); the returned list is then applied by :meth:`finish_pending` at
        ``now``. Meanwhile the next ``schedule()`` treats it as vLLM does: one more token
        if it stops on EOS, none if the output in flight reaches ``max_tokens``
        (``_clamp``); that extra row returns no token.
        """
        if out.advanced:
            return self._update_advanced(out, now, itl_explicit)
        finished: list[Request] = []
        if out.fast:
            k = self._k
            self._k = k + 1
            n_group = out.num_group
            self._ctx_sum += n_group
            self._last_fast_end = now
            if n_group:
                itl_weighted.append((dt, n_group))
            for req in self._finish_at.pop(k, ()):
                if req.d_mark < 0:
                    continue
                self._sync(req)
                _, status = self._target_outputs(req)
                if defer:  # it stays running, explicitly (partials are in running order)
                    req.stop_pending = status
                    insort(self._partials, req, key=_by_run_seq)
                else:
                    req.status = status
                finished.append(req)
        for req, n, c in out.scheduled:
            req.num_computed_tokens = c + n
            if req.first_scheduled_time != req.first_scheduled_time:  # NaN
                t = out.scheduled_at
                req.first_scheduled_time = now - dt if t is None else t
            if c + n != req.num_tokens:
                continue  # mid-prefill chunk: nothing sampled
            if req.stop_pending is not None:
                continue  # async: the extra row of a request whose stop is in flight
            req.num_tokens += 1
            req.num_output_tokens += 1
            if req.first_token_time != req.first_token_time:
                req.first_token_time = now
            else:
                itl_explicit.append(now - req.last_token_time)
            req.last_token_time = now
            target, status = self._target_outputs(req)
            if req.num_output_tokens >= target:
                if defer:
                    req.stop_pending = status
                else:
                    req.status = status
                finished.append(req)
        if finished and not defer:
            self._remove_finished(finished, now)
        # Requests now exactly one token behind join the decode group.
        if self.fast_path:
            if out.fast:
                joined = [r for r in self._partials
                          if r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens
                          and r.stop_pending is None]
                if joined:
                    for r in joined:
                        self._join(r)
                    self._partials = [r for r in self._partials if r.d_mark < 0]
            else:
                partials = []
                for r in self.running:
                    # Members emit non-first tokens only: a request whose last prefill chunk
                    # is one token long stays explicit until its first token is out.
                    if (r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens
                            and r.stop_pending is None):
                        self._join(r)
                    else:
                        partials.append(r)
                self._partials = partials
        return finished

    def finish_pending(self, reqs: list[Request], now: float) -> None:
        """Async scheduling: the batch that produced these requests' last outputs returned
        at ``now``; they finish (vLLM's ``update_from_output`` → ``_free_request``)."""
        for req in reqs:
            req.status = req.stop_pending
            req.stop_pending = None
        self._remove_finished(reqs, now)

    def _remove_finished(self, finished: list[Request], now: float) -> None:
        """Free finished requests' blocks in the batch's row order (running order), as vLLM's
        ``update_from_output`` loop does: the order decides the LRU queue's order."""
        if len(finished) > 1:
            finished.sort(key=_by_run_seq)
        running, partials = self.running, self._partials
        for req in finished:  # list.remove: identity scan in C, cheaper than a rebuild
            if req in partials:
                partials.remove(req)
            if req in running:
                running.remove(req)
            elif req in self.waiting:  # preempted while its last output was in flight
                self.waiting.remove(req)
            req.finish_time = now
            self.kv.free(req)

    # ------------------------------------------------------------------------------------------
    # Several batches in flight (pipeline parallelism)
    def advance_after_schedule(self, out: SchedulerOutput) -> None:
        """vLLM's ``_update_after_schedule`` (+ ``AsyncScheduler``'s): advance each scheduled
        request's computed tokens now, so its next prefill chunk can follow in the next batch;
        a row that completes the known sequence returns a token (``out.sampling``), and with
        async scheduling adds an output placeholder, so a decode is scheduled again in the
        next micro-batch before its token is back."""
        sampling = []
        add_placeholder = self.params.async_scheduling
        for req, n, c in out.scheduled:
            req.num_computed_tokens = c + n
            samples = c + n >= req.num_tokens + req.num_output_placeholders
            if samples and add_placeholder:
                req.num_output_placeholders += 1
            sampling.append(samples)
        out.sampling = sampling
        out.advanced = True

    def _update_advanced(self, out: SchedulerOutput, now: float,
                         itl_explicit: list) -> list[Request]:
        """``update_from_output`` for a batch advanced at schedule time: rows that sample get
        their token; rows of requests that already finished are dropped, as vLLM does."""
        finished: list[Request] = []
        for (req, n, c), samples in zip(out.scheduled, out.sampling):
            if req.first_scheduled_time != req.first_scheduled_time:  # NaN
                t = out.scheduled_at
                req.first_scheduled_time = now if t is None else t
            if not samples or req.status > RequestStatus.PREEMPTED:
                continue
            if req.num_output_placeholders:
                req.num_output_placeholders -= 1
            req.num_tokens += 1
            req.num_output_tokens += 1
            if req.first_token_time != req.first_token_time:
                req.first_token_time = now
            else:
                itl_explicit.append(now - req.last_token_time)
            req.last_token_time = now
            target, status = self._target_outputs(req)
            if req.num_output_tokens >= target:
                req.status = status
                finished.append(req)
        if finished:
            self._remove_finished(finished, now)
        return finished


def _by_index(r: Request) -> int:
    return r.index


_by_run_seq = attrgetter("run_seq")


def _priority_key(r: Request) -> tuple:
    # vLLM: max(running, key=lambda r: (r.priority, r.arrival_time)); max() keeps the first
    # of tied requests in running order.
    return (r.priority, r.arrival_time)
