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

Speed: requests in steady decode form the *decode group*, advanced implicitly
(``simulator/decode_group.py``). The waiting queue is in ``request_queue.py``, the step's
output in ``scheduler_output.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from servesim.costmodels.batch import BatchShape
from servesim.costmodels.spec_decode import EAGLE_METHODS, max_num_scheduled_tokens
from servesim.simulator.decode_group import DecodeGroup, _by_run_seq
from servesim.simulator.kv_cache import KVCacheManager
from servesim.simulator.lora import SkippedWaitingQueue
from servesim.simulator.request import Request, RequestStatus
from servesim.simulator.request_queue import _WaitingQueue
from servesim.simulator.scheduler_output import SchedulerOutput


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


class Scheduler(DecodeGroup):
    """vLLM V1 ``Scheduler``: ``policy == "priority"`` orders waiting requests and picks
    victims by (priority, arrival); any other name behaves as ``fcfs`` (subclasses that keep
    vLLM's decisions but change one rule register under their own names)."""

    # ``itl_hook(req, gap)``: each explicit inter-token gap of a request as it is recorded
    # (per-request ITLs for output.save_detailed without a frontend; the exact loop only)
    itl_hook = None

    # A KV connector (simulator/cluster/: P/D NIXL, CPU offload), as vLLM's scheduler holds
    # one: ``start_load`` at the waiting head after the local prefix lookup
    # (``get_num_new_matched_tokens`` + async load), ``request_finished`` before a finished
    # request's blocks are freed (``delay_free_blocks``). None: no connector (no hook runs).
    connector = None

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
        self._finished_unreported = False  # finished since the last schedule()
        # Async scheduling, one batch in flight (the engine sets ``inflight_seq`` before each
        # schedule()): vLLM caches only tokens it knows, so decode blocks are cached a step
        # later than with synchronous scheduling (cache-bucket shift 0 instead of 1), and a
        # batch's requests not rescheduled behind it are cached when it returns.
        self.inflight_seq = -1
        self._seq = 0
        self._last_fast_seq = -1
        self._cache_shift = 0 if params.async_scheduling else 1
        self._dissolved: tuple[int, list[Request]] | None = None
        # Decode group (fast path) state.
        self._k = 0  # fast-step counter: members' counters are stale by (_k - d_mark)
        self._group: dict[Request, None] = {}
        self._partials: list[Request] = []  # running requests not in the group, in order
        # Members by the step (mod block_size) at which their next token starts a new block,
        # each bucket in running order (``run_seq``): the order blocks are handed out.
        self._alloc_buckets: list[list[Request]] = [[] for _ in range(self.block_size)]
        # Members cached step by step, by step mod block_size: those whose decode fills blocks
        # of shareable content (a session's prefix ids run on into its output), every member
        # when the KV cache has a write-through hook (``_cache_eager``); the others' unique
        # blocks are cached implicitly (``_sync``).
        self._cache_buckets: list[set[Request]] = [set() for _ in range(self.block_size)]
        self._finish_at: dict[int, list[Request]] = {}
        self._ctx_sum = 0  # Σ (num_computed + 1) over members at step _k
        # (-context offset, index, join step, join number, member): the join number breaks
        # ties between a retried request's attempts (same index) that join at the same step
        self._ctx_heap: list[tuple[int, int, int, int, Request]] = []
        self._num_joins = 0
        self._last_fast_end = float("nan")
        self._prev_fast_end = float("nan")  # (consecutive fast steps are consecutive batches)
        # Speculative decoding and multi-LoRA (simulator/spec_decode.py, lora.py): None when
        # off; the runner turns them on with enable_spec_decode / enable_lora (exact loop).
        self.spec = None
        self.lora = None

    def enable_spec_decode(self, spec) -> None:
        """Speculative decoding (a ``spec_decode.SpecDecoding``); exact loop only (a decode
        row is 1 + k tokens, not the decode group's one). A draft model's proposer adds a
        slot per request to the batch, so the token budget shrinks by one per running seat
        (vLLM ``max_num_scheduled_tokens``)."""
        self.spec = spec
        self.fast_path = False
        self.kv.use_eagle = getattr(spec, "method", None) in EAGLE_METHODS
        self.max_num_scheduled_tokens = max_num_scheduled_tokens(
            getattr(spec, "method", None), self.params.max_num_batched_tokens,
            self.max_num_running_reqs)

    def enable_lora(self, lora) -> None:
        """Multi-LoRA (a ``lora.LoRAScheduling``): the waiting queue gains vLLM's
        ``skipped_waiting`` for requests whose adapter cannot join a step."""
        self.lora = lora
        self.fast_path = False
        self.waiting = SkippedWaitingQueue(lambda: _WaitingQueue(self.priority), self.priority)

    # ------------------------------------------------------------------------------------------
    # Queue management
    def add_request(self, req: Request) -> None:
        self.waiting.add_request(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def has_requests(self) -> bool:
        """vLLM's ``has_requests``: unfinished requests, or finished ones the next
        ``schedule()`` has yet to report (``finished_req_ids``) — that call may be empty, and
        under the batch queue an empty batch still takes a slot."""
        return bool(self.running) or len(self.waiting) > 0 or self._finished_unreported

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
                if req not in self.waiting:
                    continue  # not in this scheduler (another replica's)
                self.waiting.remove(req)
            req.status = finished_status
            req.stop_pending = None
            self.kv.free(req)
            done.append(req)
        if done:
            self._finished_unreported = True
        return done

    # ------------------------------------------------------------------------------------------
    # Stop conditions
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

    # ------------------------------------------------------------------------------------------
    def _clamp(self, req: Request, budget: int) -> int:
        """Tokens to schedule for a running request (vLLM's running loop, in order): what it
        lacks (outputs in flight count as placeholders), the long-prefill threshold, the
        budget, ``max_model_len − 1 − computed``. 0 when async scheduling already has the
        output that reaches ``max_tokens`` in flight (vLLM skips such a request)."""
        ph = req.num_output_placeholders
        if ph and req.num_computed_tokens + 2 - ph >= req.prompt_len + req.max_tokens:
            return 0  # several batches in flight (pipeline parallelism)
        inf = req.spec_inflight  # spec decode, async: (batch in flight, rejected, accepted)
        # One batch in flight: its counters already hold that output; with drafts in it vLLM
        # only knows it returns >= 1 token and skips iff that one reaches max_tokens.
        if req.num_output_tokens >= req.max_tokens and (
                inf is None or req.num_output_tokens - inf[2] >= req.max_tokens):
            return 0
        # vLLM: num_tokens_with_spec (+ placeholders) - num_computed_tokens
        n = req.num_tokens + req.spec_tokens + ph - req.num_computed_tokens
        if 0 < self.threshold < n:
            n = self.threshold
        if n > budget:
            n = budget
        cap = self.max_model_len - 1 - req.num_computed_tokens
        if inf is not None:  # vLLM's num_computed_tokens still holds the drafts to be rejected
            cap -= inf[1]
        return cap if n > cap else n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_scheduled_tokens
        # (Async with nothing in flight, members' last outputs are known: exact loop.)
        fast = (self.fast_path and self._group and (self._cache_shift or self.inflight_seq >= 0)
                and self._try_fast_running(out, budget))
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


    def _schedule_running_exact(self, out: SchedulerOutput, budget: int) -> int:
        running = self.running
        kv = self.kv
        scheduled = out.scheduled
        spec = self.spec
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = self._clamp(req, budget)
            if n <= 0:
                i += 1
                continue
            while True:
                if spec is None:
                    new_blocks = kv.allocate_slots(req, n)
                else:  # + vLLM's num_lookahead_tokens (spec_decode.SpecDecoding.lookahead)
                    new_blocks = kv.allocate_slots(req, n, 0, None, spec.lookahead(req))
                if new_blocks is not None:
                    break
                if self.priority:
                    victim = max(running, key=_priority_key)  # first of the tied, as vLLM
                    vi = running.index(victim)
                    running.pop(vi)
                    # Already scheduled this step: its tokens go back and vLLM steps its
                    # index back. (An earlier victim that was skipped this step — nothing to
                    # compute while its batch is in flight — leaves vLLM's index one too far:
                    # the request after this one is passed over for the step, as here.)
                    for j, (r, m, _) in enumerate(scheduled):
                        if r is victim:
                            budget += m
                            del scheduled[j]
                            i -= 1
                            break
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
        req.spec_tokens = 0  # vLLM _preempt_request: spec_token_ids = []
        req.spec_inflight = None
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
        # vLLM's prefill stats: set at every admission that looked the prefix up (not one
        # whose KV arrived from a connector) until the request's first output takes them
        if req.num_output_tokens == 0 and req.num_computed_tokens == 0:
            req.num_cached_tokens = num_computed
        req.num_computed_tokens = num_computed
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
        lora = self.lora
        # multi-LoRA: vLLM's scheduled_loras (adapters of the running requests scheduled)
        loras = lora.scheduled_loras(out) if lora is not None else None
        while len(waiting) and budget > 0:
            if len(running) == self.max_num_running_reqs:
                break
            req = waiting.peek_request()
            if loras is not None and lora.blocked(req, loras):
                waiting.skip_head()  # would exceed max_loras: skipped_waiting, go on
                continue
            hits, num_computed = self._prefix_head_start(req)
            if self.connector is not None and req.num_computed_tokens == 0:
                # KV from outside (remote prefill, CPU tier) loads asynchronously: the request
                # leaves the queue holding its blocks (vLLM WAITING_FOR_REMOTE_KVS) and comes
                # back to its head when the load is done; False: its blocks do not fit.
                started = self.connector.start_load(self, req, hits, num_computed)
                if started is not None:
                    if not started:
                        break
                    continue
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
            if loras is not None and req.spec.lora is not None:
                loras.add(req.spec.lora)
        if loras is not None:
            waiting.end_step()

    def _build_shape(self, out: SchedulerOutput) -> None:
        self._finished_unreported = False  # (every policy's schedule() ends here)
        out.seq = self._seq
        self._seq += 1
        nd = out.num_group
        ctx_sum = self._ctx_sum if nd else 0
        ctx_max = self._group_ctx_max() if nd else 0
        pre_new: list[int] = []
        pre_ctx: list[int] = []
        # The model runner computes logits for every scheduled row (partial prefill chunks
        # included; their token is discarded): ``logits_indices = query_start_loc[1:] - 1``.
        sampled = nd + len(out.scheduled)
        ns = 0  # speculative decoding: draft tokens of decode rows (logits at each one too)
        for req, n, c in out.scheduled:
            if n == 1:
                nd += 1
                ctx_sum += c + 1
                if c + 1 > ctx_max:
                    ctx_max = c + 1
            elif c + n > req.num_tokens:  # a decode row verifying c + n - num_tokens drafts
                nd += 1
                ns += c + n - req.num_tokens
                ctx_sum += c + 1
                if c + 1 > ctx_max:
                    ctx_max = c + 1
            else:
                pre_new.append(n)
                pre_ctx.append(c)
        out.shape = BatchShape(nd, ctx_sum, ctx_max, tuple(pre_new), tuple(pre_ctx),
                               sampled + ns, ns)
        if self.lora is not None:  # adapters of this batch, the worker's loads
            self.lora.on_batch(out)

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
            self._group_step(out.seq, out.num_group, now, dt, itl_weighted, defer, finished)
        spec = self.spec
        stats = spec.new_stats() if spec is not None else None
        sampled = out.sampled = []
        if spec is not None:
            row_tokens = out.sampled_tokens = []
        new_tokens = out.num_group if out.fast else 0
        hook = self.itl_hook
        for req, n, c in out.scheduled:
            req.num_computed_tokens = c + n
            if req.first_scheduled_time != req.first_scheduled_time:  # NaN
                t = out.scheduled_at
                req.first_scheduled_time = now - dt if t is None else t
            s = c + n - req.num_tokens  # > 0: drafts verified (speculative decoding)
            if s < 0:
                continue  # mid-prefill chunk: nothing sampled
            req.sched_seq = out.seq
            if req.stop_pending is not None:
                continue  # async: the extra row of a request whose stop is in flight
            num_new = 1
            if spec is not None:
                # vLLM: accepted drafts + 1, num_computed_tokens -= rejected; next step's drafts
                if s:
                    num_new += spec.rollback(req, s, stats)
                req.spec_tokens = spec.num_spec_tokens
            target, status = self._target_outputs(req)
            if num_new > 1 and req.num_output_tokens + num_new > target:
                num_new = target - req.num_output_tokens  # check_stop trims after the stop
                # it stops: one token behind, as vLLM's view of it (1 + k still to verify)
                req.num_computed_tokens = req.num_tokens + num_new - 1
            if spec is not None and defer:  # what vLLM learns when this batch returns
                req.spec_inflight = (out, c + n - req.num_computed_tokens, num_new - 1) \
                    if s else None
            req.num_tokens += num_new
            req.num_output_tokens += num_new
            new_tokens += num_new
            if stats is not None:
                stats.num_generation_tokens += num_new
                row_tokens.append(num_new)
            if req.first_token_time != req.first_token_time:
                req.first_token_time = now
            else:
                itl_explicit.append(now - req.last_token_time)
                if hook is not None:
                    hook(req, now - req.last_token_time)
            req.prev_token_time = req.last_token_time
            req.last_token_time = now
            sampled.append(req)
            if req.num_output_tokens >= target:
                if defer:
                    req.stop_pending = status
                else:
                    req.status = status
                finished.append(req)
        out.spec_decoding_stats = stats
        out.num_new_tokens = new_tokens
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

    def batch_returned(self, out: SchedulerOutput) -> None:
        """Async scheduling with speculative decoding: batch ``out`` is back, so vLLM now
        knows its rejections (``Request.spec_inflight`` no longer applies)."""
        for req, _, _ in out.scheduled:
            inf = req.spec_inflight
            if inf is not None and inf[0] is out:
                req.spec_inflight = None

    def cache_returned(self, out: SchedulerOutput, pending: list[Request]) -> None:
        """Async scheduling: batch ``out`` returned. vLLM's ``AsyncScheduler`` caches each
        RUNNING request's blocks up to ``num_computed_tokens − num_output_placeholders``;
        that matters only for requests not scheduled again in the batch behind (for the
        others it is what that batch's allocation cached): cache those up to their
        computed tokens. Preempted requests are not cached."""
        if not self.kv.enable_caching:
            return
        seq = out.seq
        cands = [r for r, _, _ in out.scheduled]
        cands += pending
        d = self._dissolved
        if d is not None and d[0] <= seq:
            if d[0] == seq:
                cands += d[1]
            self._dissolved = None
        cache = self.kv.cache_blocks
        for r in cands:
            if r.sched_seq == seq and r.status == RequestStatus.RUNNING and r.d_mark < 0:
                cache(r, r.num_computed_tokens)

    def finish_pending(self, reqs: list[Request], now: float) -> list[Request]:
        """Async scheduling: the batch that produced these requests' last outputs returned
        at ``now``; they finish (vLLM's ``update_from_output`` → ``_free_request``), except
        those aborted meanwhile. Returns the ones finished here."""
        reqs = [r for r in reqs if r.stop_pending is not None]
        for req in reqs:
            req.status = req.stop_pending
            req.stop_pending = None
        self._remove_finished(reqs, now)
        return reqs

    def _remove_finished(self, finished: list[Request], now: float,
                         in_row_order: bool = False) -> None:
        """Free finished requests' blocks in the batch's row order, as vLLM's
        ``update_from_output`` loop does: the order decides the LRU queue's order. With one
        batch in flight the rows are in running order (``run_seq``; the fast path's finish
        calendar is not); ``in_row_order``: ``finished`` already is (several batches in
        flight, where running order may have changed since the batch was scheduled)."""
        if len(finished) > 1 and not in_row_order:
            finished.sort(key=_by_run_seq)
        if finished:
            self._finished_unreported = True
        running, partials = self.running, self._partials
        for req in finished:  # list.remove: identity scan in C, cheaper than a rebuild
            if req in partials:
                partials.remove(req)
            if req in running:
                running.remove(req)
            elif req in self.waiting:  # preempted while its last output was in flight
                self.waiting.remove(req)
            req.finish_time = now
            if self.connector is None or not self.connector.request_finished(req):
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
            out.num_new_tokens += 1
            if req.first_token_time != req.first_token_time:
                req.first_token_time = now
            else:
                itl_explicit.append(now - req.last_token_time)
                if self.itl_hook is not None:
                    self.itl_hook(req, now - req.last_token_time)
            req.last_token_time = now
            target, status = self._target_outputs(req)
            if req.num_output_tokens >= target:
                req.status = status
                finished.append(req)
        if finished:
            self._remove_finished(finished, now, in_row_order=True)
        return finished


def _priority_key(r: Request) -> tuple:
    # vLLM: max(running, key=lambda r: (r.priority, r.arrival_time)); max() keeps the first
    # of tied requests in running order.
    return (r.priority, r.arrival_time)
