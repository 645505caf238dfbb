"""The benchmark client (``vllm bench serve``) as a SimPy process, with the API server's checks.

The client sends requests like ``vllm bench serve``: at their arrival times, through an
optional ``max_concurrency`` semaphore, and multi-turn follow-ups after their parent finishes
(plus think time). Requests the API server would refuse are rejected at send time and counted
as failed, never dropped. Requests reaching the engine core(s) are routed as vLLM's DP load
balancer does (``DPLBAsyncMPClient``), or parked in compact columns (:class:`Parked`) behind a
single FCFS engine's long waiting queue.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import simpy
from servesim.simulator.request import FINISHED_REASON, Request, RequestStatus
from servesim.workloads.schema import RequestSpec

if TYPE_CHECKING:
    from servesim.simulator.engine import Replica
    from servesim.simulator.recorder import Recorder
_NAN = float("nan")
_INF = float("inf")


class Parked:
    """A FIFO of request specs in compact columns (29 bytes each instead of ~0.5 KB for a
    ``RequestSpec``, ~2 KB for a ``Request``): the client's queue under ``max_concurrency``,
    and requests sent to a single FCFS engine whose waiting queue is already long.

    Exact for vLLM's FCFS scheduler with chunked prefill: a step admits at most
    ``max_num_seqs`` requests from the head of the waiting queue and never looks further, so
    holding the tail back and moving it in after each step (``Client.refill``) changes no
    decision; the waiting gauge counts both. An overloaded replay (arrivals far above
    capacity) thus needs bounded memory however long the queue grows. Specs with fields
    other than the common ones are kept as objects (sparse)."""

    I32 = 2**31 - 1  # index and lengths as int32 (larger ones: kept as objects)

    def __init__(self):
        self.send = array("d")
        self.queued = array("d")  # engine tail: when the engine loop took it in (QUEUED)
        self.arrival = array("d")
        self.index = array("i")
        self.prompt_len = array("i")
        self.output_len = array("i")
        self.prefix = array("b")  # code into ``prefixes`` (-1: see ``special``)
        self.prefixes: list = [None]
        self.special: dict[int, RequestSpec] = {}  # absolute position -> spec
        self.head = 0
        self.base = 0  # absolute position of element 0

    def __len__(self) -> int:
        return len(self.send) - self.head

    def push(self, spec: RequestSpec, send_time: float, queued: float = _NAN) -> None:
        idx = spec.extra["_index"]
        code = -1
        i32 = self.I32
        if (idx <= i32 and spec.prompt_len <= i32 and spec.output_len <= i32
                and spec.request_id == str(idx) and spec.prompt_token_ids is None
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
        self.send.append(send_time)
        self.queued.append(queued)
        self.arrival.append(spec.arrival_s)
        self.prefix.append(code)
        if code < 0:
            self.special[self.base + len(self.send) - 1] = spec
            self.index.append(0)
            self.prompt_len.append(0)
            self.output_len.append(0)
            return
        self.index.append(idx)
        self.prompt_len.append(spec.prompt_len)
        self.output_len.append(spec.output_len)

    def pop(self) -> tuple[RequestSpec, float, float]:
        """(spec, send time, QUEUED time) of the head."""
        i = self.head
        code = self.prefix[i]
        if code < 0:
            spec = self.special.pop(self.base + i)
        else:
            idx = self.index[i]
            spec = RequestSpec(arrival_s=self.arrival[i], prompt_len=self.prompt_len[i],
                               output_len=self.output_len[i], request_id=str(idx),
                               prefix_block_ids=self.prefixes[code], extra={"_index": idx})
        send, queued = self.send[i], self.queued[i]
        self.head += 1
        if self.head >= 65536 and self.head * 2 >= len(self.send):  # drop the consumed head
            for a in (self.send, self.queued, self.arrival, self.index, self.prompt_len,
                      self.output_len, self.prefix):
                del a[:self.head]
            self.base += self.head
            self.head = 0
        return spec, send, queued


LB_REFRESH_S = 0.1  # vLLM DPCoordinator: min_stats_update_interval_ms = 100
# Dense models' DP ranks are independent EngineCoreProcs that publish no request counts (only
# MoE ranks, DPEngineCoreProc._maybe_publish_request_counts, do): the coordinator's counts
# stay [0, 0] and, unchanged, are republished every 5 s (DPCoordinatorProc.process_input_
# socket), resetting each API server's table
LB_IDLE_PUBLISH_S = 5.0


def lb_next_publish(now: float, engine_stats: bool, refresh_s: float) -> float:
    """When the DP coordinator next publishes counts to the balancers: ``refresh_s`` after
    ``now`` while engines send it theirs (``engine_stats``), else at the next multiple of
    ``refresh_s`` (its idle republish of zeros)."""
    if engine_stats:
        return now + refresh_s
    return (now // refresh_s + 1) * refresh_s if refresh_s > 0 else now


def dp_pick(counts: list[list[int]], server: int, num_servers: int) -> int:
    """One pick of vLLM's DP load balancer (``DPLBAsyncMPClient.get_core_engine_for_request``)
    in API server ``server`` of ``num_servers``, on its ``counts`` ([waiting, running] per
    engine): the least ``waiting·4 + running``, scanning from engine
    ``len(counts)·server // num_servers`` (wrapping), first minimum wins; the pick's waiting
    count is raised by ``num_servers`` (standing in for the other servers' picks)."""
    n = len(counts)
    start = n * server // num_servers
    best, best_score = start, None
    for j in range(n):
        i = (start + j) % n
        waiting, running = counts[i]
        score = waiting * 4 + running
        if best_score is None or score < best_score:
            best, best_score = i, score
    counts[best][0] += num_servers
    return best


class Client:
    """``vllm bench serve`` as a SimPy process: sends, concurrency limit, rejections, sessions."""

    def __init__(self, env: simpy.Environment, specs: Iterable[RequestSpec],
                 replicas: list[Replica], recorder: Recorder, *, max_model_len: int,
                 num_gpu_blocks: int, block_size: int, max_concurrency: int | None,
                 max_request_blocks: int | None = None,
                 on_progress: Callable[[int], None] | None = None,
                 park_after: int | None = None, control: dict | None = None,
                 frontend=None, api_servers: int = 1, dp_engine_stats: bool = False):
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
        # vLLM's DP load balancer (DPLBAsyncMPClient), one per API server: per-engine
        # [waiting, running] as last published by the DP coordinator: the engines' counts
        # every LB_REFRESH_S of simulated time when they publish them (``dp_engine_stats``:
        # MoE), else zeros every LB_IDLE_PUBLISH_S (dense models)
        # (API servers: the frontend's, else ``api_servers`` taking requests in turn)
        self._lb_counts: list[list[list[int]]] = [
            [[0, 0] for _ in replicas]
            for _ in range(frontend.n if frontend is not None else max(1, api_servers))]
        self._lb_next = 0.0
        self._lb_turn = 0
        self._lb_engine_stats = dp_engine_stats
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
            if t > env._now:
                yield env.timeout(t - env._now)
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
            self.frontend.submit(spec, env._now)
            return
        req = Request(spec, spec.extra["_index"], self.max_model_len, env.now)
        self.num_sent += 1
        if self._refused(req):
            return
        self.in_flight += 1
        if self.control is not None:
            self.control.sent(req)
        self._admit(req)

    def _refused(self, req: Request) -> bool:
        """Whether the API server refuses ``req`` at send time (:meth:`_reject_reason`); a
        refused request ends at once, failed with the reason."""
        reason = self._reject_reason(req)
        if not reason:
            return False
        req.error = reason
        req.status = RequestStatus.FINISHED_IGNORED
        req.finish_time = self.env.now
        self._end(req)
        return True

    def arrive_tokenized(self, spec: RequestSpec, send: float, arrival: float, server: int,
                         tokenized: float, queued: float) -> None:
        """A request through the frontend reaches the engine core (``arrival``: vLLM's
        arrival_time; the frontend's timestamps): parked as columns when the engine's queue is
        full (no ``Request`` built until it moves in), else built and passed to :meth:`_arrive`."""
        if (self.control is None and self._parks()
                and not self._rejection(*Request.limits(spec, self.max_model_len))):
            self.parked.push(spec, send, self.replicas[0].queued_at(queued))
            self.frontend.held.push(arrival, tokenized, server)
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
            self.parked.push(spec, req.send_time, self.replicas[0].queued_at(self.env._now))
            if self.frontend is not None:
                fe = req.fe
                self.frontend.held.push(req.arrival_time, fe[1], fe[0])
            return
        self._live[req.index] = req
        if len(self.replicas) == 1:
            self.replicas[0].add_request(req)
        else:
            if self.frontend is not None and req.fe is not None:
                server = req.fe[0]
            else:  # (no API-server model: the servers take requests in turn, as it would)
                server = self._lb_turn
                self._lb_turn = (server + 1) % len(self._lb_counts)
            self.replicas[self._route(server)].add_request(req)

    def _route(self, server: int = 0) -> int:
        """vLLM's DP load balancing (``DPLBAsyncMPClient.get_core_engine_for_request``) in API
        server ``server`` of ``c`` (each holds its own counts): the engine with the least
        ``waiting·4 + running`` in the coordinator's last published counts, scanning from
        engine ``num_engines·server // c`` (wrapping), first minimum wins; the chosen engine's
        waiting count is then raised by ``c`` locally until the next publish (standing in for
        the other servers' picks). MoE ranks publish their counts (every ``LB_REFRESH_S``);
        dense ranks publish none, so the tables reset to zeros every ``LB_IDLE_PUBLISH_S``
        (at multiples of it) and the picks follow the local increments alone."""
        now = self.env.now
        tables = self._lb_counts
        if now >= self._lb_next:
            live = self._lb_engine_stats
            fresh = [(r.scheduler.num_waiting, r.scheduler.num_running) if live else (0, 0)
                     for r in self.replicas]
            self._lb_next = lb_next_publish(now, live,
                                            LB_REFRESH_S if live else LB_IDLE_PUBLISH_S)
            for counts in tables:
                for i, (waiting, running) in enumerate(fresh):
                    counts[i][0], counts[i][1] = waiting, running
        return dp_pick(tables[server], server, len(tables))

    def refill(self) -> None:
        """Move parked requests into the engine until it has ``park_after`` waiting."""
        parked, replica = self.parked, self.replicas[0]
        sched = replica.scheduler
        while len(parked) and sched.num_waiting < self.park_after:
            spec, send, queued = parked.pop()
            req = Request(spec, spec.extra["_index"], self.max_model_len, send)
            if self.frontend is not None:
                self.frontend.held.pop_into(req, queued)
            else:
                req.queued_time = queued
            self._live[req.index] = req
            replica.add_taken_in(req)

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
            spec, send, queued = self.parked.pop()
            req = Request(spec, spec.extra["_index"], self.max_model_len, send)
            if self.frontend is not None:
                self.frontend.held.pop_into(req, queued)
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
