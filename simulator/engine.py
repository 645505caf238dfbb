"""The replica engine (vLLM's ``EngineCore``) as a SimPy process.

One event per engine step (``EngineCore.step``: schedule → execute → update_from_output): the
step's duration comes from the cost model; the engine sleeps when nothing is runnable and
wakes on an arrival. With async scheduling (vLLM's default) the engine keeps two batches in
flight (``EngineCore.step_with_batch_queue``): batch k+1 is scheduled when batch k−1 returns,
while batch k runs, so a request that arrives during batch k first runs in batch k+2. The
benchmark client that feeds it is in ``simulator/client.py``; its records go to the
``Recorder`` (``simulator/recorder.py``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import simpy
from servesim.simulator.request import Request, RequestStatus

if TYPE_CHECKING:
    from servesim.simulator.recorder import Recorder


class Replica:
    """One vLLM engine (``EngineCore``): scheduler + KV cache + step cost model."""

    def __init__(self, env: simpy.Environment, scheduler, step_seconds: Callable,
                 recorder: Recorder, on_finish: Callable[[Request], None], replica_id: int = 0,
                 max_concurrent_batches: int = 1, async_scheduling: bool = False,
                 decode_seconds: Callable[[int, int], float] | None = None,
                 undo_step: Callable[[], None] | None = None):
        self.env = env
        # vLLM executors: max_concurrent_batches = pp, or 2 with async scheduling and pp == 1.
        self.max_concurrent_batches = max_concurrent_batches
        self.async_scheduling = async_scheduling
        # Tests: a list receiving (time scheduled, {request_id: tokens}, [preempted ids]) for
        # every non-empty batch (needs the scheduler's ``record_schedules``).
        self.trace: list | None = None
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.step_seconds = step_seconds
        # Seconds of a decode-only step of (rows, context tokens): the cost model's fast
        # path for quiet steps (``StepCostModel.decode_step_seconds``), else step_seconds.
        self._decode_seconds = decode_seconds
        # takes back the last step time asked for, when that step does not run (a stateful
        # step time: costmodels.power.SustainedClock.undo)
        self._undo_step = undo_step
        self.rec = recorder
        self.on_finish = on_finish
        self.replica_id = replica_id
        self._wake: simpy.Event | None = None
        self._aborts: list[Request] = []  # client aborts that arrived during a step
        # vLLM's engine loop takes new requests in between steps (``_process_input_queue``):
        # when the step (or batch) being waited for ends; the requests that came during it
        # (not yet in vLLM's waiting queue when that step's stats are taken)
        self._busy_until = -math.inf
        self._undrained: list[Request] = []
        self._inflight: deque | None = None  # batches in flight (pipeline parallelism)
        self.num_steps = 0
        self.busy_seconds = 0.0
        self.process = env.process(self._run())

    @property
    def load(self) -> int:
        """vLLM's DP load-balancing score: waiting·4 + running."""
        s = self.scheduler
        return s.num_waiting * 4 + s.num_running

    def add_request(self, req: Request) -> None:
        """``req`` reaches the engine core: stamped QUEUED when the engine loop takes it in
        (:meth:`queued_at`), it joins the scheduler's waiting queue now (the next
        ``schedule()`` comes after that moment either way)."""
        q = self.queued_at(self.env._now, req)
        if req.fe is not None:
            req.fe[2] = q
        else:
            req.queued_time = q
        self.add_taken_in(req)

    def add_taken_in(self, req: Request) -> None:
        """``req`` joins the waiting queue, its QUEUED time already set (a parked request)."""
        self.scheduler.add_request(req)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def queued_at(self, now: float, req=None) -> float:
        """When vLLM's engine loop takes in a request that reaches the engine core at ``now``
        (its QUEUED event): at once when idle, else when the step (async: the batch) being
        waited for ends, just before the next ``schedule()``; such a request (``req``, or a
        parked one: None) is left out of that step's waiting gauge."""
        b = self._busy_until
        if b > now:
            self._undrained.append(req)
            return b
        return now

    # -- abort path ----------------------------------------------------------------------------
    def abort(self, req: Request) -> None:
        """A client gave ``req`` up (timeout, cancellation): abort it in this engine as vLLM
        does (``Scheduler.finish_requests(..., FINISHED_ABORTED)``: out of the queues, blocks
        freed). vLLM's engine core handles aborts between steps, so one that arrives during a
        step takes effect when the step ends; an idle engine applies it at once. A request
        that finished in that step, or that is not in this engine, is left alone."""
        if self._wake is not None:
            self.scheduler.finish_requests([req], RequestStatus.FINISHED_ABORTED)
        else:
            self._aborts.append(req)

    def _apply_aborts(self) -> None:
        reqs, self._aborts = self._aborts, []
        done = self.scheduler.finish_requests(reqs, RequestStatus.FINISHED_ABORTED)
        if done and self._inflight:  # drop them from batches still in flight (pp)
            gone = set(map(id, done))
            for out, _, _ in self._inflight:
                if out is not None:
                    out.scheduled = [row for row in out.scheduled if id(row[0]) not in gone]

    def _idle(self):
        """Sleep until the next request arrives."""
        self._wake = self.env.event()
        yield self._wake
        self._wake = None

    def _recorder(self):
        """A closure appending one step's row to the step columns (array appends only)."""
        sched, kv = self.scheduler, self.kv
        stats = kv.prefix_cache_stats
        cols = self.rec.step
        c_time, c_dt, c_tok = cols["time_s"], cols["step_seconds"], cols["step_tokens"]
        c_run, c_wait, c_kv = cols["running"], cols["waiting"], cols["kv_usage"]
        c_pre, c_q, c_h = cols["preemptions"], cols["prefix_queries"], cols["prefix_hits"]
        c_nd, c_pt, c_gen = cols["num_decode"], cols["prefill_tokens"], cols["generated"]
        usage = kv.block_pool.get_usage
        rec, limit = self.rec, self.rec.chunk_rows
        on_step, rid = rec.on_step, self.replica_id
        itl_e, itl_w, eitl = rec.itl_explicit, rec.itl_weighted, rec.engine_itl_pairs
        on_columns = rec.on_step_columns
        undrained, WAITING = self._undrained, RequestStatus.WAITING
        # data parallel: each engine's latest gauges and counters (Recorder.engine_rows); a
        # row then holds their sums (KV usage: their mean), vLLM's per-engine series summed
        peers = rec.engine_rows
        sink_rows = rec.SINK_ROWS if rec.sink is not None and rec.steps is not None else 1 << 62

        def record(out, now: float, dt: float) -> None:
            """``out``: the step's SchedulerOutput (or a quiet step's ``QuietStep``)."""
            if on_step is not None:  # frontend: client-side token times (before any flush)
                on_step(rid, out, now, itl_e, itl_w, eitl)
            n = len(c_time)
            if n >= limit and rec.steps is not None:
                rec.flush()
            elif n - rec._steps_shipped >= sink_rows:
                rec.ship_steps(n)
            parked = rec.parked
            shape = out.shape
            self.num_steps += 1
            c_time.append(now)
            c_dt.append(dt)
            c_tok.append(out.total_num_scheduled_tokens)
            waiting = sched.num_waiting
            if undrained:  # (not in vLLM's waiting queue yet; an aborted one is in neither)
                for r in undrained:
                    if r is None or r.status == WAITING:
                        waiting -= 1
                undrained.clear()
            if peers is None:
                c_run.append(sched.num_running)
                if parked:  # waiting = the engine's queue + the client's compact tail
                    c_wait.append(waiting + len(parked))
                    rec.refill()
                else:
                    c_wait.append(waiting)
                c_kv.append(usage())
                c_pre.append(sched.num_preemptions)
                c_q.append(stats.queries)
                c_h.append(stats.hits)
            else:
                peers[rid] = (sched.num_running, waiting, usage(), sched.num_preemptions,
                              stats.queries, stats.hits)
                c_run.append(sum(p[0] for p in peers))
                c_wait.append(sum(p[1] for p in peers))
                c_kv.append(sum(p[2] for p in peers) / len(peers))
                c_pre.append(sum(p[3] for p in peers))
                c_q.append(sum(p[4] for p in peers))
                c_h.append(sum(p[5] for p in peers))
            c_nd.append(shape.num_decode)
            c_pt.append(shape.num_tokens - shape.num_decode - shape.num_spec_tokens)
            c_gen.append(out.num_new_tokens)
            if on_columns is not None:
                on_columns(out)

        return record

    def _advance(self, delay: float) -> bool:
        """Move the clock ``delay`` ahead here (where ``env.timeout(delay)`` would land) when no
        other event is due first; False: the caller yields that timeout instead."""
        env = self.env
        t = env._now + delay
        q = env._queue  # (env.peek(), inlined)
        if not q or t < q[0][0]:
            env._now = t
            return True
        return False

    def _trace(self, out) -> None:
        self.trace.append((out.scheduled_at, out.as_dict(),
                           [r.request_id for r in out.preempted]))

    def _quiet_steps(self) -> Callable[[], int] | None:
        """The scheduler's ``quiet_steps`` when its steps are vLLM's as ``Scheduler`` makes
        them (a subclass replacing the step's decisions runs every step through them)."""
        from servesim.simulator.scheduler import Scheduler

        sched = self.scheduler
        cls = type(sched)
        if not isinstance(sched, Scheduler) or any(
                getattr(cls, name) is not getattr(Scheduler, name)
                for name in ("schedule", "update_from_output", "_try_fast_running",
                             "_schedule_waiting", "_build_shape", "quiet_steps",
                             "quiet_step")):
            return None
        return sched.quiet_steps

    def _quiet_seconds(self) -> Callable[[], float]:
        """Seconds of the scheduler's next quiet step (decode group only): what
        ``step_seconds`` gives that step's ``BatchShape``."""
        sched = self.scheduler
        if self._decode_seconds is not None:
            decode_seconds = self._decode_seconds

            def seconds() -> float:
                return decode_seconds(len(sched._group), sched._ctx_sum)
            return seconds
        from servesim.costmodels.batch import BatchShape

        shape = BatchShape()  # reused: the cost model only reads it
        step_seconds = self.step_seconds

        def seconds() -> float:
            nd, shape.decode_context_sum, shape.decode_context_max = sched.quiet_shape()
            shape.num_decode = shape.num_sampled = nd
            return step_seconds(shape)
        return seconds

    def _run(self):
        """``EngineCore.step`` loop: schedule → execute (the cost model's seconds) → update.

        Speed: a step that ends before any other event is due advances the clock here, without
        a SimPy event; runs of *quiet* steps (``Scheduler.quiet_steps``: the decode group
        alone, nothing to admit) are applied back to back (``Scheduler.quiet_step``), each
        exactly as a scheduled step, while no other event is due first."""
        if self.max_concurrent_batches > 1:
            yield from self._run_batch_queue()
            return
        if self.async_scheduling:
            yield from self._run_async()
            return
        env = self.env
        sched = self.scheduler
        itl_e, itl_w = self.rec.itl_explicit, self.rec.itl_weighted
        step_seconds = self.step_seconds
        on_finish = self.on_finish
        record = self._recorder()
        advance = self._advance
        quiet = self._quiet_steps()
        quiet_seconds = self._quiet_seconds() if quiet is not None else None
        while True:
            if not sched.has_requests():
                yield from self._idle()
                continue
            if quiet is not None and quiet():
                ran = False
                peek = env.peek()
                while sched.quiet_blocks_ok():
                    now = env._now
                    dt = quiet_seconds()
                    end = now + dt  # (where env.timeout(dt) would land)
                    if end >= peek:  # (not run here: schedule() takes it after the event)
                        if self._undo_step is not None:
                            self._undo_step()
                        break
                    env._now = end
                    out, finished = sched.quiet_step(end, dt, itl_w)
                    out.scheduled_at = now
                    if self.trace is not None:
                        self._trace(out)
                    self.busy_seconds += dt
                    record(out, end, dt)
                    for r in finished:
                        on_finish(r)
                    if self._aborts:
                        self._apply_aborts()
                    ran = True
                    if not quiet():
                        break
                    peek = env.peek()
                if ran:
                    continue
            out = sched.schedule()
            if out.total_num_scheduled_tokens == 0:
                if out.preempted:  # blocks were freed: vLLM's next step() schedules again
                    continue
                # Nothing fits and nothing runs: cannot happen for requests that passed the
                # admission check; wait for the next arrival rather than spin.
                yield from self._idle()
                continue
            out.scheduled_at = env._now
            if self.trace is not None:
                self._trace(out)
            dt = step_seconds(out.shape)
            if not advance(dt):  # (another event first)
                self._busy_until = env._now + dt
                yield env.timeout(dt)
            now = env._now
            self.busy_seconds += dt
            finished = sched.update_from_output(out, now, dt, itl_e, itl_w)
            record(out, now, dt)
            for r in finished:
                on_finish(r)
            if self._aborts:
                self._apply_aborts()

    def _run_async(self):
        """``EngineCore.step_with_batch_queue`` with async scheduling (queue two deep): while
        batch k runs on the GPU, batch k+1 is scheduled (right after batch k−1 returned), so
        batches run back to back and the host's work hides behind the GPU's (the cost model
        charges an async step ``max(gpu, host) + residual``).

        A batch's end time is known when it is scheduled, so its counters are advanced at
        once (``update_from_output(defer=True)``: the next ``schedule()`` sees them as vLLM's
        output placeholders); what vLLM learns only when the batch returns — which requests
        stopped — is applied then (``finish_pending``), freeing their blocks and seats one
        batch later than synchronous scheduling does.

        Speed, as in :meth:`_run`: a batch that returns before any other event is due does so
        without a SimPy event, and quiet steps (one batch in flight) are scheduled and the
        batch in flight returned back to back."""
        env = self.env
        sched = self.scheduler
        itl_e, itl_w = self.rec.itl_explicit, self.rec.itl_weighted
        step_seconds = self.step_seconds
        on_finish = self.on_finish
        record = self._recorder()
        advance = self._advance
        quiet = self._quiet_steps()
        quiet_seconds = self._quiet_seconds() if quiet is not None else None
        # (out, end, seconds, requests whose stop is pending, ITL samples, weighted samples)
        inflight: deque = deque()

        def batch_returns(item: tuple, now: float) -> None:
            """A batch is back at ``now``: aborts first (vLLM ``_process_aborts_queue``),
            then what vLLM learns only now (rejected drafts, caching, stops), its ITL
            samples and its record, then the finished requests."""
            out, _, dt, pending, b_e, b_w = item
            if self._aborts:
                self._apply_aborts()
            if returned is not None:
                returned(out)
            sched.cache_returned(out, pending)
            if pending:
                pending = sched.finish_pending(pending, now)
            if b_e:
                itl_e.extend(b_e)
            if b_w:
                itl_w.extend(b_w)
            record(out, now, dt)
            for r in pending:
                on_finish(r)

        last_end = 0.0  # end of the batch scheduled last
        # speculative decoding: vLLM learns a batch's rejections when it returns
        returned = sched.batch_returned if getattr(sched, "spec", None) is not None else None
        while True:
            if quiet is not None and len(inflight) == 1:
                # Quiet steps back to back: schedule the next batch (decode group only, as
                # schedule() + update_from_output(defer=True) would), then return the batch in
                # flight, exactly as the loop below does, while nothing changes the batch
                # (re-checked every step); when another event is due before that return, the
                # loop below waits for it (the next batch is scheduled either way: vLLM
                # schedules it before the batch in flight returns).
                ran = False
                while True:
                    old = inflight[0]
                    sched.inflight_seq = sched.kv.inflight_seq = old[0].seq
                    if not quiet() or not sched.quiet_blocks_ok():
                        break
                    now = env._now
                    o_end = old[1]
                    t = now + (o_end - now) if o_end > now else now  # where it returns
                    dt = quiet_seconds()
                    end = (last_end if last_end > now else now) + dt
                    b_w: list = []
                    out, pending = sched.quiet_step(end, end - last_end, b_w, True)
                    out.scheduled_at = now
                    if self.trace is not None:
                        self._trace(out)
                    last_end = end
                    self.busy_seconds += dt
                    inflight.append((out, end, dt, pending, (), b_w))
                    q = env._queue  # another event first (env.peek()): wait for the return
                    if q and t >= q[0][0]:
                        break
                    inflight.popleft()
                    env._now = t
                    ran = True
                    batch_returns(old, t)
                if ran:
                    continue
            if len(inflight) < 2 and sched.has_requests():
                seq = inflight[0][0].seq if inflight else -1  # the batch in flight, if any
                sched.inflight_seq = sched.kv.inflight_seq = seq
                out = sched.schedule()
                if out.total_num_scheduled_tokens:
                    now = env._now
                    out.scheduled_at = now
                    if self.trace is not None:
                        self._trace(out)
                    dt = step_seconds(out.shape)
                    end = (last_end if last_end > now else now) + dt
                    # (this batch's ITL samples join the recorder's when it returns, so the
                    # per-step hook sees them last, as with synchronous stepping)
                    b_e, b_w = [], []
                    pending = sched.update_from_output(out, end, end - last_end, b_e, b_w,
                                                       defer=True)
                    last_end = end
                    self.busy_seconds += dt
                    inflight.append((out, end, dt, pending, b_e, b_w))
                    if len(inflight) < 2:
                        continue
                elif out.preempted and not inflight:
                    continue  # blocks were freed: schedule again at once
            if not inflight:
                yield from self._idle()
                continue
            item = inflight.popleft()
            wait = item[1] - env._now
            if wait > 0 and not advance(wait):  # (another event first)
                self._busy_until = item[1]
                yield env.timeout(wait)
            batch_returns(item, env._now)

    def _run_batch_queue(self):
        """``EngineCore.step_with_batch_queue`` for pipeline parallelism: up to
        ``max_concurrent_batches`` (= pp) batches in flight. A batch's latency is the cost
        model's step time (all stages + handoffs); it holds each stage for latency / pp, so a
        new batch enters the pipeline every latency / pp while the queue has room. Requests of
        a batch in flight advance ``num_computed_tokens`` at schedule time (vLLM's
        ``_update_after_schedule``), so a long prompt's next chunk can follow its previous
        one; an in-flight decode is scheduled again only with async scheduling, whose output
        placeholders stand for the token not yet back (``Scheduler.advance_after_schedule``)."""
        env = self.env
        sched = self.scheduler
        itl_e, itl_w = self.rec.itl_explicit, self.rec.itl_weighted
        pp = self.max_concurrent_batches
        record = self._recorder()
        advance = self._advance
        inflight: deque = deque()  # (out, start, done)
        self._inflight = inflight
        stage_free = 0.0
        while True:
            if len(inflight) < pp and sched.has_requests():
                out = sched.schedule()
                if out.total_num_scheduled_tokens:
                    out.scheduled_at = env.now
                    if self.trace is not None:
                        self._trace(out)
                    sched.advance_after_schedule(out)
                    latency = self.step_seconds(out.shape)
                    start = max(env.now, stage_free)
                    stage_free = start + latency / pp
                    inflight.append((out, start, start + latency))
                    self.busy_seconds += latency / pp
                    if len(inflight) < pp and inflight[0][2] > env.now:
                        continue  # vLLM blocks only when full or the oldest batch is done
                elif out.preempted and not inflight:
                    continue  # blocks were freed: schedule again at once
                elif inflight:  # vLLM queues the empty batch too: it holds a slot until the
                    inflight.append((None, env.now, env.now))  # batches ahead return
            if not inflight:
                yield from self._idle()
                continue
            out, start, done = inflight.popleft()
            if out is None:
                continue
            wait = done - env.now
            if wait > 0 and not advance(wait):  # (another event first)
                self._busy_until = done
                yield env.timeout(wait)
            now = env.now
            finished = sched.update_from_output(out, now, now - start, itl_e, itl_w)
            record(out, now, now - start)
            for r in finished:
                self.on_finish(r)
            if self._aborts:
                self._apply_aborts()
