"""Metric oracles: every per-request column of ``requests.csv`` and every statistic of
``result.json`` of real simulated runs, recomputed from raw event timestamps by the
definitions of ``vllm bench serve`` (``vllm/benchmarks/serve.py``: ``calculate_metrics``) and
of vLLM's Prometheus metrics, plus the agreement of ``requests.csv``, ``result.json``,
``timeseries.csv`` and the planner.

This module is the oracle itself (the tap, the runs, the recomputation); the tests are in
``test_metric_oracles.py`` and ``test_metric_oracles_engine.py``, the ``run`` fixture in
``conftest.py``.

The oracle shares no code with ``simulator/metrics.py``, ``simulator/frontend.py`` or
``reports/bench_result.py``. Its raw events come from a *tap* on the scheduler's
``update_from_output`` (called once per batch with the batch's end time ``now``: right after
``schedule()`` under async scheduling, vLLM's default, when the batch returns otherwise):
which requests a batch scheduled (and with how many tokens, from which computed offset),
when it was scheduled (``SchedulerOutput.scheduled_at``, vLLM's SCHEDULED event) and which
rows produced tokens; and from a tap on the engine's per-batch recorder, which gives the
order of schedules and returns (the gauges of ``timeseries.csv`` are read at returns).
From those events alone:

- engine: a token's time is its batch's end; a batch runs from max(scheduled, previous
  batch's end); first scheduled = the ``schedule()`` call that first scheduled the request;
  num_cached_tokens = computed offset then (prefix hits); preemptions = times a request is
  scheduled again from a smaller computed offset (recompute);
- the API-server frontend (default; ``frontend.enable=false`` runs the engine alone, where
  every client time is the engine's): one asyncio thread, FIFO by the time the work becomes
  known — a request's work (``request_s``) at its send time, a batch's output work
  (``detokenize_per_token_s`` per generated token) when the batch returns, starting no
  earlier than ``ipc_s`` later; vLLM's ``arrival_time`` = end of the request work; the
  tokenizer: micro-batches opened by the first queued request (or when the previous batch
  is done), closed ``tokenizer_batch_wait_s`` later, tokenized = close + per-token cost of
  the batch, in the engine core ``ipc_s`` later, queued (taken in by the engine loop) then
  if no batch is in flight, else when the next batch returns; the client sees a batch's
  tokens when its output work ends;
- the client: open loop = send at arrival; with ``max_concurrency`` C, request i goes out at
  max(arrival_i, the earliest client-side finish of the C requests in flight) (vLLM's
  ``asyncio.Semaphore`` around ``request_func``);
- TTFT = first token − send, E2EL = last token − send, TPOT = (E2EL − TTFT)/(out − 1) for
  out > 1, ITL = gaps between a request's consecutive tokens (a preemption's recompute gap
  included), all with client-side token times; queue (vLLM ``request_queue_time``) = first
  scheduled − queued in the engine core; engine TTFT / E2EL = output work start of the
  first / last token's batch − ``arrival_time``; prefill = engine first token − first
  scheduled; decode = engine last − first token; engine TPOT = decode / (out − 1);
- result.json: vLLM's statistics (np.mean/median/std/percentile ·1000) over completed
  requests, goodput by ``all(slo >= metric)`` with TPOT 0 for 1-token outputs, throughputs over
  the duration (t = 0 to the last completion), peak tokens per 1-s bucket since the first send,
  the engine-side statistics and the TTFT breakdown (means of its six terms).

They hold whatever the scheduler decides (nothing here assumes a batch composition), so they
survive scheduler rewrites; a rewrite that renames ``update_from_output`` or its ``now``
argument, ``SchedulerOutput.scheduled`` / ``scheduled_at`` or ``Replica._recorder`` must
update :class:`Tap` only.
"""

from __future__ import annotations

import csv
import dataclasses
import heapq
import inspect
import itertools
import json
import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from servesim.reports import write_run
from servesim.simulator import runner
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.engine import Replica
from servesim.simulator.metrics import derive_request_columns
from servesim.simulator.runner import run_experiment
from servesim.simulator.scheduler import Scheduler
from servesim.workloads import build_workload

BASE = [
    "model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb", "hardware.calibration=none",
    "model.max_model_len=4096", "workload.kind=random", "workload.seed=3",
]
ENGINE_ONLY = "frontend.enable=false"

# name → overrides. Small runs (a second or less each), each exercising one mechanism. Async
# scheduling is vLLM's default (on unless a scenario turns it off); the API-server frontend
# too (the fe_* scenarios; the others run the engine alone).
SCENARIOS = {
    # open loop, Poisson, chunked prefill (a 256-token budget splits prompts)
    "open_loop": [ENGINE_ONLY, "workload.num_prompts=60", "workload.request_rate=40",
                  "workload.input_len=300", "workload.output_len=24",
                  "workload.range_ratio=0.8", "scheduler.max_num_batched_tokens=256",
                  "scheduler.max_num_seqs=16", "cache.enable_prefix_caching=false"],
    # closed loop: 4 in flight, all offered at t = 0, so the client queues
    "closed_loop": [ENGINE_ONLY, "workload.num_prompts=40", "workload.max_concurrency=4",
                    "workload.input_len=200", "workload.output_len=16",
                    "workload.range_ratio=0.9"],
    # a KV cache of 48 blocks × 16 tokens for 12 requests of ≤ 200 tokens: recompute
    # preemptions
    "preemption": [ENGINE_ONLY, "workload.num_prompts=12", "workload.input_len=96",
                   "workload.output_len=60", "workload.range_ratio=0.5",
                   "cache.num_gpu_blocks_override=48", "model.max_model_len=768"],
    # synchronous scheduling, no chunked prefill, vLLM's priority policy: other modes
    "sync_unchunked": [ENGINE_ONLY, "workload.num_prompts=30", "workload.request_rate=25",
                       "workload.input_len=150", "workload.output_len=10",
                       "workload.range_ratio=0.9", "scheduler.async_scheduling=false",
                       "scheduler.enable_chunked_prefill=false", "scheduler.policy=priority",
                       "scheduler.max_num_seqs=8"],
    # 64 shared prefix tokens (4 full blocks) in front of every prompt: prefix-cache hits
    "prefix": [ENGINE_ONLY, "workload.num_prompts=30", "workload.request_rate=20",
               "workload.prefix_len=64", "workload.input_len=40", "workload.output_len=12",
               "workload.range_ratio=0.5", "output.save_detailed=true"],
    # the default frontend, open loop with chunked prefill (mid-prefill rows generate nothing)
    "fe_open_loop": ["workload.num_prompts=60", "workload.request_rate=40",
                     "workload.input_len=300", "workload.output_len=24",
                     "workload.range_ratio=0.8", "scheduler.max_num_batched_tokens=256",
                     "scheduler.max_num_seqs=16", "output.save_detailed=true"],
    # the frontend under max_concurrency: the client acts on what it sees (slot freed after
    # the output work of the last token)
    "fe_closed_loop": ["workload.num_prompts=40", "workload.max_concurrency=4",
                       "workload.input_len=200", "workload.output_len=16",
                       "workload.range_ratio=0.9"],
    # pipeline parallelism (2 stages): batches overlap, advanced at schedule time with
    # literal placeholders, updated when they return
    "pipeline": [ENGINE_ONLY, "parallel.pipeline_parallel_size=2", "workload.num_prompts=30",
                 "workload.request_rate=30", "workload.input_len=200",
                 "workload.output_len=20", "workload.range_ratio=0.8",
                 "scheduler.max_num_batched_tokens=512"],
    # the frontend with recompute preemptions and synchronous scheduling
    "fe_preemption": ["workload.num_prompts=12", "workload.input_len=96",
                      "workload.output_len=60", "workload.range_ratio=0.5",
                      "cache.num_gpu_blocks_override=48", "model.max_model_len=768",
                      "scheduler.async_scheduling=false"],
}
# vLLM 0.22 / benchmarks/frontend_costs.py priors (simulator/frontend.py's table)
FRONTEND_PRIORS = {"request_s": 125e-6, "tokenize_per_token_s": 1.0e-6, "ipc_s": 105e-6,
                   "detokenize_per_token_s": 4.3e-6, "stream_chunk_s": 3.8e-6,
                   "tokenizer_batch_wait_s": 0.002,
                   "tokenizer_max_batch": 32}


# ---------------------------------------------------------------------------------------------
# raw events


@dataclasses.dataclass
class Batch:
    scheduled_at: float  # the schedule() call
    end: float  # when it returns (its tokens' engine time)
    num_tokens: int  # scheduled tokens
    after: dict[str, int]  # request id → computed tokens after it
    tokens: dict[str, int]  # request id → tokens it generated
    returned_before: int = 0  # batches returned (recorded) before this one was scheduled


class Tap:
    """Per-batch raw events, recorded around the scheduler's ``update_from_output`` and the
    engine's per-batch recorder."""

    def __init__(self):
        self.tokens: dict[str, list[float]] = defaultdict(list)  # engine token times
        self.token_batches: dict[str, list[int]] = defaultdict(list)  # batch of each token
        self.first_sched: dict[str, float] = {}
        self.first_batch: dict[str, int] = {}
        self.cached: dict[str, int] = {}
        self.preemptions: dict[str, int] = defaultdict(int)
        self.next_offset: dict[str, int] = {}
        self.batches: list[Batch] = []
        self.chunks: dict[str, int] = defaultdict(int)  # batches scheduling > 1 token
        self.index: dict[int, int] = {}  # id(SchedulerOutput) → batch number
        self.keep: list = []  # the outputs, alive (their ids stay unique)
        self.returns: list[int] = []  # batch numbers in the order they were recorded

    def install(self, monkeypatch, cls) -> None:
        orig = cls.update_from_output
        sig = inspect.signature(orig)
        tap = self

        def update_from_output(sched, out, *args, **kwargs):
            now = float(sig.bind(sched, out, *args, **kwargs).arguments["now"])
            rows = [(r, int(n), int(c)) for r, n, c in out.scheduled]
            before = [r.num_output_tokens for r, _, _ in rows]
            result = orig(sched, out, *args, **kwargs)
            k = len(tap.batches)
            b = Batch(float(out.scheduled_at), now, sum(n for _, n, _ in rows), {}, {},
                      len(tap.returns))
            for (r, n, c), k0 in zip(rows, before):
                rid = r.request_id
                if rid not in tap.first_sched:
                    tap.first_sched[rid] = b.scheduled_at
                    tap.first_batch[rid] = k
                    tap.cached[rid] = c
                elif c < tap.next_offset[rid]:
                    tap.preemptions[rid] += 1  # scheduled again from scratch (or its hits)
                tap.next_offset[rid] = b.after[rid] = c + n
                tap.chunks[rid] += n > 1
                m = r.num_output_tokens - k0
                if m:
                    b.tokens[rid] = m
                    tap.tokens[rid] += [now] * m
                    tap.token_batches[rid] += [k] * m
            tap.index[id(out)] = k
            tap.keep.append(out)
            tap.batches.append(b)
            return result

        orig_recorder = Replica._recorder

        def _recorder(replica):
            record = orig_recorder(replica)

            def wrapped(out, now, dt):
                tap.returns.append(tap.index[id(out)])
                return record(out, now, dt)

            return wrapped

        monkeypatch.setattr(cls, "update_from_output", update_from_output)
        monkeypatch.setattr(Replica, "_recorder", _recorder)


def read_csv(path: Path) -> dict[str, list[str]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: [r[k] for r in rows] for k in rows[0]}


def floats(cells: list[str]) -> np.ndarray:
    return np.array([float(c) if c != "" else np.nan for c in cells])


_SIMULATIONS: dict[tuple[str, str], tuple] = {}


def simulate(name: str, cfg) -> tuple:
    """(tap, RunResult, raw per-request rows, client_columns) of a scenario. Simulated once
    per process and scenario; the per-request derivation and every report are recomputed by
    each test (see :class:`Run`). Under mutation testing (mutmut sets ``MUTANT_UNDER_TEST``)
    the cache is per mutant, except for mutants of ``reports/`` (which the simulation never
    runs); while mutmut records which tests run which functions (``stats``) every test
    simulates."""
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if mutant in ("stats", "") or mutant.startswith("servesim.reports."):
        mutant = ""
    key = (name, mutant)
    if key in _SIMULATIONS and os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return _SIMULATIONS[key]
    tap, raw, flags = Tap(), {}, []

    def derive(rows, client_columns=False):
        raw.update(rows)
        flags.append(client_columns)
        return derive_request_columns(rows, client_columns)

    with pytest.MonkeyPatch.context() as mp:
        tap.install(mp, Scheduler)  # fcfs; the other policies subclass it
        mp.setattr(runner, "derive_request_columns", derive)
        result = run_experiment(cfg, fast_path=False)
    for k in [k for k in _SIMULATIONS if k[1] != mutant]:
        del _SIMULATIONS[k]  # only the current mutant's runs are kept
    _SIMULATIONS[key] = (tap, result, raw, flags[-1])
    return _SIMULATIONS[key]


class Run:
    def __init__(self, name: str, overrides: list[str], tmp: Path):
        self.name = name
        self.cfg = resolve_config(load_config(None, BASE + overrides))
        self.frontend = self.cfg.frontend.enable
        self.tap, result, raw, client_cols = simulate(name, self.cfg)
        # this test's own copy, its per-request columns derived again from the raw rows
        self.result = dataclasses.replace(
            result, requests=derive_request_columns(raw, client_cols))
        self.dir = tmp / name
        write_run(self.result, self.dir, date="20250101-000000")
        self.csv = read_csv(self.dir / "requests.csv")
        self.ts = read_csv(self.dir / "timeseries.csv")
        self.json = json.loads((self.dir / "result.json").read_text())
        self.specs = list(build_workload(self.cfg.workload, block_size=self.cfg.cache.block_size,
                                         max_model_len=self.cfg.model.max_model_len))
        self.oracle = Oracle(self)


class Oracle:
    """Everything a run should report, from the workload, the tap and the definitions."""

    def __init__(self, run: Run):
        tap, specs = run.tap, run.specs
        self.ids = ids = [s.request_id for s in specs]
        self.arrival = np.array([s.arrival_s for s in specs])
        self.prompt = np.array([s.prompt_len for s in specs])
        self.out = np.array([len(tap.tokens[i]) for i in ids])
        self.engine_first = np.array([tap.tokens[i][0] if tap.tokens[i] else np.nan
                                      for i in ids])
        self.engine_finish = np.array([tap.tokens[i][-1] if tap.tokens[i] else np.nan
                                       for i in ids])
        self.first_sched = np.array([tap.first_sched.get(i, np.nan) for i in ids])
        self.cached = np.array([tap.cached.get(i, 0) for i in ids])
        self.preemptions = np.array([tap.preemptions[i] for i in ids])
        # every request of these runs is sent and finishes after exactly output_len tokens
        self.done = self.out == np.array([s.output_len for s in specs])
        # a batch starts at its schedule() call or when the first pipeline stage is free,
        # whichever is later; it holds each of the pp stages for 1/pp of its latency (pp = 1:
        # the previous batch's end)
        pp = run.cfg.parallel.pipeline_parallel_size
        self.batch_start = []
        free = 0.0
        for b in tap.batches:
            start = max(b.scheduled_at, free)
            self.batch_start.append(start)
            free = start + (b.end - start) / pp
        fe = run.result.frontend.get("params") if run.frontend else None
        self.fe = fe
        self._client_side(run, fe)
        if fe is not None:
            self._tokenizer(fe)
        else:  # the engine alone: vLLM's arrival_time and the arrival at the core are the send
            self.fe_arrival = self.tokenized = self.queued = self.send.copy()
        # vLLM's engine loop takes a request in (QUEUED) between steps: at once when no batch
        # is in flight when it reaches the engine core, else when the next batch returns
        starts = np.array([b.scheduled_at for b in tap.batches])
        ends = np.array([b.end for b in tap.batches])
        self.queued = self.queued.copy()  # (not the arrival's array)
        for i, a in enumerate(self.queued):
            if ((starts < a) & (a < ends)).any():
                self.queued[i] = ends[ends >= a].min()
        self.ttft = self.first_token - self.send
        self.e2el = self.finish - self.send
        with np.errstate(invalid="ignore", divide="ignore"):
            self.tpot = np.where(self.out > 1, (self.e2el - self.ttft) / (self.out - 1), np.nan)
        self.queue = self.first_sched - self.queued
        self.itls = [np.diff(self.client_tokens[i]) for i in ids]
        self.engine_itls = [np.diff(tap.tokens[i]) for i in ids]
        self.duration = float(np.max(self.finish[self.done]))
        # engine side (vLLM's Prometheus histograms)
        self.engine_ttft = self.first_iter - self.fe_arrival
        self.engine_e2el = self.finish_iter - self.fe_arrival
        self.prefill = self.engine_first - self.first_sched
        self.decode = self.engine_finish - self.engine_first
        with np.errstate(invalid="ignore", divide="ignore"):
            # (vLLM FinishedRequestStats: 0 for a one-token request)
            self.engine_tpot = np.where(self.out > 1, self.decode / (self.out - 1), 0.0)

    def _client_side(self, run: Run, fe: dict | None) -> None:
        """Sends, the API server's asyncio thread (request work, output work per batch) and
        the client-side token times, in time order: the client's sends under
        ``max_concurrency`` depend on when it sees finishes."""
        tap, ids = run.tap, self.ids
        n = len(ids)
        pos = {rid: i for i, rid in enumerate(ids)}
        last = {rid: ks[-1] for rid, ks in tap.token_batches.items()}
        finishing = defaultdict(list)  # batch → requests whose last token it produced
        for rid, k in last.items():
            if self.done[pos[rid]]:
                finishing[k].append(rid)
        seq = itertools.count()
        heap = [(b.end, 1, next(seq), "batch", k) for k, b in enumerate(tap.batches)]
        c = run.cfg.workload.max_concurrency
        first = n if c is None else min(c, n)
        heap += [(self.arrival[i], 0, next(seq), "send", i) for i in range(first)]
        heapq.heapify(heap)
        nxt = first
        busy = 0.0
        self.send = np.full(n, np.nan)
        fe_arrival = np.full(n, np.nan)
        self.work = {}  # batch → (output work start, end)
        client_tokens = defaultdict(list)
        while heap:
            t, _, _, kind, x = heapq.heappop(heap)
            if kind == "send":
                self.send[x] = t
                if fe is not None:
                    busy = max(busy, t) + fe["request_s"]
                    fe_arrival[x] = busy
                continue
            b = tap.batches[x]
            ntok = sum(b.tokens.values())
            if not ntok:
                continue
            if fe is not None:
                start = max(busy, t + fe["ipc_s"])
                busy = done = start + fe["detokenize_per_token_s"] * ntok
            else:
                start = done = t
            self.work[x] = (start, done)
            for rid, m in b.tokens.items():
                client_tokens[rid] += [done] * m
            for _ in finishing[x]:  # each frees a client slot
                if c is not None and nxt < n:
                    heapq.heappush(heap, (max(self.arrival[nxt], done), 0, next(seq), "send",
                                          nxt))
                    nxt += 1
        self.fe_arrival = fe_arrival
        self.client_tokens = {rid: np.array(client_tokens[rid]) for rid in ids}
        self.first_token = np.array([v[0] if len(v) else np.nan
                                     for v in self.client_tokens.values()])
        self.finish = np.array([v[-1] if len(v) else np.nan for v in self.client_tokens.values()])
        fb = [tap.token_batches[rid] for rid in ids]
        self.first_iter = np.array([self.work[k[0]][0] if k else np.nan for k in fb])
        self.finish_iter = np.array([self.work[k[-1]][0] if k else np.nan for k in fb])

    def _tokenizer(self, fe: dict) -> None:
        """vLLM's ``AsyncMicrobatchTokenizer`` on one API server: requests in the order their
        request work ends; a batch opens at its first request's arrival_time (or when the
        previous batch is tokenized), closes ``tokenizer_batch_wait_s`` later with every
        request arrived by then; tokenized = close + per-token cost of the batch."""
        n = len(self.ids)
        order = sorted(range(n), key=lambda i: (self.fe_arrival[i], i))
        self.tokenized = np.full(n, np.nan)
        self.batch_sizes = []
        free = 0.0
        i = 0
        while i < n:
            close = max(self.fe_arrival[order[i]], free) + fe["tokenizer_batch_wait_s"]
            j = i
            while j < n and self.fe_arrival[order[j]] <= close:
                j += 1
            batch = order[i:j]
            # (a full batch closes early: not exercised here, see the precondition)
            self.batch_sizes.append(len(batch))
            free = close + fe["tokenize_per_token_s"] * int(self.prompt[batch].sum())
            self.tokenized[batch] = free
            i = j
        self.queued = self.tokenized + fe["ipc_s"]


def close(got, want, what: str) -> None:
    got, want = np.asarray(got, dtype=float), np.asarray(want, dtype=float)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=what)


def ms(x) -> float:
    return float(x) * 1000.0


def vllm_stats(x: np.ndarray) -> dict[str, float]:
    """vLLM: np.mean/median/std/percentile(x or 0) · 1000."""
    x = list(x) or 0
    return {"mean": ms(np.mean(x)), "median": ms(np.median(x)), "std": ms(np.std(x)),
            "p99": ms(np.percentile(x, 99))}
