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
``n = num_tokens - computed`` clamped by the threshold and the budget, ``allocate_slots`` or stop
(head-of-line blocking). Without chunked prefill, a request that does not fit the budget is
skipped this step (vLLM's ``skipped_waiting_requests``).

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
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

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
        "scheduled",
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
        # True when the engine advanced num_computed_tokens right after schedule() (several
        # batches in flight under pipeline parallelism), as vLLM's _update_after_schedule does.
        self.advanced = False

    def as_dict(self) -> dict[str, int]:
        """{request_id: num_scheduled_tokens} (tests; needs ``record_schedules``)."""
        d = {r.request_id: 1 for r in (self.group_members or ())}
        for r, n, _ in self.scheduled:
            d[r.request_id] = n
        return d


class _WaitingQueue:
    """FCFS: a deque (victims are prepended). PRIORITY: a heap on (priority, arrival, index)."""

    def __init__(self, priority: bool):
        self.priority = priority
        self._dq: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []

    def __len__(self) -> int:
        return len(self._heap) if self.priority else len(self._dq)

    def add_request(self, req: Request) -> None:
        if self.priority:
            heapq.heappush(self._heap, (req.priority, req.arrival_time, req.index, req))
        else:
            self._dq.append(req)

    def prepend_request(self, req: Request) -> None:
        if self.priority:
            self.add_request(req)
        else:
            self._dq.appendleft(req)

    def peek_request(self) -> Request:
        return self._heap[0][3] if self.priority else self._dq[0]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.priority else self._dq.popleft()

    def remove(self, req: Request) -> None:
        if self.priority:
            self._heap = [e for e in self._heap if e[3] is not req]
            heapq.heapify(self._heap)
        else:
            self._dq.remove(req)

    def prepend_requests(self, reqs: Iterable[Request]) -> None:
        for r in reversed(list(reqs)):
            self.prepend_request(r)


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
        self.fast_path = fast_path
        self.record_schedules = record_schedules
        self.num_preemptions = 0
        # Decode group (fast path) state.
        self._k = 0  # fast-step counter: members' counters are stale by (_k - d_mark)
        self._group: dict[Request, None] = {}
        self._partials: list[Request] = []  # running requests not in the group, in order
        self._alloc_buckets: list[set[Request]] = [set() for _ in range(self.block_size)]
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
    # Abort path (client timeouts and cancellations)
    def finish_requests(self, requests: Iterable[Request],
                        finished_status: RequestStatus) -> list[Request]:
        """vLLM ``Scheduler.finish_requests`` (the engine's abort path): each request still
        here leaves ``running`` or ``waiting``, takes ``finished_status`` (normally
        FINISHED_ABORTED) and frees its KV blocks (tail first, hashes kept: its prefix stays
        cached). Requests already finished or not in this scheduler are skipped; returns the
        ones finished here. Call between steps (the engine defers a client's abort that
        arrives during a step to the step's end, as vLLM's engine core handles aborts between
        steps)."""
        done = []
        for req in requests:
            if req.is_finished:
                continue
            if req.d_mark >= 0:  # a decode-group member: materialise, leave the group
                self._sync(req)
            if req in self.running:
                self.running.remove(req)
                if req in self._partials:
                    self._partials.remove(req)
            else:
                w = self.waiting
                if not (any(e[3] is req for e in w._heap) if w.priority else req in w._dq):
                    continue  # not in this scheduler (another replica's)
                w.remove(req)
            req.status = finished_status
            self.kv.free(req)
            done.append(req)
        return done

    def output_tokens(self, req: Request) -> int:
        """Tokens ``req`` has output so far (a decode-group member's counters are implicit)."""
        if req.d_mark >= 0 and req in self._group:
            return req.num_output_tokens + self._k - req.d_mark
        return req.num_output_tokens

    # ------------------------------------------------------------------------------------------
    # Decode group bookkeeping
    def _target_outputs(self, req: Request) -> tuple[int, RequestStatus]:
        """Outputs after which ``req`` stops, and how (EOS is checked before length)."""
        cap = min(req.max_tokens, self.max_model_len - req.prompt_len)
        if req.eos_after is not None and req.eos_after <= cap:
            return req.eos_after, RequestStatus.FINISHED_STOPPED
        return cap, RequestStatus.FINISHED_LENGTH_CAPPED

    def _join(self, req: Request) -> None:
        """Add a running request that is exactly one token behind to the decode group."""
        k = self._k
        bs = self.block_size
        c0 = req.num_computed_tokens
        req.d_mark = k
        req.d_computed = c0
        self._group[req] = None
        self._alloc_buckets[(k - c0) % bs].add(req)
        self._cache_buckets[(k - c0 - 1) % bs].add(req)
        target, _ = self._target_outputs(req)
        fin = k + target - req.num_output_tokens - 1
        lst = self._finish_at.get(fin)
        if lst is None:
            self._finish_at[fin] = [req]
        else:
            lst.append(req)
        self._ctx_sum += c0 + 1
        heapq.heappush(self._ctx_heap, (k - c0, req.index, k, req))

    def _sync(self, req: Request) -> None:
        """Materialise a member's counters and take it out of the group."""
        j = self._k - req.d_mark
        if j:
            req.num_computed_tokens += j
            req.num_tokens += j
            req.num_output_tokens += j
            req.last_token_time = self._last_fast_end
        bs = self.block_size
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
    def _clamp(self, req: Request, budget: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
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
        return -(-need // self.block_size) - len(req.blocks)

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
        if partials:
            demand = n_group
            for r in partials:
                demand += self._clamp(r, 1 << 62)
            if demand > budget:
                first = self.running.index(partials[0])
                if len(self.running) - first != len(partials) or n_group > budget:
                    return False
            left = budget - n_group
            for r in partials:
                if left <= 0:
                    break
                n = self._clamp(r, left)
                if n > 0:
                    plan.append((r, n))
                    left -= n
        elif n_group > budget:
            return False
        # Blocks: all allocations must succeed without preemption.
        k = self._k
        bucket = self._alloc_buckets[k % self.block_size]
        need = len(bucket)
        for r, n in plan:
            nb = self._blocks_needed(r, n)
            if nb > 0:
                need += nb
        if need > self.kv.get_num_free_blocks():
            return False
        # Commit: members crossing a block boundary get a new block (handed out in arrival
        # order; only block ids depend on it, no decision does).
        kv = self.kv
        pool = kv.block_pool
        if bucket:
            members = sorted(bucket, key=_by_index) if len(bucket) > 1 else bucket
            for r, blk in zip(members, pool.get_new_blocks(len(bucket))):
                r.blocks.append(blk)
        cache = self._cache_buckets[k % self.block_size]
        if cache and kv.enable_caching:
            bs = self.block_size
            for r in cache:
                num_full = (r.d_computed + k - r.d_mark + 1) // bs
                if num_full > r.num_cached_blocks:
                    hashes = r.ensure_block_hashes(num_full, bs)
                    pool.cache_full_blocks(r.blocks, hashes, r.num_cached_blocks, num_full,
                                           r.num_shared_blocks(bs))
                    r.num_cached_blocks = num_full
        out.num_group = n_group
        total = n_group
        for r, n in plan:
            kv.allocate_slots(r, n)
            out.scheduled.append((r, n, r.num_computed_tokens))
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
                    victim = max(running, key=_priority_key)
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
        self._partials.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_computed
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_computed
        out.scheduled.append((req, n, num_computed))
        out.total_num_scheduled_tokens += n
        return req

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        waiting = self.waiting
        running = self.running
        kv = self.kv
        skipped: list[Request] = []
        while len(waiting) and budget > 0:
            if len(running) == self.max_num_running_reqs:
                break
            req = waiting.peek_request()
            hits, num_computed = self._prefix_head_start(req)
            n = req.num_tokens - num_computed
            if 0 < self.threshold < n:
                n = self.threshold
            if not self.chunked and n > budget:
                waiting.pop_request()
                skipped.append(req)
                continue
            if n > budget:
                n = budget
            if kv.allocate_slots(req, n, num_computed - req.num_computed_tokens, hits) is None:
                break
            self._admit(out, n, num_computed)
            budget -= n
        if skipped:
            waiting.prepend_requests(skipped)

    def _build_shape(self, out: SchedulerOutput) -> None:
        nd = out.num_group
        ctx_sum = self._ctx_sum if nd else 0
        ctx_max = self._group_ctx_max() if nd else 0
        pre_new: list[int] = []
        pre_ctx: list[int] = []
        sampled = nd
        for req, n, c in out.scheduled:
            if n == 1:
                nd += 1
                ctx_sum += c + 1
                if c + 1 > ctx_max:
                    ctx_max = c + 1
            else:
                pre_new.append(n)
                pre_ctx.append(c)
            if c + n == req.num_tokens:
                sampled += 1
        out.shape = BatchShape(nd, ctx_sum, ctx_max, tuple(pre_new), tuple(pre_ctx), sampled)

    # ------------------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, now: float, dt: float,
                           itl_explicit: list, itl_weighted: list) -> list[Request]:
        """Advance counters after the step that ended at ``now`` (``dt`` after the previous
        step ended); return the requests that finished. ITL samples go to ``itl_explicit``
        (single values) and ``itl_weighted`` ((value, count) pairs)."""
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
                req.status = status
                finished.append(req)
        for req, n, c in out.scheduled:
            if not out.advanced:
                req.num_computed_tokens = c + n
            if req.first_scheduled_time != req.first_scheduled_time:  # NaN
                req.first_scheduled_time = now - dt
            if c + n != req.num_tokens:
                continue  # mid-prefill chunk: nothing sampled
            req.num_tokens += 1
            req.num_output_tokens += 1
            if req.first_token_time != req.first_token_time:
                req.first_token_time = now
            else:
                itl_explicit.append(now - req.last_token_time)
            req.last_token_time = now
            target, status = self._target_outputs(req)
            if req.num_output_tokens >= target:
                if req.status == RequestStatus.PREEMPTED:  # its batch was still in flight
                    self.waiting.remove(req)
                req.status = status
                finished.append(req)
        if finished:
            running, partials = self.running, self._partials
            for req in finished:  # list.remove: identity scan in C, cheaper than a rebuild
                if req in partials:
                    partials.remove(req)
                if req in running:  # (a request preempted while in flight is not)
                    running.remove(req)
                req.finish_time = now
                self.kv.free(req)
        # Requests now exactly one token behind join the decode group.
        if self.fast_path:
            if out.fast:
                joined = [r for r in self._partials
                          if r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens]
                if joined:
                    for r in joined:
                        self._join(r)
                    self._partials = [r for r in self._partials if r.d_mark < 0]
            else:
                partials = []
                for r in self.running:
                    # Members emit non-first tokens only: a request whose last prefill chunk
                    # is one token long stays explicit until its first token is out.
                    if r.num_tokens - r.num_computed_tokens == 1 and r.num_output_tokens:
                        self._join(r)
                    else:
                        partials.append(r)
                self._partials = partials
        return finished


def _by_index(r: Request) -> int:
    return r.index


def _priority_key(r: Request) -> tuple:
    # vLLM: max(running, key=(priority, arrival_time)). Real arrival timestamps never tie;
    # simulated ones can (request_rate: inf), so send order breaks ties, as time would.
    return (r.priority, r.arrival_time, r.index)
