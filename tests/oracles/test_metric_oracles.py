"""Metric oracles: every per-request column of ``requests.csv`` and every statistic of
``result.json`` of real simulated runs, recomputed from raw event timestamps by the
definitions of ``vllm bench serve`` (``vllm/benchmarks/serve.py``: ``calculate_metrics``) and
of vLLM's Prometheus metrics, plus the agreement of ``requests.csv``, ``result.json``,
``timeseries.csv`` and the planner.

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
  the batch, queued in the engine core ``ipc_s`` later; the client sees a batch's tokens
  when its output work ends;
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
import math
import os
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from servesim.reports import write_run
from servesim.reports.bench_result import compute_bench_result
from servesim.simulator import runner
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.engine import Replica
from servesim.simulator.metrics import derive_request_columns
from servesim.simulator.plan.slo import point_metrics
from servesim.simulator.plan.spec import PlanSLO
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
                   "cache.num_gpu_blocks_override=48"],
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
                      "cache.num_gpu_blocks_override=48", "scheduler.async_scheduling=false"],
}
# vLLM 0.22 / benchmarks/frontend_costs.py priors (simulator/frontend.py's table)
FRONTEND_PRIORS = {"request_s": 125e-6, "tokenize_per_token_s": 1.0e-6, "ipc_s": 105e-6,
                   "detokenize_per_token_s": 4.3e-6, "tokenizer_batch_wait_s": 0.002,
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
        else:  # the engine alone: vLLM's arrival_time and the queueing are the send's
            self.fe_arrival = self.tokenized = self.queued = self.send.copy()
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
            self.engine_tpot = np.where(self.out > 1, self.decode / (self.out - 1), np.nan)

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


# Function-scoped on purpose: every test derives and writes its run's reports itself, so
# mutation testing (which runs, per mutant, only the tests that executed the mutated function)
# sees each check; the simulation behind it is cached (see simulate).
@pytest.fixture(params=list(SCENARIOS))
def run(request, tmp_path) -> Run:
    return Run(request.param, SCENARIOS[request.param], tmp_path)


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


# ---------------------------------------------------------------------------------------------
# preconditions: each scenario exercises what it is named after


def test_scenario_exercises_its_mechanism(run):
    o = run.oracle
    assert o.done.all() and len(o.ids) == run.cfg.workload.num_prompts
    if run.name == "open_loop":
        assert max(run.tap.chunks.values()) >= 2  # some prompt took several chunks
    if run.name == "closed_loop":
        assert (o.send > o.arrival).sum() >= 30
    if run.name == "preemption":
        hit = [i for i, k in enumerate(o.preemptions) if k]
        assert len(hit) >= 2
        # a preempted request produced tokens both before and after its recompute
        assert max(o.itls[i].max() for i in hit) > 3 * np.median(np.concatenate(o.itls))
    if run.name == "prefix":
        assert (o.cached >= 48).sum() >= 20  # ≥ 3 of the 4 shared blocks hit


# ---------------------------------------------------------------------------------------------
# requests.csv


def test_requests_csv_columns_by_definition(run):
    o, c = run.oracle, run.csv
    assert c["request_id"] == o.ids
    close(floats(c["arrival_s"]), o.arrival, "arrival_s")
    assert [int(x) for x in c["prompt_len"]] == o.prompt.tolist()
    assert [int(x) for x in c["output_len"]] == o.out.tolist()
    assert [int(x) for x in c["num_cached_tokens"]] == o.cached.tolist()
    close(floats(c["first_scheduled_s"]), o.first_sched, "first_scheduled_s")
    close(floats(c["first_token_s"]), o.first_token, "first_token_s")
    close(floats(c["finish_s"]), o.finish, "finish_s")
    close(floats(c["ttft_s"]), o.ttft, "ttft_s")
    close(floats(c["tpot_s"]), o.tpot, "tpot_s")
    close(floats(c["e2el_s"]), o.e2el, "e2el_s")
    close(floats(c["queue_s"]), o.queue, "queue_s")
    assert [int(x) for x in c["num_preemptions"]] == o.preemptions.tolist()
    assert set(c["finished_reason"]) == {"length"}  # random dataset: ignore_eos
    if "send_s" in c:
        close(floats(c["send_s"]), o.send, "send_s")


def test_latency_identities(run):
    """TTFT + (out − 1)·TPOT = E2EL; ITLs of a request sum to E2EL − TTFT; queue ≤ TTFT."""
    o = run.oracle
    multi = o.out > 1
    close(o.ttft[multi] + (o.out[multi] - 1) * o.tpot[multi], o.e2el[multi], "tpot identity")
    close([s.sum() for s in o.itls], o.e2el - o.ttft, "itl sum")
    # (≥ −1e-15: the engine stores the first step's start as now − dt, which can round a
    # hair below the send time of a request that woke an idle engine)
    assert (o.queue >= -1e-15).all() and (o.queue < o.ttft).all()


# ---------------------------------------------------------------------------------------------
# result.json


def test_result_json_counts_and_throughputs(run):
    o, j = run.oracle, run.json
    done = o.done
    assert j["num_prompts"] == len(o.ids)
    assert j["completed"] == int(done.sum()) and j["failed"] == int((~done).sum())
    assert j["duration"] == pytest.approx(o.duration, rel=1e-12)
    assert j["total_input_tokens"] == int(o.prompt[done].sum())
    assert j["total_output_tokens"] == int(o.out[done].sum())
    assert j["request_throughput"] == pytest.approx(done.sum() / o.duration, rel=1e-12)
    assert j["output_throughput"] == pytest.approx(o.out[done].sum() / o.duration, rel=1e-12)
    assert j["total_token_throughput"] == pytest.approx(
        (o.prompt[done].sum() + o.out[done].sum()) / o.duration, rel=1e-12)
    close(j["latencies"], np.where(done, o.e2el, 0.0), "latencies")
    close(j["queue_times"], o.send - o.arrival, "queue_times (client side)")
    assert j["max_concurrency"] == run.cfg.workload.max_concurrency
    assert j["num_preemptions"] == int(o.preemptions.sum())


def test_result_json_latency_statistics(run):
    o, j = run.oracle, run.json
    d = o.done
    series = {"ttft": o.ttft[d], "tpot": o.tpot[d & (o.out > 1)], "e2el": o.e2el[d],
              "itl": np.concatenate([o.itls[i] for i in np.flatnonzero(d)])}
    if run.cfg.workload.max_concurrency is not None:  # client-side queueing metrics
        cq = (o.send - o.arrival)[d]
        series["client_queue_time"] = cq
        series["e2el_including_client_queue"] = o.e2el[d] + cq
    for metric, x in series.items():
        for stat, v in vllm_stats(x).items():
            assert j[f"{stat}_{metric}_ms"] == pytest.approx(v, rel=1e-9, abs=1e-9), \
                f"{stat}_{metric}_ms"
    # the pooled ITL sample itself (as a multiset) is the run's inter-token gaps
    pooled = np.sort(np.repeat(run.result.itl_values, run.result.itl_counts))
    close(pooled, np.sort(series["itl"]), "pooled ITL sample")


def test_goodput_by_vllm_rule(run):
    """Thresholds set between sample values (no float ties): good = ttft <= T and tpot <= P
    (TPOT 0 when one token) and e2el <= E, over completed requests, per second of duration."""
    o = run.oracle
    d = o.done

    def mid(x, q):
        v = np.unique(np.round(x, 9))
        k = min(len(v) - 2, max(0, int(q * (len(v) - 1))))
        return (v[k] + v[k + 1]) / 2

    tp0 = np.where(o.out > 1, o.tpot, 0.0)
    for slo in ({"ttft_ms": ms(mid(o.ttft[d], 0.6))},
                {"ttft_ms": ms(mid(o.ttft[d], 0.8)), "tpot_ms": ms(mid(tp0[d], 0.5))},
                {"e2el_ms": ms(mid(o.e2el[d], 0.3)), "tpot_ms": ms(mid(tp0[d], 0.9))}):
        cfg = run.cfg.model_copy(update={"slo": run.cfg.slo.model_copy(update=slo)})
        run.result.config = cfg
        try:
            bench = compute_bench_result(run.result)
        finally:
            run.result.config = run.cfg
        good = d.copy()
        for key, x in (("ttft_ms", o.ttft), ("tpot_ms", tp0), ("e2el_ms", o.e2el)):
            if key in slo:
                good &= slo[key] / 1000.0 >= x
        assert 0 < good.sum() < d.sum()
        assert bench["request_goodput"] == pytest.approx(good.sum() / o.duration, rel=1e-12)
        # the planner's goodput and percentiles agree with result.json
        m = point_metrics(run.result.requests, PlanSLO(**slo, max_queue_growth=None),
                          duration_s=run.result.duration_s)
        assert m["request_goodput"] == pytest.approx(bench["request_goodput"], rel=1e-12)
        assert m["goodput_pct"] == pytest.approx(100 * good.sum() / len(d), rel=1e-12)
    assert run.json["request_goodput"] is None  # no SLO configured in the scenarios


def test_max_output_tokens_per_s_by_vllm_buckets(run):
    """vLLM: tokens of successful requests bucketed by int(t − first send), peak bucket (at
    the engine's token times, as documented in bench_result.py; every sampled token once:
    first tokens, a 1-token final chunk's, a recompute's after a preemption)."""
    o = run.oracle
    t0 = o.send[o.done].min()
    times = np.concatenate([run.tap.tokens[i] for i in np.array(o.ids)[o.done]])
    counts = np.bincount((times - t0).astype(np.int64))
    assert run.json["max_output_tokens_per_s"] == float(counts.max())


def test_max_concurrent_requests_by_vllm_buckets(run):
    """vLLM 0.22.1: per 1-s bucket since the first send, every successful request active at
    any time in that second counts; the peak bucket."""
    o = run.oracle
    t0 = o.send[o.done].min()
    per_s = np.zeros(int(np.ceil(o.finish.max() - t0)) + 1)
    for s, e in zip(o.send[o.done], o.finish[o.done]):
        per_s[int(s - t0):int(e - t0) + 1] += 1
    assert run.json["max_concurrent_requests"] == int(per_s.max())
    if run.cfg.workload.max_concurrency is not None:
        assert per_s.max() >= run.cfg.workload.max_concurrency


def test_save_detailed_arrays(run):
    if not run.cfg.output.save_detailed:
        pytest.skip("scenario without output.save_detailed")
    o, j = run.oracle, run.json
    assert j["input_lens"] == o.prompt.tolist()
    assert j["output_lens"] == o.out.tolist()
    close(j["ttfts"], o.ttft, "ttfts")
    close(j["start_times"], o.send, "start_times")
    assert j["errors"] == [""] * len(o.ids)
    assert j["generated_texts"] == [""] * len(o.ids)


# ---------------------------------------------------------------------------------------------
# timeseries.csv and the counters


def test_timeseries_rows_are_the_batches(run):
    """One row per batch, written when it returns (in schedule order: FIFO): time_s = its end,
    step_seconds = end − start with start = max(scheduled, previous batch's end), its scheduled
    and generated tokens; every token at a batch end, every first scheduling at a schedule()."""
    ts, tap, o = run.ts, run.tap, run.oracle
    assert tap.returns == list(range(len(tap.batches)))
    end = floats(ts["time_s"])
    dur = floats(ts["step_seconds"])
    close(end, [b.end for b in tap.batches], "batch end times")
    close(end - dur, o.batch_start, "batch start times")
    if run.cfg.parallel.pipeline_parallel_size == 1:  # one batch on the GPU at a time
        assert (np.diff(end) > 0).all() and (end[1:] - dur[1:] >= end[:-1] - 1e-12).all()
    else:  # pipeline stages: a batch starts before the previous one returns, and returns in
        # order (a short batch behind a long one returns with it)
        assert (np.diff(end) >= 0).all() and (np.diff(end) == 0).any()
        assert (end[1:] - dur[1:] < end[:-1] - 1e-12).sum() >= len(end) // 2
    tok = floats(ts["step_tokens"])
    assert tok.tolist() == [float(b.num_tokens) for b in tap.batches]
    assert floats(ts["num_generated_tokens"]).tolist() == [
        float(sum(b.tokens.values())) for b in tap.batches]
    close(floats(ts["num_prefill_tokens"]) + floats(ts["num_decode_reqs"]), tok,
          "prefill + decode tokens = batch tokens")
    assert run.json["num_steps"] == len(tap.batches)
    ends = set(end.tolist())
    assert all(t in ends for i in o.ids for t in tap.tokens[i])
    assert set(o.first_sched.tolist()) <= {b.scheduled_at for b in tap.batches}
    if run.cfg.parallel.pipeline_parallel_size > 1:
        pass  # scheduled while a stage is free (start checked above)
    elif not run.cfg.scheduler.async_scheduling:  # synchronous: scheduled when the GPU is free
        close([b.scheduled_at for b in tap.batches], o.batch_start, "sync schedule = start")
    else:  # async: batch k+1 is scheduled while batch k runs (two in flight)
        assert sum(b.scheduled_at < s for b, s in zip(tap.batches, o.batch_start)) > \
            len(tap.batches) // 2


def _state_at_returns(run):
    """Per timeseries row (the r-th batch return): the batches scheduled by then (vLLM
    schedules the next batch after recording the returned one) and the requests finished by
    then (stops are applied when the batch with the last token returns, before the record)."""
    tap, o = run.tap, run.oracle
    if run.cfg.parallel.pipeline_parallel_size > 1:
        pytest.skip("pipeline parallelism: the tap sees a batch when it returns, not when it "
                    "is scheduled (the scheduled-by-then sets are not observable here)")
    last = {rid: ks[-1] for rid, ks in tap.token_batches.items()}
    for r, k in enumerate(tap.returns):
        scheduled = [j for j, b in enumerate(tap.batches) if b.returned_before <= r]
        finished = {rid for rid, j in last.items()
                    if j in tap.returns[:r + 1] and o.done[o.ids.index(rid)]}
        yield r, tap.batches[k], scheduled, finished


def test_timeseries_gauges(run):
    """At each batch return: running = admitted by the batches scheduled so far, not finished;
    waiting = in the engine's queue (queued before the return), not admitted; the preemption
    counter ends at the per-request total; vLLM's scheduled-token conservation (prompt − hits
    + out − 1 per request, more after a preemption's recompute)."""
    o, ts, tap = run.oracle, run.ts, run.tap
    running = floats(ts["vllm:num_requests_running"])
    waiting = floats(ts["vllm:num_requests_waiting"])
    pre_total = floats(ts["vllm:num_preemptions_total"])
    assert pre_total[-1] == o.preemptions.sum() and (np.diff(pre_total) >= 0).all()
    need = int((o.prompt - o.cached + o.out - 1).sum())
    total = int(floats(ts["step_tokens"]).sum())
    if o.preemptions.sum():
        assert total > need
        assert (running + waiting <= len(o.ids)).all()
        return
    assert total == need
    first = np.array([tap.first_batch[i] for i in o.ids])
    for r, b, scheduled, finished in _state_at_returns(run):
        admitted = first <= max(scheduled)
        done = np.array([i in finished for i in o.ids])
        assert running[r] == (admitted & ~done).sum(), r
        assert waiting[r] == ((o.queued < b.end) & ~admitted).sum(), r


def test_kv_cache_usage_from_block_counts(run):
    """Without shared prefixes or preemptions: used blocks at a batch return = Σ over the
    admitted, unfinished requests of ceil(computed tokens after the latest batch scheduled
    for them / block_size) (blocks are allocated at schedule time, freed when the stop is
    applied); usage = used / (num_gpu_blocks − 1) (the null block is not counted)."""
    if run.cfg.workload.prefix_len or run.oracle.preemptions.sum():
        pytest.skip("needs unshared blocks and no preemption")
    bs = run.cfg.cache.block_size
    nb = run.json["num_gpu_blocks"]
    usage = floats(run.ts["vllm:kv_cache_usage_perc"])
    tap = run.tap
    for r, _, scheduled, finished in _state_at_returns(run):
        held: dict[str, int] = {}
        for j in scheduled:
            held.update(tap.batches[j].after)
        used = sum(-(-c // bs) for rid, c in held.items() if rid not in finished)
        assert usage[r] == pytest.approx(used / (nb - 1), rel=1e-12, abs=1e-15), r


def test_prefix_cache_counters(run):
    """vLLM PrefixCacheStats without head-of-line retries: queries = Σ prompt tokens at the
    first scheduling, hits = Σ num_cached_tokens; the hit rate is their ratio."""
    o, j = run.oracle, run.json
    q = floats(run.ts["vllm:prefix_cache_queries_total"])
    h = floats(run.ts["vllm:prefix_cache_hits_total"])
    assert (q[-1], h[-1]) == (j["prefix_cache_queries"], j["prefix_cache_hits"])
    if run.name != "prefix":
        return
    assert j["prefix_cache_queries"] == int(o.prompt.sum())
    assert j["prefix_cache_hits"] == int(o.cached.sum())
    assert j["prefix_cache_hit_rate"] == pytest.approx(o.cached.sum() / o.prompt.sum())


# ---------------------------------------------------------------------------------------------
# the planner and the fast path


def test_planner_metrics_agree_with_result_json(run):
    o, j = run.oracle, run.json
    m = point_metrics(run.result.requests, PlanSLO(ttft_ms=1e6), duration_s=run.result.duration_s,
                      num_preemptions=run.result.counters["num_preemptions"])
    for metric in ("ttft", "tpot", "e2el"):
        assert m[f"mean_{metric}_ms"] == pytest.approx(j[f"mean_{metric}_ms"], rel=1e-9)
        assert m[f"p99_{metric}_ms"] == pytest.approx(j[f"p99_{metric}_ms"], rel=1e-9)
        assert m[f"slo_p_{metric}_ms"] == pytest.approx(j[f"p99_{metric}_ms"], rel=1e-9)
    assert m["p50_ttft_ms"] == pytest.approx(j["median_ttft_ms"], rel=1e-9)
    assert m["p90_e2el_ms"] == pytest.approx(ms(np.percentile(o.e2el, 90)), rel=1e-9)
    for k in ("completed", "failed", "request_throughput", "output_throughput",
              "total_token_throughput", "num_preemptions"):
        assert m[k] == pytest.approx(j[k], rel=1e-12), k
    assert m["mean_output_len"] == pytest.approx(o.out.mean())
    # queue growth by its definition: in system (arrived, not finished) at T vs T/2, over the
    # arrivals in (T/2, T]
    if len(o.ids) >= 20:
        t_end = o.arrival.max()

        def in_sys(t):
            return ((o.arrival <= t) & (o.finish > t)).sum()

        late = ((o.arrival > t_end / 2) & (o.arrival <= t_end)).sum()
        want = (in_sys(t_end) - in_sys(t_end / 2)) / late if late else math.nan
        assert m["queue_growth"] == pytest.approx(want, nan_ok=True)


def test_fast_path_reports_the_same(run):
    """The decode-group fast path records the same run. Its ITL samples are step durations
    where the exact loop subtracts token timestamps, so ITL statistics agree to rounding
    (~1e-15 relative), everything else exactly."""
    fast = run_experiment(run.cfg)
    a = compute_bench_result(fast, date="x")
    b = compute_bench_result(run.result, date="x")
    for k in ("wall_seconds", "sim_speed"):
        a.pop(k), b.pop(k)
    assert a.keys() == b.keys()
    for k in a:
        if "_itl_" in k:
            assert a[k] == pytest.approx(b[k], rel=1e-12), k
        else:
            assert a[k] == b[k], k


def test_max_output_tokens_with_a_one_token_final_chunk():
    """Regression: one request, 257 prompt tokens through a 256-token budget (chunks 256 +
    1), 5 output tokens: at most 5 tokens can fall in any 1-s bucket (the 1-token final
    chunk is a decode-shaped row *and* samples the first token: once, not twice)."""
    cfg = resolve_config(load_config(None, BASE + [
        "workload.num_prompts=1", "workload.input_len=257", "workload.output_len=5",
        "scheduler.max_num_batched_tokens=256", "scheduler.max_num_seqs=16"]))
    bench = compute_bench_result(run_experiment(cfg))
    assert bench["total_output_tokens"] == 5
    assert bench["max_output_tokens_per_s"] == 5.0


# ---------------------------------------------------------------------------------------------
# the engine's side (vLLM's Prometheus histograms) and the frontend


def test_engine_side_columns_by_definition(run):
    """requests.csv's engine-side columns: vLLM's ``arrival_time`` (end of the API server's
    request work), tokenized and queued times, engine TTFT/E2EL from arrival_time to the
    output work's start, prefill / decode / engine TPOT from the engine's token times (all
    equal to the client's without a frontend)."""
    o, c = run.oracle, run.csv
    close(floats(c["frontend_arrival_s"]), o.fe_arrival, "frontend_arrival_s")
    close(floats(c["tokenized_s"]), o.tokenized, "tokenized_s")
    close(floats(c["queued_s"]), o.queued, "queued_s")
    close(floats(c["engine_first_token_s"]), o.engine_first, "engine_first_token_s")
    close(floats(c["first_token_iter_s"]), o.first_iter, "first_token_iter_s")
    close(floats(c["engine_ttft_s"]), o.engine_ttft, "engine_ttft_s")
    close(floats(c["engine_e2el_s"]), o.engine_e2el, "engine_e2el_s")
    close(floats(c["engine_tpot_s"]), o.engine_tpot, "engine_tpot_s")
    close(floats(c["prefill_s"]), o.prefill, "prefill_s")
    close(floats(c["decode_s"]), o.decode, "decode_s")
    if run.frontend:  # the frontend's terms are there, and ordered
        assert (o.fe_arrival - o.send >= run.oracle.fe["request_s"] - 1e-15).all()
        assert (o.queued > o.tokenized).all() and (o.tokenized > o.fe_arrival).all()
        assert (o.first_token > o.engine_first).all() and (o.engine_ttft < o.ttft).all()
    else:
        close(o.ttft, o.engine_ttft, "engine TTFT = client TTFT without a frontend")


def test_engine_statistics_and_ttft_breakdown(run):
    """result.json's ``<stat>_engine_<metric>_ms`` over completed requests (vLLM's np
    statistics), the engine's ITL sample (gaps between engine token times), and
    ``ttft_breakdown_ms``: six means whose sum is the mean client TTFT."""
    o, j = run.oracle, run.json
    d = o.done
    series = {"ttft": o.engine_ttft[d], "tpot": o.engine_tpot[d & (o.out > 1)],
              "e2el": o.engine_e2el[d], "queue_time": o.queue[d],
              "prefill_time": o.prefill[d], "decode_time": o.decode[d],
              "itl": np.concatenate([o.engine_itls[i] for i in np.flatnonzero(d)])}
    for metric, x in series.items():
        for stat, v in vllm_stats(x).items():
            assert j[f"{stat}_engine_{metric}_ms"] == pytest.approx(v, rel=1e-9, abs=1e-9), \
                f"{stat}_engine_{metric}_ms"
    terms = {"api_server": o.fe_arrival - o.send, "tokenizer": o.tokenized - o.fe_arrival,
             "ipc_in": o.queued - o.tokenized, "engine_queue": o.first_sched - o.queued,
             "engine_prefill": o.engine_first - o.first_sched,
             "output": o.first_token - o.engine_first}
    got = j["ttft_breakdown_ms"]
    assert list(got) == list(terms)
    for k, v in terms.items():  # (summed in whole nanoseconds)
        assert got[k] == pytest.approx(ms(v[d].mean()), rel=1e-6, abs=1e-6), k
    assert sum(got.values()) == pytest.approx(ms(o.ttft[d].mean()), rel=1e-6)
    if run.frontend:
        p = o.fe
        assert got["ipc_in"] == pytest.approx(ms(p["ipc_s"]), rel=1e-9)
        assert got["api_server"] >= ms(p["request_s"]) - 1e-9
        assert j["frontend"]["params"] == FRONTEND_PRIORS
    else:
        assert all(got[k] == 0 for k in ("api_server", "tokenizer", "ipc_in", "output"))


def test_frontend_tokenizer_batches(run):
    """The fe_* scenarios exercise vLLM's micro-batching (several prompts per batch) below the
    32-prompt cap (which closes a batch early; unit-tested in tests/simulator)."""
    if not run.frontend:
        pytest.skip("engine only")
    sizes = run.oracle.batch_sizes
    assert max(sizes) < FRONTEND_PRIORS["tokenizer_max_batch"]
    assert sum(sizes) == len(run.oracle.ids)
    if run.name == "fe_closed_loop":
        assert max(sizes) >= 2  # four requests sent at t = 0 share a window
    assert run.result.counters["tokenizer_batches"] == len(sizes)
