"""What benchmark clients do beyond ``vllm bench serve``: load stages, warm-up, timeouts.

:class:`ClientControl` is attached to the engine's :class:`~servesim.simulator.client.Client`
only when a run uses one of these (``Client(control=...)``); plain runs never touch it.

- **Stages** (``workload.stages``, ``workloads/stages.py``): the control's process replaces the
  client's arrival loop. Each stage starts when the previous one has drained (``barrier``,
  every request ended and none queued) plus ``gap_s``; the stage's requests keep their offsets
  from the stage start (``arrival_s`` minus the stage's nominal start). A closed-loop stage
  sends its next request only when fewer than ``concurrency`` are in flight; a stage with
  ``duration_s`` stops sending then, and requests still in flight ``grace_s`` later are
  cancelled (aborted in the engine, ``finished_reason`` ``cancelled``), requests still
  waiting in the client's queue at once. Inter-token latencies are attributed to the stage
  during which they were emitted (``Recorder.stage_itl``).
- **Warm-up**: a stage with ``warmup: true``, or the first ``num_requests`` /
  ``duration_s`` seconds of every stage (of the run when there are no stages), flag their
  requests ``extra["warmup"] = True``; reports leave them out of the metrics.
- **Timeouts** (``client.request_timeout_s``): a request not finished that long after it was
  sent is given up: the client records it failed (``timeout``) at that instant, frees its
  concurrency slot, and every engine aborts it (``Replica.abort``: vLLM's
  ``finish_requests(..., FINISHED_ABORTED)``; between steps). With ``max_retries`` the
  request is sent again as a new attempt instead (``attempts`` in requests.csv), latencies of
  the final attempt measured from its own send. Deadlines are monotone in send order, so one
  SimPy process and a FIFO watch all requests.
"""

from __future__ import annotations

import math
from collections import deque

from servesim.simulator.frontend import FE_SENT
from servesim.simulator.request import Request


class ClientControl:
    def __init__(self, client, *, stages: list[dict] | None = None, warmup: dict | None = None,
                 request_timeout_s: float | None = None, max_retries: int = 0,
                 meta: dict | None = None):
        self.c = client
        self.env = client.env
        self.plan = stages or []
        self.staged = bool(self.plan)
        self.meta = meta if meta is not None else {}
        warmup = warmup or {}
        self.warm_n = warmup.get("num_requests")
        self.warm_d = warmup.get("duration_s")
        self.timeout = request_timeout_s
        self.max_retries = int(max_retries or 0)
        self.base_concurrency = client.max_concurrency
        self.stage: dict | None = None
        self.stage_start = 0.0
        self.sent_in_stage = 0
        self.index = 0
        self._reasons: dict[int, str] = {}
        self._event = None  # a waiter: drain or a free slot
        self._watch: deque[tuple[float, Request]] = deque()
        self._watch_wake = None
        self.stage_windows: list[dict] = []  # per stage: index, start_s, end of sending
        if self.timeout is not None:
            self.env.process(self._watcher())

    # -- hooks called by the Client --------------------------------------------------------------
    def sending(self, spec) -> None:
        """The client sends ``spec`` (before the API server's checks): stage and warm-up
        flags."""
        extra = spec.extra
        st = self.stage
        warm = (st is not None and st["warmup"]) or (
            self.warm_n is not None and self.sent_in_stage < self.warm_n) or (
            self.warm_d is not None and self.env.now - self.stage_start < self.warm_d)
        if warm:
            extra["warmup"] = True
        self.sent_in_stage += 1

    def sent(self, req: Request) -> None:
        """Accepted by the server: start its timeout (from the client's send; with an API-server
        frontend the request reaches the engine core later)."""
        if self.timeout is not None:
            self._watch.append((req.send_time + self.timeout, req))
            w = self._watch_wake
            if w is not None and not w.triggered:
                w.succeed()

    def reason(self, req: Request, reason: str) -> str:
        return self._reasons.pop(req.index, reason)

    def ended(self, req: Request) -> None:
        ev = self._event
        if ev is not None and not ev.triggered:
            ev.succeed()

    # -- giving requests up ------------------------------------------------------------------------
    def give_up(self, req: Request, reason: str, error: str) -> None:
        """Client-side end of a live request (``timeout`` / ``cancelled``), then the engine's
        abort."""
        c = self.c
        req.error = error
        req.finish_time = self.env.now
        self._reasons[req.index] = reason
        # Recorded with the tokens it really got so far: a decode-group member's counters are
        # implicit, and under async scheduling they run ahead of the clock.
        stale = req.num_output_tokens, req.first_token_time
        for rep in c.replicas:
            got = getattr(rep.scheduler, "delivered", None)
            got = got(req, self.env.now) if got is not None else None
            if got is not None:
                req.num_output_tokens, req.first_token_time = got
                break
        fe = req.fe
        if fe is not None and len(fe) > FE_SENT:  # stream_interval > 1: what was sent
            req.num_output_tokens = min(req.num_output_tokens, fe[FE_SENT])
        c.on_finish(req)
        req.num_output_tokens, req.first_token_time = stale
        for rep in c.replicas:
            rep.abort(req)

    def _watcher(self):
        env, watch, c = self.env, self._watch, self.c
        while True:
            while watch and c._live.get(watch[0][1].index) is not watch[0][1]:
                watch.popleft()  # ended already
            if not watch:
                self._watch_wake = env.event()
                yield self._watch_wake
                self._watch_wake = None
                continue
            deadline, req = watch[0]
            if deadline > env.now:
                yield env.timeout(deadline - env.now)
                continue
            watch.popleft()
            if c._live.get(req.index) is not req:
                continue
            spec = req.spec
            attempts = spec.extra.get("attempts", 1)
            if attempts <= self.max_retries:  # send it again as a new attempt
                spec.extra["attempts"] = attempts + 1
                c._live.pop(req.index, None)
                c.in_flight -= 1
                for rep in c.replicas:
                    rep.abort(req)
                self.sent_in_stage -= 1  # the same request: warm-up flag unchanged
                c._send(spec)
                continue
            self.give_up(req, "timeout", f"timed out after {self.timeout:g} s "
                         "(client request_timeout_s); aborted")

    # -- stages -----------------------------------------------------------------------------------
    def _wait(self, limit: float = math.inf):
        """Wait for the next request end (or until ``limit``)."""
        self._event = self.env.event()
        if math.isfinite(limit):
            yield self._event | self.env.timeout(max(limit - self.env.now, 0.0))
        else:
            yield self._event
        self._event = None

    def _drain(self):
        c = self.c
        while c.in_flight > 0 or len(c._queue):
            yield from self._wait()

    def _cancel_stage(self, k: int, after: float):
        """``grace_s`` after a stage's duration: cancel its requests still in flight."""
        if after > 0:
            yield self.env.timeout(after)
        c = self.c
        for req in [r for r in c._live.values() if r.spec.extra.get("stage") == k]:
            if c._live.get(req.index) is req:
                self.give_up(req, "cancelled", "cancelled: still in flight when the stage's "
                             "duration and grace period ended")

    def _drop_queued(self, k: int) -> None:
        """Requests of stage ``k`` still in the client's queue when its duration ends: never
        sent; recorded as ``cancelled``."""
        from servesim.simulator.request import RequestStatus

        c = self.c
        keep = []
        while len(c._queue):
            spec, send, _ = c._queue.pop()
            if spec.extra.get("stage") != k:
                keep.append((spec, send))
                continue
            req = Request(spec, spec.extra["_index"], c.max_model_len, float("nan"))
            req.status = RequestStatus.FINISHED_ABORTED
            req.error = "cancelled: not sent before the stage's duration ended"
            self._reasons[req.index] = "cancelled"
            c._end(req)
        for spec, send in keep:
            c._queue.push(spec, send)

    def run(self):
        """The staged arrival process (replaces ``Client._arrivals``)."""
        env, c, rec = self.env, self.c, self.c.rec
        it = iter(c.specs)
        pending = next(it, None)
        ctl = self.meta.get("_stage_control")
        offset = 0.0
        for st in self.plan:
            k = st["index"]
            if k > 0 and st["barrier"]:
                yield from self._drain()
            if st["barrier"] or k == 0:
                if st["gap_s"] > 0:
                    yield env.timeout(st["gap_s"])
                offset = env.now - st["start_s"]
            elif st["start_s"] + offset > env.now:
                yield env.timeout(st["start_s"] + offset - env.now)
            self.stage, self.stage_start, self.sent_in_stage = st, env.now, 0
            rec.flush_itl()  # samples so far belong to the stages before
            rec.itl_stage = k
            c.max_concurrency = st["concurrency"] or self.base_concurrency
            dur = st["duration_s"]
            deadline = env.now + dur if dur is not None else math.inf
            window = {"index": k, "start_s": env.now, "deadline_s": deadline}
            self.stage_windows.append(window)
            if dur is not None and st["grace_s"] is not None:
                env.process(self._cancel_stage(k, dur + st["grace_s"]))
            cap = st["concurrency"]
            while pending is not None and pending.extra.get("stage") == k:
                if st["closed"]:
                    while c.in_flight >= cap and env.now < deadline:
                        yield from self._wait(deadline)
                    if env.now >= deadline:
                        break
                else:
                    t = pending.arrival_s + offset
                    if t > deadline + 1e-9 * max(1.0, abs(deadline)):
                        break
                    if t > env.now:
                        yield env.timeout(t - env.now)
                pending.extra["_index"] = self.index
                pending.request_id = str(self.index)
                self.index += 1
                c._offer(pending)
                pending = next(it, None)
            window["sent_until_s"] = env.now
            if pending is not None and pending.extra.get("stage") == k:
                if ctl is not None:  # end this stage's (possibly endless) stream
                    ctl.skip = k
                pending = next(it, None)
                while pending is not None and pending.extra.get("stage") == k:
                    pending = next(it, None)  # a bounded stage's unsent rest
            if math.isfinite(deadline):
                if deadline > env.now:
                    yield env.timeout(deadline - env.now)
                self._drop_queued(k)
        self.stage = None
