"""The scheduler's decode group: its fast path and quiet steps (a mixin of ``Scheduler``).

Speed (DESIGN §7: hot loops touch running sums, not per-request objects): requests in steady
decode — exactly one token behind — form the *decode group*. As long as every member gets its
one token in a step (enough budget, enough free blocks: checked before anything changes), the
group's counters advance implicitly with a step counter; only members that cross a block
boundary (a new block every ``block_size`` steps) or finish (a finish calendar) are touched.
Any other step runs the exact per-request loop (``scheduler.py``) on materialised counters.
Both paths make identical decisions; ``tests/simulator/test_properties.py`` checks it on random
workloads.

:class:`DecodeGroup` holds no state of its own: it works on the ``Scheduler`` attributes
set in ``Scheduler.__init__`` (``_group``, ``_k``, ``_alloc_buckets``, ...).
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from operator import attrgetter

from servesim.simulator.request import Request
from servesim.simulator.scheduler_output import QuietStep, SchedulerOutput


class DecodeGroup:
    """``Scheduler``'s decode-group machinery: requests in steady decode advance implicitly
    (fast path, :meth:`_try_fast_running`) and, while the batch is the group alone, the
    engine runs quiet steps (:meth:`quiet_steps`, :meth:`quiet_step`)."""

    # ------------------------------------------------------------------------------------------
    # Counters of members (implicit while in the group)
    def output_tokens(self, req: Request) -> int:
        """Tokens ``req`` has output so far (a decode-group member's counters are implicit)."""
        if req.d_mark >= 0 and req in self._group:
            return req.num_output_tokens + self._k - req.d_mark
        return req.num_output_tokens

    def delivered(self, req: Request, now: float) -> tuple[int, float] | None:
        """(outputs, first-token time) a client holds at ``now`` (None: a decode-group member
        of another replica). Under async scheduling the counters run ahead of the clock by the
        batches in flight (at most two tokens: the batch running and the one scheduled behind
        it), whose tokens are not out yet."""
        if req.d_mark >= 0 and req not in self._group:
            return None
        n = self.output_tokens(req)
        if req.d_mark >= 0:
            j = self._k - req.d_mark
            last = self._last_fast_end if j else req.last_token_time
            prev = (self._prev_fast_end if j >= 2 else req.last_token_time if j == 1
                    else req.prev_token_time)
        else:
            last, prev = req.last_token_time, req.prev_token_time
        n -= (last > now) + (prev > now)  # NaN compares false
        return n, req.first_token_time if n > 0 else float("nan")

    # ------------------------------------------------------------------------------------------
    # Decode group bookkeeping
    def _join(self, req: Request) -> None:
        """Add a running request that is exactly one token behind to the decode group."""
        k = self._k
        bs = self.block_size
        c0 = req.num_computed_tokens
        req.d_mark = k
        req.d_computed = c0
        self._group[req] = None
        insort(self._alloc_buckets[(k - c0) % bs], req, key=_by_run_seq)
        if self._cache_eager(req):
            self._cache_buckets[(k - c0 - self._cache_shift) % bs].add(req)
        target, _ = self._target_outputs(req)
        fin = k + target - req.num_output_tokens - 1
        lst = self._finish_at.get(fin)
        if lst is None:
            self._finish_at[fin] = [req]
        else:
            lst.append(req)
        self._ctx_sum += c0 + 1
        heap = self._ctx_heap
        self._num_joins += 1
        heapq.heappush(heap, (k - c0, req.index, k, self._num_joins, req))
        if len(heap) > 2 * len(self._group) + 64:  # drop entries of members that left
            self._ctx_heap = [e for e in heap if e[4].d_mark == e[2]]
            heapq.heapify(self._ctx_heap)

    def _sync(self, req: Request) -> None:
        """Materialise a member's counters and take it out of the group."""
        j = self._k - req.d_mark
        bs = self.block_size
        if j:
            req.num_computed_tokens += j
            req.num_tokens += j
            req.num_output_tokens += j
            req.prev_token_time = self._prev_fast_end if j >= 2 else req.last_token_time
            req.last_token_time = self._last_fast_end
            req.sched_seq = self._last_fast_seq
            if self.kv.enable_caching:
                # Each of those steps cached the blocks its token filled (eager caching at
                # allocation; vLLM's cache buckets, see ``_cache_members``), up to the tokens
                # vLLM knew: decode blocks of request-unique content are cached implicitly, so
                # the count is brought up to what the last of those steps left.
                shift = self._cache_shift
                first = req.d_computed + shift  # tokens to cache at the first of those steps
                nf = (req.num_computed_tokens - 1 + shift) // bs  # ... and at the last
                if nf > (first - 1) // bs and nf > req.num_cached_blocks:
                    req.num_cached_blocks = nf
        bucket = self._alloc_buckets[(req.d_mark - req.d_computed) % bs]
        del bucket[bisect_left(bucket, req.run_seq, key=_by_run_seq)]
        self._cache_buckets[(req.d_mark - req.d_computed - self._cache_shift) % bs].discard(req)
        self._ctx_sum -= req.num_computed_tokens + 1
        del self._group[req]
        req.d_mark = -1

    def _dissolve_group(self) -> None:
        """Materialise every member (before an exact step)."""
        members = list(self._group)
        for req in members:
            self._sync(req)
        if self.inflight_seq >= 0:  # they sampled in the batch in flight (cache_returned)
            self._dissolved = (self._last_fast_seq, members)
        self._finish_at.clear()
        self._ctx_heap.clear()
        self._ctx_sum = 0
        self._partials = [r for r in self.running if r.d_mark < 0]

    def _group_ctx_max(self) -> int:
        heap = self._ctx_heap
        while heap:
            neg_off, _, mark, _, req = heap[0]
            if req.d_mark == mark:
                return self._k - neg_off + 1
            heapq.heappop(heap)
        return 0

    # ------------------------------------------------------------------------------------------
    # Quiet steps (the engine advances several in one event)
    def quiet_steps(self) -> bool:
        """Whether the next step is *quiet*: ``schedule()`` would take the fast path with the
        decode group alone: no partial row (the only partials allowed are requests whose stop
        is in flight at ``max_tokens``, which vLLM's async scheduler skips), nothing to admit
        (the waiting queue is empty or the running seats are full, so vLLM's waiting loop
        stops before looking at it). Free blocks for members crossing a block boundary are
        checked separately (:meth:`quiet_blocks_ok`). Such a step changes nothing but the
        group's counters and, at the calendar's steps, finishes members (:meth:`quiet_step`),
        so the engine may run such steps back to back (``Replica``), re-checking after every
        step. (Async scheduling: the engine sets ``inflight_seq`` first.)"""
        if not self._group or not self.fast_path:
            return False
        if not (self._cache_shift or self.inflight_seq >= 0):
            return False  # (schedule() runs the exact loop)
        for r in self._partials:
            if r.stop_pending is None or r.num_output_tokens < r.max_tokens:
                return False
        if len(self.waiting) and len(self.running) < self.max_num_running_reqs:
            return False
        return len(self._group) <= self.max_num_scheduled_tokens

    def quiet_blocks_ok(self) -> bool:
        """Whether the free blocks cover this quiet step's block-boundary members."""
        return len(self._alloc_buckets[self._k % self.block_size]) <= \
            self.kv.get_num_free_blocks()

    def quiet_shape(self) -> tuple[int, int, int]:
        """(num_decode, decode_context_sum, decode_context_max) of this quiet step's batch."""
        return len(self._group), self._ctx_sum, self._group_ctx_max()

    def quiet_step(self, end: float, itl_dt: float, itl_weighted: list,
                   defer: bool = False) -> tuple[QuietStep, list[Request]]:
        """Apply one quiet step, as ``schedule()`` + ``update_from_output(defer=defer)`` would:
        members at a block boundary get their block (running order), newly full blocks are
        cached as the fast path caches them, the step takes its batch number, the group's
        counters advance, members whose last output this is finish (``defer``: their stop is
        pending, as in ``update_from_output``); the step ends at ``end``, ``itl_dt`` after
        the previous output. Returns (the step, as the engine's consumers read a
        ``SchedulerOutput``; the requests that finished)."""
        k = self._k
        bs = self.block_size
        bucket = self._alloc_buckets[k % bs]
        if bucket:
            self.kv.append_decode_blocks(bucket)
        cache = self._cache_buckets[k % bs]
        if cache and self.kv.enable_caching:
            self._cache_members(cache, k)
        n = len(self._group)
        out = QuietStep(n, self._seq)
        if self.record_schedules:
            out.group_members = sorted(self._group, key=_by_index)
        # _build_shape
        self._finished_unreported = False
        self._seq += 1
        # update_from_output (the fast path's part; no explicit rows)
        finished: list[Request] = []
        self._group_step(out.seq, n, end, itl_dt, itl_weighted, defer, finished)
        if finished and not defer:
            self._remove_finished(finished, end)
        return out, finished

    def _group_step(self, seq: int, n: int, now: float, dt: float, itl_weighted: list,
                    defer: bool, finished: list) -> None:
        """The decode group's part of ``update_from_output`` for batch ``seq`` (``n`` members)
        that ends at ``now``, ``dt`` after the previous output: the group's counters advance
        one token, its ITL sample, and the members whose stop falls on this step (the finish
        calendar) join ``finished``."""
        k = self._k
        self._k = k + 1
        self._ctx_sum += n
        self._prev_fast_end = self._last_fast_end
        self._last_fast_end = now
        self._last_fast_seq = seq
        if n:
            itl_weighted.append((dt, n))
        for req in self._finish_at.pop(k, ()):  # (members that left the group: d_mark < 0)
            if req.d_mark < 0:
                continue
            self._sync(req)
            _, status = self._target_outputs(req)
            if defer:  # it stays running, explicitly, its stop pending until the batch returns
                req.stop_pending = status
                insort(self._partials, req, key=_by_run_seq)
            else:
                req.status = status
            finished.append(req)

    def _cache_eager(self, req: Request) -> bool:
        """Whether a member joining the decode group has its newly full blocks cached step by
        step (cache buckets, :meth:`_cache_members`): while blocks of shareable content remain
        to be indexed (another request may hit them at once), or for every member when a KV
        connector stores what is cached (``KVCacheManager.on_cache``). Other members'
        request-unique blocks are cached implicitly (:meth:`_sync`)."""
        kv = self.kv
        return getattr(kv, "on_cache", None) is not None or \
            req.num_shared_blocks(self.block_size) > req.num_cached_blocks

    def _cache_members(self, cache: set[Request], k: int) -> None:
        """Step ``k`` of the decode group caches its bucket's members up to the tokens vLLM
        knows (``_cache_shift``: the last output too with synchronous scheduling, not the one
        in flight with async scheduling)."""
        bs = self.block_size
        kv = self.kv
        shift = self._cache_shift
        eager = getattr(kv, "on_cache", None) is not None
        for r in list(cache):
            num_full = (r.d_computed + k - r.d_mark + shift) // bs
            if num_full > r.num_cached_blocks:
                kv._cache(r, num_full)
            if not eager and num_full >= r.num_shared_blocks(bs):
                cache.discard(r)

    # ------------------------------------------------------------------------------------------
    # Fast path (schedule()'s phase A when every member gets its token)
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
            members = bucket
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


def _by_index(r: Request) -> int:
    return r.index


_by_run_seq = attrgetter("run_seq")
