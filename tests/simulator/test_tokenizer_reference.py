"""The API server's tokenizer (``Frontend``'s window events) against a plain reference: vLLM's
``AsyncMicrobatchTokenizer._batch_encode_loop`` written as the loop it is (a SimPy process that
sleeps until the window opens, looks at the queue, sleeps until the deadline unless 32 prompts
are in, takes the batch), sharing no code with ``simulator/frontend.py``. At an instant where
a send and a window's opening or deadline coincide, the send counts first (the loop wakes
after the instant's other events). Hypothesis drives both with the same sends (bursts, ties on
a coarse grid, closed windows, full batches): every request reaches the engine core at the
same time with the same tokenized time, and the batch counts agree, whether or not the
frontend knows the client's next send (with it, a prompt no other can join is tokenized
alone without a close event)."""

from __future__ import annotations

import os
from collections import deque

import simpy
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from servesim.simulator.frontend import Frontend, FrontendParams
from servesim.workloads.schema import RequestSpec

SCALE = {"long": 20, "quick": 0.2}.get(os.environ.get("SERVESIM_FUZZ", ""), 1)
U = 2.0 ** -10  # every time a multiple of U / 64: exact sums, ties where the grid makes them


def late(env: simpy.Environment, delay: float) -> simpy.Event:
    """An event ``delay`` from now, after the other events of that instant."""
    ev = simpy.Event(env)
    ev._ok, ev._value = True, None
    env.schedule(ev, 2, delay)
    return ev


class RefTokenizers:
    """``n`` API servers: a FIFO asyncio thread (request work) and a micro-batching tokenizer
    loop each, requests dealt round-robin."""

    def __init__(self, env: simpy.Environment, p: FrontendParams, n: int, admit):
        self.env, self.p, self.n, self.admit = env, p, n, admit
        self.rr = 0
        self.busy = [0.0] * n
        self.free = [0.0] * n  # when each tokenizer takes its next batch
        self.queues = [deque() for _ in range(n)]  # (spec, send, arrival_time)
        self.wakes: list = [None] * n
        self.batches = 0
        for i in range(n):
            env.process(self.loop(i))

    def submit(self, spec, send: float) -> None:
        i = self.rr
        self.rr = (i + 1) % self.n
        self.busy[i] = max(self.busy[i], send) + self.p.request_s
        self.queues[i].append((spec, send, self.busy[i]))
        w = self.wakes[i]
        if w is not None and not w.triggered:
            w.succeed()

    def loop(self, i: int):
        env, p, q = self.env, self.p, self.queues[i]
        while True:
            if not q:
                self.wakes[i] = env.event()
                yield self.wakes[i]
                self.wakes[i] = None
                continue
            opened = max(q[0][2], self.free[i])
            yield late(env, max(0.0, opened - env.now))
            deadline = opened + p.tokenizer_batch_wait_s
            cap = p.tokenizer_max_batch
            if len(q) >= cap and q[cap - 1][2] <= deadline:
                close = max(opened, q[cap - 1][2])
            else:
                yield late(env, max(0.0, deadline - env.now))
                close = deadline
            batch = []
            while q and len(batch) < cap and q[0][2] <= close:
                batch.append(q.popleft())
            done = max(close, env.now) + p.tokenize_per_token_s * sum(
                s.prompt_len for s, _, _ in batch)
            self.free[i] = done
            self.batches += 1
            ev = env.timeout(done + p.ipc_s - env.now)
            ev.callbacks.append(lambda _e, b=batch, i=i, d=done: [
                self.admit(s.extra["_index"], i, d, self.env.now) for s, _, _ in b])


def _run(kind: str, sends: list[float], lens: list[int], p: FrontendParams, n: int,
         ahead: bool = False):
    """``ahead``: the frontend knows the client's next send time (a prompt no other
    can join skips the window's events), as ``Client`` tells it for an open-loop workload."""
    env = simpy.Environment()
    got: dict[int, tuple] = {}

    def record(index, server, tokenized, queued):
        got[index] = (server, tokenized, queued)

    if kind == "ref":
        fe = RefTokenizers(env, p, n, record)
    else:
        fe = Frontend(env, p, n, lambda spec, send, t, server, tok, queued: record(
            spec.extra["_index"], server, tok, queued), lambda r: None)

    nxt = [float("-inf")]
    if ahead:
        fe.next_send = lambda: nxt[0]

    def client():
        for i, (t, m) in enumerate(zip(sends, lens)):
            if t > env.now:
                yield env.timeout(t - env.now)
            nxt[0] = sends[i + 1] if i + 1 < len(sends) else float("inf")
            fe.submit(RequestSpec(t, m, 1, extra={"_index": i}), env.now)

    env.process(client())
    env.run()
    batches = fe.batches if kind == "ref" else fe.num_batches
    return got, batches


@settings(max_examples=int(300 * SCALE), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(gaps=st.lists(st.one_of(st.sampled_from([0, 0, 16, 32, 64, 128]), st.integers(0, 400)),
                     min_size=1, max_size=60),
       lens=st.lists(st.integers(1, 64), min_size=60, max_size=60),
       request_s=st.sampled_from([0, 16, 64]), per_tok=st.sampled_from([0, 1, 4]),
       ipc=st.sampled_from([0, 32]), wait=st.sampled_from([0, 64, 128, 192]),
       cap=st.integers(1, 5), n=st.integers(1, 2))
# a prompt queued exactly when the window opens, the 2nd of a 2-prompt batch: it counts;
# likewise when a prompt for the other API server was sent in between
@example(gaps=[0, 16, 184], lens=[8] * 60, request_s=16, per_tok=0, ipc=0, wait=64, cap=2, n=1)
@example(gaps=[0, 32, 32], lens=[1] * 60, request_s=64, per_tok=0, ipc=0, wait=128, cap=2, n=2)
# a window that opens while the tokenizer is busy (at 80, deadline 144) and a prompt sent at
# its very deadline: it counts, so the window cannot close early
@example(gaps=[0, 70, 74], lens=[64] * 60, request_s=0, per_tok=4, ipc=0, wait=64, cap=5, n=1)
def test_window_events_match_the_reference_loop(gaps, lens, request_s, per_tok, ipc, wait,
                                                cap, n):
    unit = U / 64
    sends, t = [], 0.0
    for g in gaps:
        t += g * unit
        sends.append(t)
    p = FrontendParams(request_s=request_s * unit, tokenize_per_token_s=per_tok * unit / 16,
                       ipc_s=ipc * unit, detokenize_per_token_s=0.0,
                       tokenizer_batch_wait_s=wait * unit, tokenizer_max_batch=cap)
    ref, ref_batches = _run("ref", sends, lens, p, n)
    assert len(ref) == len(sends)
    for ahead in (False, True):
        new, new_batches = _run("new", sends, lens, p, n, ahead)
        assert new == ref
        assert new_batches == ref_batches
