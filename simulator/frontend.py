"""The API-server frontend: what a client sees on top of the engine core.

vLLM V1 serves the OpenAI API from ``api_server_count`` API-server processes (default:
``data_parallel_size``), each a single-threaded asyncio loop (``AsyncLLM``) in front of the
engine-core process(es). A streamed completion request goes

    client ─HTTP─► API server: parse + validate (asyncio thread)
                   └► renderer: tokenize (tokenizer thread, 2 ms micro-batches)
                   └► process_inputs + ZMQ send ─IPC─► engine core (waiting queue)
    engine step ends ─IPC─► API server output handler: detokenize + SSE chunk per token
                                                         (asyncio thread) ─► client

and this module models each arrow with a named parameter (:class:`FrontendParams`, seconds):

==========================  ======================================================  ========
parameter                   what it is                                              prior
==========================  ======================================================  ========
``request_s``               asyncio-thread CPU per request: HTTP parse, pydantic    125 µs
                            validation, sampling params, engine request encode,
                            final usage/[DONE] events
``tokenize_per_token_s``    tokenizer-thread CPU per prompt token (HF tokenizers    1.0 µs
                            BPE encode)
``ipc_s``                   one-way API server ↔ engine core hop (serialise, ZMQ    105 µs
                            IPC socket, deserialise); paid on the way in and on
                            the way out
``detokenize_per_token_s``  asyncio-thread CPU per output token: incremental        4.3 µs
                            detokenize (``DecodeStream``) + one SSE chunk
``stream_chunk_s``          the share of ``detokenize_per_token_s`` that is the     3.8 µs
                            SSE chunk (stream response built, serialised, sent):
                            paid per chunk when ``stream_interval`` > 1
``tokenizer_batch_wait_s``  micro-batch window of vLLM's                            2 ms
                            ``AsyncMicrobatchTokenizer`` (``batch_wait_timeout_s``)
``tokenizer_max_batch``     prompts per tokenizer call (``max_batch_size``)          32
==========================  ======================================================  ========

Sources. The last two are constants of vLLM 0.22's ``vllm/utils/async_utils.py`` (the
completion path tokenizes through ``Renderer.render_cmpl_async`` → ``AsyncMicrobatchTokenizer``
on the renderer's one-worker thread pool, ``renderer_num_workers = 1``): the batcher takes the
first queued prompt, waits until 2 ms have passed or 32 prompts are queued, tokenizes them in
one call on the worker thread, and only then takes the next batch. The five costs are
measured lower bounds from ``benchmarks/frontend_costs.py`` (Intel Xeon, Python 3.11,
tokenizers 0.23.3, pydantic 2.14: the same libraries doing the same work, without uvicorn /
ASGI / asyncio task-switch overhead). They are priors: ``simulate fit`` replaces them with a
deployment's own values (``frontend:`` in a calibration file; ``frontend:`` in the config
overrides both).

Queueing. Each API server is one FIFO server for its asyncio thread (request work at the
send time; output work of an engine step when it arrives, ``ipc_s`` after the step) and one
batch server for its tokenizer thread, so under high request or token rates the frontend
becomes the bottleneck, as a single Python process does. Requests go to API servers round
robin (the kernel spreads connections over the processes); the tokens of an engine step are
split evenly over the API servers (exact for one). Tokens of one step reach the client
together when its output work is done.

Stream interval (vLLM ``--stream-interval N``, ``RequestState.make_request_output``): the
output processor detokenizes every token as it comes but sends a request's output only with
its first token, when N tokens are unsent, or when it finishes; the tokens of several steps
then reach the client in one SSE chunk, and the client's inter-token gap (``vllm bench
serve``: one per chunk) is the time between chunks. With N > 1 the output work of a step is
``detokenize_per_token_s − stream_chunk_s`` per token plus ``stream_chunk_s`` per chunk sent
(N = 1: ``detokenize_per_token_s`` per token, as before), and the engine runs its exact
per-request loop (the decode group hides the members' token counts that decide the chunks).

Timestamps (vLLM's names): ``arrival_time`` = when the renderer starts (after HTTP parse and
validation; ``vllm:time_to_first_token_seconds`` and ``vllm:e2e_request_latency_seconds`` are
measured from it to the output handler's ``iteration_timestamp``, the start of the output
work); ``queued_time`` = the engine loop takes the request in: when it reaches the engine
core, or when the step running then ends (``Replica.queued_at``; ``request_queue_time_seconds``
= first scheduled − queued). A request's client-visible first-token / finish times are the end
of the output work of the step that produced them.

Requests the API server refuses (prompt too long for ``max_model_len``, ...) are refused
when they would reach the engine core (after tokenization, as vLLM's serving layer does).

Cost. No event per token or per request: per engine step one O(1) update per API server (plus
the explicitly scheduled rows), per tokenizer batch two events (its close, its arrival at
the engine core; a prompt that reaches an idle tokenizer and that no other can join before
the window's deadline, as the client's next send time tells, is one batch with no close
event), and, under ``max_concurrency`` only, one event per step with finished requests
(the client's slot frees when it sees them finish). Requests waiting for a tokenizer
are kept as specs (compact columns beyond 65,536), built into ``Request`` objects by the
client when they reach the engine core (unless it parks them).
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import asdict, dataclass, fields, replace

import simpy
from servesim.simulator.request import RequestStatus

# (name, unit, what) of the fitted parameters, in table order
FIT_PARAMS = ("request_s", "tokenize_per_token_s", "ipc_s", "detokenize_per_token_s")
PRIOR_SOURCE = "prior: benchmarks/frontend_costs.py (lower bound) + vLLM 0.22 async_utils.py"


@dataclass(frozen=True)
class FrontendParams:
    """Per-API-server costs in seconds (see the module docstring for sources)."""

    request_s: float = 125e-6
    tokenize_per_token_s: float = 1.0e-6
    ipc_s: float = 105e-6
    detokenize_per_token_s: float = 4.3e-6
    stream_chunk_s: float = 3.8e-6
    tokenizer_batch_wait_s: float = 0.002  # vLLM AsyncMicrobatchTokenizer.batch_wait_timeout_s
    tokenizer_max_batch: int = 32  # vLLM AsyncMicrobatchTokenizer.max_batch_size

    @classmethod
    def from_dict(cls, d: dict | None) -> FrontendParams:
        if not d:
            return cls()
        names = {f.name for f in fields(cls)}
        kw = {}
        for k, v in d.items():
            if k in names and v is not None:
                kw[k] = int(v) if k == "tokenizer_max_batch" else float(v)
        return cls(**kw)

    def updated(self, **kw) -> FrontendParams:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    def as_dict(self) -> dict:
        return asdict(self)


def resolve_frontend(cfg, calibration=None) -> tuple[FrontendParams | None, int, dict]:
    """(params or None when disabled, api_server_count, provenance per parameter) for a
    resolved config: defaults, then the calibration file's ``frontend:``, then the config's
    ``frontend:`` values."""
    fc = getattr(cfg, "frontend", None)
    if fc is not None and not fc.enable:
        return None, 0, {}
    params = FrontendParams()
    prov = {f.name: PRIOR_SOURCE for f in fields(FrontendParams)}
    cal = getattr(calibration, "frontend", None) or {}
    if cal:
        params = FrontendParams.from_dict({**params.as_dict(), **cal})
        src = f"calibration:{getattr(calibration, 'frontend_source', '')}"
        for k in cal:
            if k in prov:
                prov[k] = src
    if fc is not None:
        over = {f.name: getattr(fc, f.name) for f in fields(FrontendParams)
                if getattr(fc, f.name, None) is not None}
        params = params.updated(**over)
        for k in over:
            prov[k] = "config"
    n = (fc.api_server_count if fc is not None and fc.api_server_count else
         cfg.parallel.data_parallel_size)
    return params, int(n), prov


class _Ingress:
    """Requests waiting for an API server's tokenizer, FIFO: (spec, send, arrival) tuples for
    the first ``SHORT`` (≈ 0.3 KB each), compact columns (``client.Parked`` plus arrival times)
    beyond, so a burst of millions sent at once holds no per-request objects (a spec is
    rebuilt when it leaves the columns: kept for bursts past the objects' memory budget)."""

    SHORT = 65_536

    def __init__(self):
        from servesim.simulator.client import Parked

        self.d: deque = deque()
        self.q = Parked()
        self.t = array("d")  # arrival times of the compact part
        self.h = 0

    def __len__(self) -> int:
        return len(self.d) + len(self.q)

    def push(self, spec, send: float, t: float) -> None:
        if len(self.d) < self.SHORT and not len(self.q):
            self.d.append((spec, send, t))
        else:
            self.q.push(spec, send)
            self.t.append(t)

    def at(self, k: int) -> float:
        """Arrival time of the k-th queued request."""
        nd = len(self.d)
        return self.d[k][2] if k < nd else self.t[self.h + k - nd]

    def pop(self):
        if self.d:
            return self.d.popleft()
        spec, send, _ = self.q.pop()
        h = self.h
        t = self.t[h]
        self.h = h + 1
        if self.h >= 65536 and self.h * 2 >= len(self.t):
            del self.t[:self.h]
            self.h = 0
        return spec, send, t


class _ApiServer:
    """One API-server process: its asyncio thread (FIFO, ``busy`` = when it is next free) and
    its tokenizer thread (micro-batches, ``tok_free`` = when the batcher takes the next; the
    window being filled opens at ``opened`` and closes by ``deadline``; ``gen`` numbers the
    windows so that an event of a closed one is ignored; ``settled``: a full batch closes it
    at ``opened``)."""

    __slots__ = ("busy", "deadline", "gen", "ingress", "last_done", "last_start",
                 "opened", "settled", "tok_free")

    def __init__(self):
        self.busy = 0.0
        self.tok_free = 0.0
        self.ingress = _Ingress()
        self.opened = -1.0  # < 0: no window open
        self.deadline = 0.0
        self.settled = False
        self.gen = 0
        self.last_start = 0.0  # output work of the latest engine step: start, end
        self.last_done = 0.0


# Request.fe: [API server, tokenized, queued (engine core got it), engine first token,
# output work of the first token starts, engine last token, output work of the last starts]
FE_SERVER, FE_TOKENIZED, FE_QUEUED, FE_ENGINE_FIRST, FE_FIRST_ITER, FE_ENGINE_FINISH, \
    FE_FINISH_ITER = range(7)
# stream_interval > 1 appends, at the first token: tokens the output processor has, of which
# sent, and when the client got the last chunk
FE_TOKENS, FE_SENT, FE_LAST_CHUNK = range(7, 10)
_NAN = float("nan")
_INF = float("inf")
_LATE = 2  # event priority after SimPy's URGENT (0) and NORMAL (1) at the same instant


def _unknown() -> float:
    """``Frontend.next_send`` when no client says: any time (every window waits for its deadline)."""
    return -_INF


class Held:
    """Frontend timestamps of requests the client parked in compact columns
    (``client.Parked``), in the same FIFO order, so a request rebuilt from its spec gets them
    back."""

    def __init__(self):
        # arrival_time, tokenized, API server (at most MAX_ENGINES: int16); the QUEUED time
        # is the parked entry's own (``client.Parked``)
        self.cols = (array("d"), array("d"), array("h"))
        self.head = 0

    def push(self, arrival: float, tokenized: float, server: int) -> None:
        a, t, s = self.cols
        a.append(arrival)
        t.append(tokenized)
        s.append(server)

    def pop_into(self, req, queued: float) -> None:
        a, t, s = self.cols
        i = self.head
        req.arrival_time = a[i]
        req.fe = [s[i], t[i], queued, _NAN, _NAN, _NAN, _NAN]
        self.head = i + 1
        if self.head >= 65536 and self.head * 2 >= len(a):
            for c in self.cols:
                del c[:self.head]
            self.head = 0


class Frontend:
    """``api_server_count`` API servers between the client and the engine replicas.

    ``submit(spec, send)`` takes a request at its send time and hands it to ``admit(spec,
    send, arrival_time, server, tokenized, queued)`` (the client's engine-side dispatch) when
    it reaches the engine core; ``on_step`` (called by
    the recorder after each engine step) computes when the step's tokens reach the client;
    ``on_engine_finish(req)`` defers the client's ``on_finish`` to that moment."""

    RING = 64  # recent steps per replica kept for inter-token gap look-ups

    def __init__(self, env: simpy.Environment, params: FrontendParams, num_servers: int,
                 admit, client_finish, recorder=None, stream_interval: int = 1):
        self.env = env
        self.stream_interval = int(stream_interval)
        if self.stream_interval > 1:  # (chosen once: on_step runs every step)
            self.on_step = self._on_step_stream
        # ``itl_hook(req, gap)``: each client-side inter-token gap of a request (per-request
        # ITLs for output.save_detailed; the exact loop only: no decode group)
        self.itl_hook = None
        # False when nothing waits for a finished request's client slot (no max_concurrency):
        # the client's bookkeeping then runs at once, its times already the client's
        self.defer_finish = True
        self.p = params
        self.n = max(1, int(num_servers))
        self.servers = [_ApiServer() for _ in range(self.n)]
        self.admit = admit
        self.client_finish = client_finish
        self.rec = recorder
        self.held = Held()
        self._rr = 0
        self._rings: dict[int, deque] = {}
        self._pending_t = -1.0
        self._pending: list | None = None
        self.num_batches = 0
        self.busy_seconds = [0.0] * self.n
        # () -> the earliest time the client may send another request (-inf: unknown)
        self.next_send = _unknown

    # -- request path --------------------------------------------------------------------------

    def submit(self, spec, send: float) -> None:
        """The client sent ``spec`` at ``send`` (now): queue its request work on an API
        server's asyncio thread; it then waits for the tokenizer."""
        i = self._rr
        self._rr = (i + 1) % self.n
        s = self.servers[i]
        start = s.busy if s.busy > send else send
        done = start + self.p.request_s
        s.busy = done
        self.busy_seconds[i] += self.p.request_s
        if s.opened < 0:  # an idle tokenizer (nothing queued)
            p = self.p
            opened = done if done > s.tok_free else s.tok_free
            deadline = opened + p.tokenizer_batch_wait_s
            if p.tokenizer_max_batch > 1 and self.next_send() > deadline:
                # no other prompt can join its window: it closes alone at the deadline, as
                # _window + _close would have it (the same arithmetic), with no event
                self._tokenized(i, [(spec, send, done)],
                                deadline + p.tokenize_per_token_s * spec.prompt_len)
                return
            s.ingress.push(spec, send, done)  # done: vLLM's arrival_time (the renderer starts)
            self._window(i, True)
            return
        s.ingress.push(spec, send, done)
        if not s.settled and send <= s.opened:
            self._full(i)

    # -- tokenizer: vLLM's ``AsyncMicrobatchTokenizer._batch_encode_loop``, one per API server
    # A batch window opens at its first prompt's arrival_time or when the previous batch is
    # tokenized, whichever is later (``opened``), and closes ``tokenizer_batch_wait_s`` later
    # (``deadline``) with every prompt queued by then, or at ``opened`` when 32 prompts
    # (``tokenizer_max_batch``) are queued by then and the 32nd arrives by the deadline (it
    # closes at that arrival). Events: one at the close (the deadline, or ``opened`` for a full
    # batch) and one when the batch reaches the engine core. "By then" includes prompts sent at
    # that very instant (the window's events come last among the instant's events).

    def _window(self, i: int, idle: bool) -> None:
        """Open server ``i``'s next window (its queue is not empty). ``idle``: the first prompt
        was just queued to an idle tokenizer, which takes it as its next event (a window that
        opens now is looked at after the events already due now)."""
        s = self.servers[i]
        q = s.ingress
        now = self.env.now
        opened = q.at(0)
        if s.tok_free > opened:
            opened = s.tok_free
        s.opened, s.deadline = opened, opened + self.p.tokenizer_batch_wait_s
        s.settled = False
        s.gen += 1
        if opened <= now:
            if idle:
                self._at(0.0, self._at_opened, i, s.gen)
            else:
                self._at_opened(i, s.gen)
        elif not self._full(i):
            self._at(s.deadline - now, self._at_deadline, i, s.gen)

    def _full_close(self, s: _ApiServer) -> float | None:
        """When a full batch closes ``s``'s window: at the 32nd queued prompt's arrival if
        it comes by the deadline (not before ``opened``), else None (not full)."""
        q, cap = s.ingress, self.p.tokenizer_max_batch
        if len(q) >= cap:
            c = q.at(cap - 1)
            if c <= s.deadline:
                return c if c > s.opened else s.opened
        return None

    def _full(self, i: int) -> bool:
        """Whether 32 prompts queued by ``opened`` close the window then (the 32nd arrived by
        the deadline); if so, the close is set for ``opened``."""
        s = self.servers[i]
        if self._full_close(s) is None:
            return False
        s.settled = True
        self._at(s.opened - self.env.now, self._at_opened, i, s.gen)
        return True

    def _at(self, delay: float, fn, i: int, gen: int) -> None:
        """``fn(i, gen)`` ``delay`` seconds from now, after every other event of that instant
        (a prompt sent at the very instant a window opens or closes is in the queue then)."""
        ev = simpy.Event(self.env)
        ev._ok, ev._value = True, None
        ev.callbacks.append(lambda _ev: fn(i, gen))
        self.env.schedule(ev, _LATE, delay)

    def _at_opened(self, i: int, gen: int) -> None:
        """The window's opening: a full batch closes now, else at the deadline."""
        s = self.servers[i]
        if gen != s.gen:
            return
        now = self.env.now
        close = self._full_close(s)
        if close is not None:
            self._close(i, close)
        elif s.deadline > now:  # (a prompt sent later is past ``opened``: no new check)
            self._at(s.deadline - now, self._at_deadline, i, gen)
        else:
            self._close(i, s.deadline)

    def _at_deadline(self, i: int, gen: int) -> None:
        s = self.servers[i]
        if gen == s.gen:
            self._close(i, s.deadline)

    def _close(self, i: int, close: float) -> None:
        """Take the batch (at most 32 prompts queued by ``close``); it reaches the engine core
        ``tokenize_per_token_s`` per prompt token and one IPC hop later."""
        s = self.servers[i]
        q, cap = s.ingress, self.p.tokenizer_max_batch
        now = self.env.now
        batch = []
        tokens = 0
        while len(q) and len(batch) < cap and q.at(0) <= close:
            item = q.pop()
            batch.append(item)
            tokens += item[0].prompt_len
        s.opened = -1.0
        s.gen += 1  # (events of this window are void)
        self._tokenized(i, batch, (close if close > now else now)
                        + self.p.tokenize_per_token_s * tokens)
        if len(q):
            self._window(i, False)

    def _tokenized(self, i: int, batch: list, done: float) -> None:
        """Server ``i``'s tokenizer finishes ``batch`` at ``done`` (and takes its next batch
        then); the batch reaches the engine core one IPC hop later."""
        self.servers[i].tok_free = done
        self.num_batches += 1
        ev = self.env.timeout(done + self.p.ipc_s - self.env.now)
        ev.callbacks.append(lambda _ev, b=batch, i=i, d=done: self._to_engine(b, i, d))

    def _to_engine(self, batch: list, server: int, tokenized: float) -> None:
        """A tokenized batch reaches the engine core: ``admit(spec, send time, arrival_time,
        API server, tokenized, queued)`` for each request (the client builds it)."""
        now = self.env.now
        admit = self.admit
        for spec, send, t in batch:
            admit(spec, send, t, server, tokenized, now)

    # -- output path ---------------------------------------------------------------------------

    def on_step(self, replica_id: int, out, now: float, itl_explicit: list,
                itl_weighted: list, engine_itl: list) -> None:
        """After an engine step that ended at ``now``: the output work of its tokens on each
        API server, the client's first-token times, and inter-token gaps as the client sees
        them (the engine's gaps move to ``engine_itl`` as (value, count) pairs)."""
        # tokens the step generated: vLLM's output processor detokenizes new tokens only
        # (no output for a mid-prefill chunk's logits row, accepted drafts + 1 per row)
        n_tok = out.num_new_tokens
        if not n_tok:
            return
        p = self.p
        arrive = now + p.ipc_s
        n = self.n
        if n == 1:
            s = self.servers[0]
            start = s.busy if s.busy > arrive else arrive
            work = p.detokenize_per_token_s * n_tok
            s.busy = done = start + work
            self.busy_seconds[0] += work
            s.last_start, s.last_done = start, done
            delays = done - now
        else:
            base, extra = divmod(n_tok, n)
            dl = []
            for i, s in enumerate(self.servers):
                k = base + (1 if i < extra else 0)
                start = s.busy if s.busy > arrive else arrive
                work = p.detokenize_per_token_s * k
                s.busy = done = start + work
                self.busy_seconds[i] += work
                s.last_start, s.last_done = start, done
                dl.append(done - now)
            delays = tuple(dl)
        ring = self._rings.get(replica_id)
        if ring is None:
            ring = self._rings[replica_id] = deque(maxlen=self.RING)
        prev = ring[-1][1] if ring else delays
        # decode group of a fast step: every member's previous token came the step before
        if out.fast and out.num_group and itl_weighted:
            v, c = itl_weighted[-1]
            engine_itl.append((v, c))
            t = now - v
            if ring and abs(ring[-1][0] - t) <= 1e-9 * (1.0 + t):  # the previous step
                before = prev
            else:
                before = self._delay_at(ring, t, prev)
            if n == 1:
                itl_weighted[-1] = (v + delays - before, c)
            else:
                base, extra = divmod(c, n)
                itl_weighted.pop()
                for i in range(n):
                    k = base + (1 if i < extra else 0)
                    if k:
                        itl_weighted.append((v + delays[i] - before[i], k))
        sampled = out.sampled  # the rows that got a token (not mid-prefill chunks)
        if sampled is None:
            sampled = [r for r, _, _ in out.scheduled if r.last_token_time == now]
        if sampled:
            k = len(itl_explicit)
            rows = []
            for req in sampled:
                fe = req.fe
                if fe[3] != fe[3]:  # NaN: its first token
                    srv = self.servers[fe[0]] if n > 1 else self.servers[0]
                    fe[3] = now
                    fe[4] = srv.last_start
                    req.first_token_time = srv.last_done
                else:
                    rows.append(req)
            if rows:
                k -= len(rows)
                hook = self.itl_hook
                for j, req in enumerate(rows):
                    v = itl_explicit[k + j]
                    engine_itl.append((v, 1))
                    before = self._delay_at(ring, now - v, prev)
                    if n == 1:
                        itl_explicit[k + j] = v + delays - before
                    else:
                        a = req.fe[0]
                        itl_explicit[k + j] = v + delays[a] - before[a]
                    if hook is not None:
                        hook(req, itl_explicit[k + j])
        ring.append((now, delays))

    def _on_step_stream(self, replica_id: int, out, now: float, itl_explicit: list,
                        itl_weighted: list, engine_itl: list) -> None:
        """:meth:`on_step` under ``stream_interval`` > 1."""
        if out.num_new_tokens:
            self._on_step_chunks(out, now, itl_explicit, engine_itl)

    def _on_step_chunks(self, out, now: float, itl_explicit: list, engine_itl: list) -> None:
        """:meth:`on_step` with ``stream_interval`` N > 1 (exact loop: no decode group). A
        row's request sends a chunk with its first token, when N of its tokens are unsent, or
        when it finishes (vLLM ``RequestState.make_request_output``); each sampled row left
        one engine gap in ``itl_explicit`` (non-first tokens), which becomes the client's gap
        since the request's previous chunk if it sends, else none. The step's output work:
        ``detokenize_per_token_s − stream_chunk_s`` per token, ``stream_chunk_s`` per chunk.
        Rows of requests aborted meanwhile (the client gave up) are dropped, as vLLM's output
        processor drops outputs of requests it no longer holds."""
        p, n, N = self.p, self.n, self.stream_interval
        sampled = out.sampled
        if sampled is None:
            sampled = [r for r, _, _ in out.scheduled if r.last_token_time == now]
        counts = getattr(out, "sampled_tokens", None)  # tokens per row (speculative decoding)
        chunks = [0] * n
        senders = []  # (request, its engine gap or None for a first token)
        gaps = []  # the rows with an engine gap, in order (None: an aborted one's)
        dropped = 0  # tokens of aborted requests: vLLM's output processor drops them
        for j, req in enumerate(sampled):
            fe = req.fe
            got = counts[j] if counts is not None else 1
            aborted = req.status == RequestStatus.FINISHED_ABORTED
            if fe[FE_ENGINE_FIRST] != fe[FE_ENGINE_FIRST]:  # NaN: its first token
                if aborted:
                    dropped += got
                    continue
                fe[FE_ENGINE_FIRST] = now
                del fe[FE_TOKENS:]
                fe += (got, got, _NAN)
                senders.append((req, None))
                chunks[fe[FE_SERVER] if n > 1 else 0] += 1
                continue
            if aborted:  # (the client gave up: its request state is gone, no chunk)
                dropped += got
                gaps.append(None)
                continue
            tokens = fe[FE_TOKENS] + got
            fe[FE_TOKENS] = tokens
            gaps.append(req)
            if tokens - fe[FE_SENT] >= N or req.status > RequestStatus.PREEMPTED:
                fe[FE_SENT] = tokens
                senders.append((req, req))
                chunks[fe[FE_SERVER] if n > 1 else 0] += 1
        # output work per API server: its share of the tokens, its own requests' chunks
        chunk_s = min(p.stream_chunk_s, p.detokenize_per_token_s)
        tok_s = p.detokenize_per_token_s - chunk_s
        arrive = now + p.ipc_s
        base, extra = divmod(out.num_new_tokens - dropped, n)
        for i, s in enumerate(self.servers):
            start = s.busy if s.busy > arrive else arrive
            work = tok_s * (base + (1 if i < extra else 0)) + chunk_s * chunks[i]
            s.busy = start + work
            self.busy_seconds[i] += work
            s.last_start, s.last_done = start, s.busy
        out.num_chunks = len(senders)
        k = len(itl_explicit) - len(gaps)
        for req, v in zip(gaps, itl_explicit[k:]):
            if req is not None:
                engine_itl.append((v, 1))  # vLLM's engine-side gaps: every token
        del itl_explicit[k:]
        for req, sent in senders:
            fe = req.fe
            srv = self.servers[fe[FE_SERVER]] if n > 1 else self.servers[0]
            if sent is None:
                fe[FE_FIRST_ITER] = srv.last_start
                req.first_token_time = srv.last_done
            else:
                itl_explicit.append(srv.last_done - fe[FE_LAST_CHUNK])
                if self.itl_hook is not None:
                    self.itl_hook(req, itl_explicit[-1])
            fe[FE_LAST_CHUNK] = srv.last_done

    @staticmethod
    def _delay_at(ring: deque, t: float, default):
        """The client delay of this replica's step that ended at ``t`` (recent steps only;
        else the previous step's)."""
        tol = 1e-9 * (1.0 + abs(t))
        for te, d in reversed(ring):
            if abs(te - t) <= tol:
                return d
            if te < t - tol:
                break
        return default

    def on_engine_finish(self, req) -> None:
        """``req`` finished in the engine step just recorded: the client sees it when that
        step's output work is done; the client's bookkeeping (concurrency slot, session
        follow-ups, the request's row) happens then."""
        fe = req.fe
        s = self.servers[fe[0]] if self.n > 1 else self.servers[0]
        fe[5] = req.finish_time
        fe[6] = s.last_start
        t = s.last_done
        req.finish_time = t
        if not self.defer_finish:  # nothing waits for the client's slot: record it now
            self.client_finish(req)  # (its times are the client's already)
            return
        if self._pending is not None and t == self._pending_t:
            self._pending.append(req)
            return
        batch = [req]
        self._pending, self._pending_t = batch, t
        ev = self.env.timeout(t - self.env.now)
        ev.callbacks.append(lambda _ev, b=batch: self._finish(b))

    def _finish(self, batch: list) -> None:
        if self._pending is batch:
            self._pending = None
        cf = self.client_finish
        for r in batch:
            cf(r)

    def drain(self):
        """(spec, send time) of the requests still waiting for a tokenizer (the run ended)."""
        for s in self.servers:
            while len(s.ingress):
                spec, send, _ = s.ingress.pop()
                yield spec, send


__all__ = ["FIT_PARAMS", "Frontend", "FrontendParams", "Held", "resolve_frontend"]
