"""The replica engine and the benchmark client, as SimPy processes.

One event per engine step (``EngineCore.step``: schedule → execute → update_from_output): the
step's duration comes from the cost model; the engine sleeps when nothing is runnable and
wakes on an arrival. With async scheduling (vLLM's default) the engine keeps two batches in
flight (``EngineCore.step_with_batch_queue``): batch k+1 is scheduled when batch k−1 returns,
while batch k runs, so a request that arrives during batch k first runs in batch k+2. The client sends requests like ``vllm bench serve``: at their arrival
times, through an optional ``max_concurrency`` semaphore, and multi-turn follow-ups after their
parent finishes (plus think time). Requests the API server would refuse are rejected at send
time and counted as failed, never dropped.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import simpy
from servesim.simulator.request import FINISHED_REASON, Request, RequestStatus
from servesim.workloads.schema import RequestSpec

if TYPE_CHECKING:
    from servesim.simulator.metrics import Distribution
_NAN = float("nan")
_INF = float("inf")


class Recorder:
    """Columnar per-request and per-step records (array appends only on the hot path).

    Every ``chunk_rows`` ended requests (and every ``chunk_rows`` steps) the buffers are
    handed on and cleared in place: request rows to ``log`` (a
    :class:`~servesim.simulator.metrics.RequestLog`, which spills to disk for large runs),
    ITL samples to ``itl`` and step rows to ``steps`` (a ``StepSampler``), so memory stays
    bounded however long the run."""

    REQ = ("index", "arrival_s", "send_s", "prompt_len", "output_len", "num_cached_tokens",
           "first_scheduled_s", "first_token_s", "finish_s", "num_preemptions", "stage",
           "warmup", "attempts",
           # frontend (simulator/frontend.py) and engine-side times
           "frontend_arrival_s", "tokenized_s", "queued_s", "engine_first_token_s",
           "engine_finish_s", "first_token_iter_s", "finish_iter_s")
    SINK_ROWS = 4096  # request rows handed to ``sink`` at a time
    STEP = ("time_s", "step_seconds", "step_tokens", "running", "waiting", "kv_usage",
            "preemptions", "prefix_queries", "prefix_hits", "num_decode", "prefill_tokens",
            "generated")

    def __init__(self, log=None, itl=None, steps=None, chunk_rows: int | None = None):
        from servesim.simulator.metrics import CHUNK_ROWS, Distribution, RequestLog

        self.log = log if log is not None else RequestLog()
        self.itl = itl if itl is not None else Distribution()
        self.steps = steps  # a StepSampler, or None to keep step rows in ``step``
        self.chunk_rows = chunk_rows or CHUNK_ROWS
        self.req = {k: array("d") for k in self.REQ}
        # (the columns are cleared in place, so their bound appends stay valid)
        self._req_appends = tuple(self.req[k].append for k in self.REQ)
        self.request_id: list[str] = []
        self.reason: list[str] = []
        self.error: list[str] = []
        self.step = {k: array("d") for k in self.STEP}
        self.itl_explicit: list[float] = []
        self.itl_weighted: list[tuple[float, int]] = []
        # With a frontend: the engine's own inter-token gaps ((value, count) pairs; the lists
        # above then hold the client's) and the per-step hook (Frontend.on_step).
        self.engine_itl = Distribution()
        self.engine_itl_pairs: list[tuple[float, int]] = []
        self.on_step: Callable | None = None
        self.parked = None  # the client's Parked queue (counted as waiting), if any
        self.refill: Callable[[], None] | None = None  # moves parked requests in
        # Staged runs (simulator/client_control.py): ITL samples per stage, split at stage
        # starts (samples are attributed to the stage during which they were emitted).
        self.itl_stage: int | None = None
        self.stage_itl: dict[int, Distribution] = {}
        # Extra timeseries columns (speculative decoding / LoRA counters):
        # ``on_step_columns(out)`` appends one value to each of them after every step row.
        self.on_step_columns: Callable | None = None
        # Also hands request rows (raw fields, as they end) and step rows to this callable in
        # batches, ("rows", {field: values}) and ("steps", {column: values}), e.g.
        # ``reports.writers.RequestsCsvStream`` (the CSV files written meanwhile).
        self.sink: Callable[[tuple], None] | None = None
        self._shipped = 0  # buffered request rows already handed to the sink
        self._steps_shipped = 0  # buffered step rows already handed to the sink

    def add_step_columns(self, names, on_step: Callable) -> list:
        """Add step columns ``names`` (after ``STEP``); ``on_step(out)`` fills them after every
        step. Returns the column arrays, in order."""
        cols = []
        for k in names:
            self.step[k] = array("d")
            cols.append(self.step[k])
        self.on_step_columns = on_step
        return cols

    def record_request(self, r: Request, reason: str) -> None:
        (a_index, a_arrival, a_send, a_prompt, a_output, a_cached, a_sched, a_first, a_finish,
         a_preempt, a_stage, a_warmup, a_attempts, a_fe_arrival, a_tok, a_queued, a_e_first,
         a_e_fin, a_it_first, a_it_fin) = self._req_appends
        a_index(r.index)
        a_arrival(r.spec.arrival_s)
        a_send(r.send_time)
        a_prompt(r.prompt_len)
        a_output(r.num_output_tokens)
        a_cached(r.num_cached_tokens if r.num_cached_tokens > 0 else 0)
        a_sched(r.first_scheduled_time)
        a_first(r.first_token_time)
        a_finish(r.finish_time)
        a_preempt(r.num_preemptions)
        extra = r.spec.extra  # client fields (staged runs, warm-up, retries)
        a_stage(extra.get("stage", 0))
        a_warmup(1.0 if extra.get("warmup") else 0.0)
        a_attempts(extra.get("attempts", 1))
        a_fe_arrival(r.arrival_time)
        fe = r.fe  # frontend.FE_*: server, tokenized, queued, engine first/last token, ...
        if fe is None:
            tok = queued = r.send_time
            e_first = it_first = e_fin = it_fin = _NAN
        else:
            _, tok, queued, e_first, it_first, e_fin, it_fin = fe
        a_tok(tok)
        a_queued(queued)
        a_e_first(e_first)
        a_e_fin(e_fin)
        a_it_first(it_first)
        a_it_fin(it_fin)
        self.request_id.append(r.request_id)
        self.reason.append(reason)
        self.error.append(r.error)
        n = len(self.request_id)
        if n >= self.chunk_rows:
            self.flush()
        elif self.sink is not None and n - self._shipped >= self.SINK_ROWS:
            self._ship(n)

    def _ship(self, n: int) -> None:
        import numpy as np

        a = self._shipped
        rows = {k: np.frombuffer(v, dtype=float)[a:n].copy() for k, v in self.req.items()}
        rows["request_id"] = self.request_id[a:n]
        rows["finished_reason"] = self.reason[a:n]
        rows["error"] = self.error[a:n]
        self._shipped = n
        self.sink(("rows", rows))

    def ship_steps(self, n: int) -> None:
        import numpy as np

        a = self._steps_shipped
        rows = {k: np.frombuffer(v, dtype=float)[a:n].copy() for k, v in self.step.items()}
        self._steps_shipped = n
        self.sink(("steps", rows))

    def flush(self) -> None:
        """Hand the buffered rows and samples on; clear the buffers in place (the replicas'
        step closures and the scheduler hold references to them)."""
        import numpy as np

        if self.request_id:
            if self.sink is not None and self._shipped < len(self.request_id):
                self._ship(len(self.request_id))
            self._shipped = 0
            chunk = {k: np.frombuffer(v, dtype=float).copy() for k, v in self.req.items()}
            chunk["request_id"] = np.asarray(self.request_id, dtype=object)
            chunk["finished_reason"] = np.asarray(self.reason, dtype=object)
            chunk["error"] = np.asarray(self.error, dtype=object)
            self.log.append(chunk)
            for v in self.req.values():
                del v[:]
            del self.request_id[:], self.reason[:], self.error[:]
        self.flush_itl()
        if self.steps is not None:
            self.flush_steps()

    def flush_itl(self) -> None:
        import numpy as np

        stage = None
        if self.itl_stage is not None:
            stage = self.stage_itl.get(self.itl_stage)
            if stage is None:
                from servesim.simulator.metrics import Distribution

                stage = self.stage_itl[self.itl_stage] = Distribution()
        if self.itl_explicit:
            vals = np.asarray(self.itl_explicit, dtype=float)
            self.itl.add(vals)
            if stage is not None:
                stage.add(vals)
            del self.itl_explicit[:]
        if self.itl_weighted:
            pairs = np.asarray(self.itl_weighted, dtype=float).reshape(-1, 2)
            self.itl.add(pairs[:, 0], pairs[:, 1], group=1)
            if stage is not None:
                stage.add(pairs[:, 0], pairs[:, 1], group=1)
            del self.itl_weighted[:]
        if self.engine_itl_pairs:
            pairs = np.asarray(self.engine_itl_pairs, dtype=float).reshape(-1, 2)
            self.engine_itl.add(pairs[:, 0], pairs[:, 1])
            del self.engine_itl_pairs[:]

    def flush_steps(self) -> None:
        import numpy as np

        n = len(self.step["time_s"])
        if self.sink is not None and self._steps_shipped < n:
            self.ship_steps(n)
        self._steps_shipped = 0
        if n:
            self.steps.add({k: np.frombuffer(v, dtype=float).copy()
                            for k, v in self.step.items()})
            for v in self.step.values():
                del v[:]


class Replica:
    """One vLLM engine (``EngineCore``): scheduler + KV cache + step cost model."""

    def __init__(self, env: simpy.Environment, scheduler, step_seconds: Callable,
                 recorder: Recorder, on_finish: Callable[[Request], None], replica_id: int = 0,
                 max_concurrent_batches: int = 1, async_scheduling: bool = False,
                 decode_seconds: Callable[[int, int], float] | None = None):
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
        self.rec = recorder
        self.on_finish = on_finish
        self.replica_id = replica_id
        self._wake: simpy.Event | None = None
        self._aborts: list[Request] = []  # client aborts that arrived during a step
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
        self.scheduler.add_request(req)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

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
            c_run.append(sched.num_running)
            if parked:  # waiting = the engine's queue + the client's compact tail
                c_wait.append(sched.num_waiting + len(parked))
                rec.refill()
            else:
                c_wait.append(sched.num_waiting)
            c_kv.append(usage())
            c_pre.append(sched.num_preemptions)
            c_q.append(stats.queries)
            c_h.append(stats.hits)
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
        t = env.now + delay
        if t < env.peek():
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
                    now = env.now
                    dt = quiet_seconds()
                    end = now + dt  # (where env.timeout(dt) would land)
                    if end >= peek:
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
            out.scheduled_at = env.now
            if self.trace is not None:
                self._trace(out)
            dt = step_seconds(out.shape)
            if not advance(dt):  # (another event first)
                yield env.timeout(dt)
            now = env.now
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
                    now = env.now
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
                    if t >= env.peek():  # another event first: wait for the return below
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
                    now = env.now
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
            wait = item[1] - env.now
            if wait > 0 and not advance(wait):  # (another event first)
                yield env.timeout(wait)
            batch_returns(item, env.now)

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
                yield env.timeout(wait)
            now = env.now
            finished = sched.update_from_output(out, now, now - start, itl_e, itl_w)
            record(out, now, now - start)
            for r in finished:
                self.on_finish(r)
            if self._aborts:
                self._apply_aborts()


class Parked:
    """A FIFO of request specs in compact columns (~40 bytes each instead of ~0.5 KB for a
    ``RequestSpec``, ~2 KB for a ``Request``): the client's queue under ``max_concurrency``,
    and requests sent to a single FCFS engine whose waiting queue is already long.

    Exact for vLLM's FCFS scheduler with chunked prefill: a step admits at most
    ``max_num_seqs`` requests from the head of the waiting queue and never looks further, so
    holding the tail back and moving it in after each step (``Client.refill``) changes no
    decision; the waiting gauge counts both. An overloaded replay (arrivals far above
    capacity) thus needs bounded memory however long the queue grows. Specs with fields
    other than the common ones are kept as objects (sparse)."""

    def __init__(self):
        self.send = array("d")
        self.arrival = array("d")
        self.index = array("q")
        self.prompt_len = array("q")
        self.output_len = array("q")
        self.prefix = array("b")  # code into ``prefixes`` (-1: see ``special``)
        self.prefixes: list = [None]
        self.special: dict[int, RequestSpec] = {}  # absolute position -> spec
        self.head = 0
        self.base = 0  # absolute position of element 0

    def __len__(self) -> int:
        return len(self.send) - self.head

    def push(self, spec: RequestSpec, send_time: float) -> None:
        idx = spec.extra["_index"]
        code = -1
        if (spec.request_id == str(idx) and spec.prompt_token_ids is None
                and spec.priority == 0 and spec.session_id is None and spec.turn == 0
                and spec.lora is None and spec.ignore_eos and spec.parent_id is None
                and spec.think_time_s == 0 and spec.cache_salt is None and len(spec.extra) == 1):
            ids = spec.prefix_block_ids
            if ids is None:
                code = 0
            elif ids is self.prefixes[-1]:
                code = len(self.prefixes) - 1
            elif len(self.prefixes) < 100:
                self.prefixes.append(ids)
                code = len(self.prefixes) - 1
        if code < 0:
            self.special[self.base + len(self.send)] = spec
        self.send.append(send_time)
        self.arrival.append(spec.arrival_s)
        self.index.append(idx)
        self.prompt_len.append(spec.prompt_len)
        self.output_len.append(spec.output_len)
        self.prefix.append(code)

    def pop(self) -> tuple[RequestSpec, float]:
        i = self.head
        code = self.prefix[i]
        if code < 0:
            spec = self.special.pop(self.base + i)
        else:
            idx = self.index[i]
            spec = RequestSpec(arrival_s=self.arrival[i], prompt_len=self.prompt_len[i],
                               output_len=self.output_len[i], request_id=str(idx),
                               prefix_block_ids=self.prefixes[code], extra={"_index": idx})
        send = self.send[i]
        self.head += 1
        if self.head >= 65536 and self.head * 2 >= len(self.send):  # drop the consumed head
            for a in (self.send, self.arrival, self.index, self.prompt_len, self.output_len,
                      self.prefix):
                del a[:self.head]
            self.base += self.head
            self.head = 0
        return spec, send


LB_REFRESH_S = 0.1  # vLLM DPCoordinator: min_stats_update_interval_ms = 100


class Client:
    """``vllm bench serve`` as a SimPy process: sends, concurrency limit, rejections, sessions."""

    def __init__(self, env: simpy.Environment, specs: Iterable[RequestSpec],
                 replicas: list[Replica], recorder: Recorder, *, max_model_len: int,
                 num_gpu_blocks: int, block_size: int, max_concurrency: int | None,
                 max_request_blocks: int | None = None,
                 on_progress: Callable[[int], None] | None = None,
                 park_after: int | None = None, control: dict | None = None,
                 frontend=None):
        self.env = env
        # API servers between client and engines (simulator/frontend.py): a sent request
        # reaches an engine through frontend.submit → self._admit.
        self.frontend = frontend
        self.specs = iter(specs)
        self.replicas = replicas
        self.rec = recorder
        self.max_model_len = max_model_len
        self.max_blocks = num_gpu_blocks - 1  # the null block is never usable
        self.block_size = block_size
        # Blocks one request can hold at most (sliding window: the window's, not the length's)
        self.max_request_blocks = max_request_blocks
        self.max_concurrency = max_concurrency
        self.on_progress = on_progress
        self.in_flight = 0
        self.num_sent = 0
        self.num_done = 0
        self._queue = Parked()  # client-side queue under max_concurrency (compact, FIFO)
        self._children: dict[str, list[RequestSpec]] = {}
        self._ended: dict[str, float] = {}  # request_id -> end time, for session parents
        # vLLM's DP load balancer (DPLBAsyncMPClient): per-engine [waiting, running] as last
        # published by the DP coordinator, refreshed every LB_REFRESH_S of simulated time.
        self._lb_counts: list[list[int]] = [[0, 0] for _ in replicas]
        self._lb_next = 0.0
        self._live: dict[int, Request] = {}  # sent, not yet ended
        # No request is sent before this time but the one being sent now (-inf: unknown; see
        # _arrivals): the frontend tokenizes a prompt no other can join without window events
        self.next_send = -_INF
        # Compact queue behind a single FCFS engine's first ``park_after`` waiting requests
        # (see Parked); the recorder moves them in after every step and counts them waiting.
        self.park_after = park_after
        self.parked = Parked() if park_after is not None and len(replicas) == 1 else None
        if self.parked is not None:
            recorder.parked, recorder.refill = self.parked, self.refill
        # Load stages, warm-up, request timeouts (simulator/client_control.py); None: plain
        # ``vllm bench serve`` behaviour, and no per-request work at all.
        self.control = None
        if control:
            from servesim.simulator.client_control import ClientControl

            self.control = ClientControl(self, **control)
        self.process = env.process(self.control.run() if self.control is not None
                                   and self.control.staged else self._arrivals())

    def _arrivals(self):
        """Send the workload's requests at their times (session follow-ups when their parent
        ends), keeping ``next_send`` one request ahead for the frontend."""
        env = self.env
        index = 0
        specs = self.specs
        # ``next_send`` is known only while every send comes from this loop in spec order:
        # not under max_concurrency or client control (sends at finishes, stages), nor once a
        # session follow-up (sent when its parent ends) is in the workload
        ahead = self.max_concurrency is None and self.control is None
        nxt = next(specs, None)
        while nxt is not None:
            spec = nxt
            if spec.request_id is None:
                spec.request_id = str(index)
            spec.extra["_index"] = index
            index += 1
            if spec.parent_id is not None:
                ahead = False
                end = self._ended.get(spec.parent_id)
                if end is None:
                    self._children.setdefault(spec.parent_id, []).append(spec)
                    nxt = next(specs, None)
                    continue
                t = max(spec.arrival_s, end + spec.think_time_s)
            else:
                t = spec.arrival_s
            if t > env.now:
                yield env.timeout(t - env.now)
            nxt = next(specs, None)
            if ahead:
                if nxt is None:
                    self.next_send = _INF
                elif nxt.parent_id is None:
                    self.next_send = nxt.arrival_s
                else:
                    ahead = False
                    self.next_send = -_INF
            self._offer(spec)

    def _offer(self, spec: RequestSpec) -> None:
        if self.max_concurrency is not None and self.in_flight >= self.max_concurrency:
            self._queue.push(spec, float("nan"))
        else:
            self._send(spec)

    def _send(self, spec: RequestSpec) -> None:
        env = self.env
        if self.control is not None:
            self.control.sending(spec)
        if self.frontend is not None:  # through the API servers (simulator/frontend.py),
            self.num_sent += 1  # which call _arrive when it reaches the engine core
            self.in_flight += 1
            self.frontend.submit(spec, env.now)
            return
        req = Request(spec, spec.extra["_index"], self.max_model_len, env.now)
        self.num_sent += 1
        reason = self._reject_reason(req)
        if reason:
            req.error = reason
            req.status = RequestStatus.FINISHED_IGNORED
            req.finish_time = env.now
            self._end(req)
            return
        self.in_flight += 1
        if self.control is not None:
            self.control.sent(req)
        self._admit(req)

    def arrive_tokenized(self, spec: RequestSpec, send: float, arrival: float, server: int,
                         tokenized: float, queued: float) -> None:
        """A request through the frontend reaches the engine core (``arrival``: vLLM's
        arrival_time; the frontend's timestamps): parked as columns when the engine's queue is
        full (no ``Request`` built until it moves in), else built and passed to :meth:`_arrive`."""
        if (self.control is None and self._parks()
                and not self._rejection(*Request.limits(spec, self.max_model_len))):
            self.parked.push(spec, send)
            self.frontend.held.push(arrival, tokenized, queued, server)
            return
        req = Request(spec, spec.extra["_index"], self.max_model_len, send)
        req.arrival_time = arrival
        req.fe = [server, tokenized, queued, _NAN, _NAN, _NAN, _NAN]
        self._arrive(req)

    def _arrive(self, req: Request) -> None:
        """A request through the frontend reaches the engine core; vLLM's API server refuses
        it just before (after tokenization), else it is admitted."""
        reason = self._reject_reason(req)
        if reason:
            req.error = reason
            req.status = RequestStatus.FINISHED_IGNORED
            req.finish_time = self.env.now
            self.on_finish(req)
            return
        if self.control is not None:
            self.control.sent(req)
        self._admit(req)

    def _parks(self) -> bool:
        """Whether a request reaching the engine core now waits in the compact ``parked``
        queue (some already do, or the engine holds ``park_after`` waiting)."""
        parked = self.parked
        return parked is not None and (
            len(parked) > 0 or self.replicas[0].scheduler.num_waiting >= self.park_after)

    def _admit(self, req: Request) -> None:
        """``req`` reaches the engine core(s): park it or route it to a replica."""
        spec = req.spec
        if self._parks():
            self._live.pop(req.index, None)
            self.parked.push(spec, req.send_time)
            if self.frontend is not None:
                fe = req.fe
                self.frontend.held.push(req.arrival_time, fe[1], fe[2], fe[0])
            return
        self._live[req.index] = req
        if len(self.replicas) == 1:
            self.replicas[0].add_request(req)
        else:
            self.replicas[self._route()].add_request(req)

    def _route(self) -> int:
        """vLLM's DP load balancing (``DPLBAsyncMPClient.get_core_engine_for_request``): the
        engine with the least ``waiting·4 + running`` in the coordinator's last published
        counts (every ``LB_REFRESH_S``), scanning from engine 0, first minimum wins; the chosen
        engine's waiting count is then incremented locally until the next refresh."""
        now = self.env.now
        counts = self._lb_counts
        if now >= self._lb_next:
            for i, rep_ in enumerate(self.replicas):
                counts[i][0] = rep_.scheduler.num_waiting
                counts[i][1] = rep_.scheduler.num_running
            self._lb_next = now + LB_REFRESH_S
        best, best_score = 0, None
        for i, (waiting, running) in enumerate(counts):
            score = waiting * 4 + running
            if best_score is None or score < best_score:
                best, best_score = i, score
        counts[best][0] += 1
        return best

    def refill(self) -> None:
        """Move parked requests into the engine until it has ``park_after`` waiting."""
        parked, replica = self.parked, self.replicas[0]
        sched = replica.scheduler
        while len(parked) and sched.num_waiting < self.park_after:
            spec, send = parked.pop()
            req = Request(spec, spec.extra["_index"], self.max_model_len, send)
            if self.frontend is not None:
                self.frontend.held.pop_into(req)
            self._live[req.index] = req
            replica.add_request(req)

    def _reject_reason(self, req: Request) -> str:
        """Why the API server refuses ``req`` ("" if it does not), :meth:`_rejection`."""
        return self._rejection(req.prompt_len, req.max_tokens, req.eos_after)

    def _rejection(self, p: int, m: int, eos_after: int | None) -> str:
        """Why the API server refuses a request of prompt ``p``, ``max_tokens`` ``m``, EOS
        after ``eos_after`` outputs ("" if it does not): an empty prompt, vLLM's
        context-length check (``TokenizeParams._token_len_check``: prompt + max_tokens must
        fit in max_model_len, whether or not ``ignore_eos`` is set; without an explicit
        ``max_tokens`` it is what fits, at least 1), or a sequence the whole KV cache cannot
        hold."""
        mml = self.max_model_len
        if p <= 0:
            return "empty prompt"
        if p + m > mml:
            return (f"This model's maximum context length is {mml} tokens. However, you "
                    f"requested {m} output tokens and your prompt contains {p} input tokens, "
                    f"for a total of {p + m} tokens. Please reduce the length of the input "
                    "prompt or the number of requested output tokens.")
        final = p + min(m, eos_after or m)
        need = -(-min(final, mml) // self.block_size)
        if self.max_request_blocks is not None:
            need = min(need, self.max_request_blocks)
        if need > self.max_blocks:
            return (f"needs {need} KV blocks, more than the whole cache ({self.max_blocks}); "
                    "vLLM would never schedule it")
        return ""

    def on_finish(self, req: Request) -> None:
        if self.control is not None and self._live.get(req.index) is not req:
            return  # the client gave it up (timeout, cancellation) before the engine ended it
        self.in_flight -= 1
        self._end(req)
        while len(self._queue) and (self.max_concurrency is None
                                    or self.in_flight < self.max_concurrency):
            self._send(self._queue.pop()[0])

    def finalize(self) -> None:
        """After the event loop drains: record whatever never ended (still in an engine, in
        the client queue, or waiting for a parent that never finished) as ``in_flight``, so
        every request of the workload has a row. Normally there is none."""
        while self.parked is not None and len(self.parked):
            spec, send = self.parked.pop()
            req = Request(spec, spec.extra["_index"], self.max_model_len, send)
            if self.frontend is not None:
                self.frontend.held.pop_into(req)
            self._live[req.index] = req
        for spec, send in (self.frontend.drain() if self.frontend is not None else ()):
            req = Request(spec, spec.extra["_index"], self.max_model_len, send)
            self._live[req.index] = req
        for req in sorted(self._live.values(), key=lambda r: r.index):
            req.error = req.error or "still in flight when the simulation ended"
            self._end(req)
        pending = [self._queue.pop()[0] for _ in range(len(self._queue))]
        pending += [s for kids in self._children.values() for s in kids]
        for spec in pending:
            req = Request(spec, spec.extra["_index"], self.max_model_len, float("nan"))
            req.error = "never sent: the simulation ended first"
            self._end(req)
        self._children.clear()

    def _end(self, req: Request) -> None:
        self._live.pop(req.index, None)
        reason = FINISHED_REASON.get(req.status, "in_flight")
        if self.control is not None:
            reason = self.control.reason(req, reason)
        self.rec.record_request(req, reason)
        self.num_done += 1
        rid = req.request_id
        if req.spec.session_id is not None:
            self._ended[rid] = req.finish_time
        kids = self._children.pop(rid, None)
        if kids:
            for spec in kids:
                delay = max(spec.arrival_s, req.finish_time + spec.think_time_s) - self.env.now
                self.env.process(self._delayed(spec, delay))
        if self.on_progress is not None:
            self.on_progress(self.num_done)
        if self.control is not None:
            self.control.ended(req)

    def _delayed(self, spec: RequestSpec, delay: float):
        if delay > 0:
            yield self.env.timeout(delay)
        self._offer(spec)
