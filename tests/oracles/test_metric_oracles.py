"""Metric oracles: every per-request column of ``requests.csv`` and every statistic of
``result.json`` of real simulated runs, recomputed from raw event timestamps by the
definitions of ``vllm bench serve`` (``vllm/benchmarks/serve.py``: ``calculate_metrics``),
plus the agreement of ``requests.csv``, ``result.json``, ``timeseries.csv`` and the planner.

The oracle shares no code with ``simulator/metrics.py`` or ``reports/bench_result.py``. Its raw
events come from a *tap* on the scheduler's ``update_from_output`` (the engine calls it once
per step, with the step's end time ``now`` and duration ``dt``): which requests were scheduled
(and with how many tokens, from which computed offset) and which of them produced a token.
From those events alone:

- send time: open loop = arrival; with ``max_concurrency`` C, the client's semaphore in
  request order: request i goes out at max(arrival_i, the earliest end of the C requests in
  flight) (vLLM's ``asyncio.Semaphore`` around ``request_func``);
- TTFT = first token − send, E2EL = last token − send, TPOT = (E2EL − TTFT)/(out − 1) for
  out > 1, ITL = gaps between a request's consecutive tokens (a preemption's recompute gap
  included), queue = start of the first step that scheduled it − send;
- num_cached_tokens = computed offset at the first scheduling (prefix hits); preemptions = the
  number of times a request is scheduled again from a smaller computed offset (recompute);
- result.json: vLLM's statistics (np.mean/median/std/percentile ·1000) over completed
  requests, goodput by ``all(slo >= metric)`` with TPOT 0 for 1-token outputs, throughputs over
  the duration (t = 0 to the last completion), peak tokens per 1-s bucket since the first send.

They hold whatever the scheduler decides (nothing here assumes a batch composition), so they
survive scheduler rewrites; a rewrite that renames ``update_from_output`` or its ``now``/``dt``
arguments, or the ``(request, num_new_tokens, num_computed_before)`` rows of
``SchedulerOutput.scheduled``, must update :class:`Tap` only.
"""

from __future__ import annotations

import csv
import dataclasses
import heapq
import inspect
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

# name → overrides. Small runs (a second or less each), each exercising one mechanism.
SCENARIOS = {
    # open loop, Poisson, chunked prefill (a 256-token budget splits prompts)
    "open_loop": ["workload.num_prompts=60", "workload.request_rate=40",
                  "workload.input_len=300", "workload.output_len=24",
                  "workload.range_ratio=0.8", "scheduler.max_num_batched_tokens=256",
                  "scheduler.max_num_seqs=16", "cache.enable_prefix_caching=false"],
    # closed loop: 4 in flight, all offered at t = 0, so the client queues
    "closed_loop": ["workload.num_prompts=40", "workload.max_concurrency=4",
                    "workload.input_len=200", "workload.output_len=16",
                    "workload.range_ratio=0.9"],
    # a KV cache of 48 blocks × 16 tokens for 12 requests of ≤ 200 tokens: recompute
    # preemptions
    "preemption": ["workload.num_prompts=12", "workload.input_len=96",
                   "workload.output_len=60", "workload.range_ratio=0.5",
                   "cache.num_gpu_blocks_override=48"],
    # async scheduling, no chunked prefill, vLLM's priority policy: other scheduling modes
    "async_unchunked": ["workload.num_prompts=30", "workload.request_rate=25",
                        "workload.input_len=150", "workload.output_len=10",
                        "workload.range_ratio=0.9", "scheduler.async_scheduling=true",
                        "scheduler.enable_chunked_prefill=false", "scheduler.policy=priority",
                        "scheduler.max_num_seqs=8"],
    # 64 shared prefix tokens (4 full blocks) in front of every prompt: prefix-cache hits
    "prefix": ["workload.num_prompts=30", "workload.request_rate=20", "workload.prefix_len=64",
               "workload.input_len=40", "workload.output_len=12", "workload.range_ratio=0.5",
               "output.save_detailed=true"],
}


# ---------------------------------------------------------------------------------------------
# raw events


class Tap:
    """Per-step raw events, recorded around the scheduler's ``update_from_output``."""

    def __init__(self):
        self.tokens: dict[str, list[float]] = defaultdict(list)  # token times
        self.first_step_start: dict[str, float] = {}
        self.cached: dict[str, int] = {}
        self.preemptions: dict[str, int] = defaultdict(int)
        self.next_offset: dict[str, int] = {}
        # per step: (start, end, scheduled tokens, {request_id: computed tokens after it})
        self.steps: list[tuple[float, float, int, dict[str, int]]] = []
        self.chunks: dict[str, int] = defaultdict(int)  # steps scheduling > 1 token

    def install(self, monkeypatch, cls) -> None:
        orig = cls.update_from_output
        sig = inspect.signature(orig)
        tap = self

        def update_from_output(sched, out, *args, **kwargs):
            a = sig.bind(sched, out, *args, **kwargs).arguments
            now, dt = float(a["now"]), float(a["dt"])
            rows = [(r, int(n), int(c)) for r, n, c in out.scheduled]
            before = [r.num_output_tokens for r, _, _ in rows]
            result = orig(sched, out, *args, **kwargs)
            start = now - dt
            after = {}
            for (r, n, c), k0 in zip(rows, before):
                rid = r.request_id
                if rid not in tap.first_step_start:
                    tap.first_step_start[rid] = start
                    tap.cached[rid] = c
                elif c < tap.next_offset[rid]:
                    tap.preemptions[rid] += 1  # scheduled again from scratch (or its hits)
                tap.next_offset[rid] = after[rid] = c + n
                tap.chunks[rid] += n > 1
                tap.tokens[rid] += [now] * (r.num_output_tokens - k0)
            tap.steps.append((start, now, sum(n for _, n, _ in rows), after))
            return result

        monkeypatch.setattr(cls, "update_from_output", update_from_output)


def read_csv(path: Path) -> dict[str, list[str]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: [r[k] for r in rows] for k in rows[0]}


def floats(cells: list[str]) -> np.ndarray:
    return np.array([float(c) if c != "" else np.nan for c in cells])


_SIMULATIONS: dict[tuple[str, str], tuple] = {}


def simulate(name: str, cfg) -> tuple:
    """(tap, RunResult, raw per-request rows) of a scenario. Simulated once per process and
    scenario; the per-request derivation and every report are recomputed by each test (see
    :class:`Run`). Under mutation testing (mutmut sets ``MUTANT_UNDER_TEST``) the cache is
    per mutant, except for mutants of ``reports/`` (which the simulation never runs); while
    mutmut records which tests run which functions (``stats``) every test simulates."""
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if mutant in ("stats", "") or mutant.startswith("servesim.reports."):
        mutant = ""
    key = (name, mutant)
    if key in _SIMULATIONS and os.environ.get("MUTANT_UNDER_TEST") != "stats":
        return _SIMULATIONS[key]
    tap, raw = Tap(), {}

    def derive(rows):
        raw.update(rows)
        return derive_request_columns(rows)

    with pytest.MonkeyPatch.context() as mp:
        tap.install(mp, Scheduler)  # fcfs; the other policies subclass it
        mp.setattr(runner, "derive_request_columns", derive)
        result = run_experiment(cfg, fast_path=False)
    for k in [k for k in _SIMULATIONS if k[1] != mutant]:
        del _SIMULATIONS[k]  # only the current mutant's runs are kept
    _SIMULATIONS[key] = (tap, result, raw)
    return tap, result, raw


class Run:
    def __init__(self, name: str, overrides: list[str], tmp: Path):
        self.name = name
        self.cfg = resolve_config(load_config(None, BASE + overrides))
        self.tap, result, raw = simulate(name, self.cfg)
        # this test's own copy, its per-request columns derived again from the raw rows
        self.result = dataclasses.replace(result, requests=derive_request_columns(raw))
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
        n = len(specs)
        self.ids = [s.request_id for s in specs]
        self.arrival = np.array([s.arrival_s for s in specs])
        self.prompt = np.array([s.prompt_len for s in specs])
        self.out = np.array([len(tap.tokens[i]) for i in self.ids])
        self.first_token = np.array([tap.tokens[i][0] if tap.tokens[i] else np.nan
                                     for i in self.ids])
        self.finish = np.array([tap.tokens[i][-1] if tap.tokens[i] else np.nan
                                for i in self.ids])
        self.first_sched = np.array([tap.first_step_start.get(i, np.nan) for i in self.ids])
        self.cached = np.array([tap.cached.get(i, 0) for i in self.ids])
        self.preemptions = np.array([tap.preemptions[i] for i in self.ids])
        # every request of these runs is sent and finishes after exactly output_len tokens
        self.done = self.out == np.array([s.output_len for s in specs])
        # the client: a semaphore of max_concurrency slots, requests in index order
        c = run.cfg.workload.max_concurrency
        self.send = self.arrival.copy()
        if c is not None:
            ends: list[float] = []
            for i in range(n):
                if len(ends) == c:
                    self.send[i] = max(self.arrival[i], heapq.heappop(ends))
                heapq.heappush(ends, self.finish[i])
        self.ttft = self.first_token - self.send
        self.e2el = self.finish - self.send
        with np.errstate(invalid="ignore", divide="ignore"):
            self.tpot = np.where(self.out > 1, (self.e2el - self.ttft) / (self.out - 1), np.nan)
        self.queue = self.first_sched - self.send
        self.itls = [np.diff(tap.tokens[i]) for i in self.ids]
        self.duration = float(np.max(self.finish[self.done]))


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
    """vLLM: tokens of successful requests bucketed by int(t − first send), peak bucket."""
    o = run.oracle
    t0 = o.send[o.done].min()
    times = np.concatenate([run.tap.tokens[i] for i in np.array(o.ids)[o.done]])
    counts = np.bincount((times - t0).astype(np.int64))
    got = run.json["max_output_tokens_per_s"]
    if got != counts.max() and o.preemptions.sum():
        pytest.xfail("known gap: result.json counts num_decode_reqs per step + first tokens, "
                     "missing the token a recompute prefill samples after a preemption")
    assert got == float(counts.max())


def test_max_concurrent_requests_by_vllm_buckets(run):
    """vLLM 0.22.1: per 1-s bucket since the first send, every successful request active at
    any time in that second counts; the peak bucket."""
    o = run.oracle
    t0 = o.send[o.done].min()
    per_s = np.zeros(int(np.ceil(o.finish.max() - t0)) + 1)
    for s, e in zip(o.send[o.done], o.finish[o.done]):
        per_s[int(s - t0):int(e - t0) + 1] += 1
    if run.json["max_concurrent_requests"] != per_s.max():
        pytest.xfail("known gap: servesim reports the instantaneous peak of overlapping "
                     "[send, finish) intervals (documented in bench_result.py), vLLM the "
                     "per-second bucket count (larger)")
    assert run.json["max_concurrent_requests"] == int(per_s.max())


def test_max_concurrent_requests_documented_sweep(run):
    """servesim's documented definition: peak count of overlapping [send, finish)."""
    o = run.oracle
    s, e = o.send[o.done], o.finish[o.done]
    peak = max(int(((s <= t) & (e > t)).sum()) for t in s)
    assert run.json["max_concurrent_requests"] == peak
    if run.cfg.workload.max_concurrency is not None:
        assert peak == run.cfg.workload.max_concurrency


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


def test_timeseries_steps_match_raw_steps(run):
    ts, steps = run.ts, run.tap.steps
    end = floats(ts["time_s"])
    dur = floats(ts["step_seconds"])
    close(end, [s[1] for s in steps], "step end times")
    close(end - dur, [s[0] for s in steps], "step start times")
    assert (np.diff(end) > 0).all() and (end[1:] - dur[1:] >= end[:-1] - 1e-12).all()
    tok = floats(ts["step_tokens"])
    assert tok.tolist() == [float(s[2]) for s in steps]
    close(floats(ts["num_prefill_tokens"]) + floats(ts["num_decode_reqs"]), tok,
          "prefill + decode tokens = step tokens")
    assert run.json["num_steps"] == len(steps)
    # every token and every first scheduling happens at a step boundary
    ends, starts = set(end.tolist()), set((end - dur).tolist())
    o = run.oracle
    assert all(t in ends for i in o.ids for t in run.tap.tokens[i])
    assert set(o.first_sched.tolist()) <= starts


def test_timeseries_gauges(run):
    """After each step: running = admitted, not finished; waiting = sent before the step
    ended, not yet scheduled; preemptions counter ends at the per-request total; vLLM's
    scheduled-token conservation (prompt − hits + out − 1 per request, more after a
    preemption's recompute)."""
    o, ts = run.oracle, run.ts
    end = floats(ts["time_s"])
    start = end - floats(ts["step_seconds"])
    running = floats(ts["vllm:num_requests_running"])
    waiting = floats(ts["vllm:num_requests_waiting"])
    pre_total = floats(ts["vllm:num_preemptions_total"])
    assert pre_total[-1] == o.preemptions.sum() and (np.diff(pre_total) >= 0).all()
    need = int((o.prompt - o.cached + o.out - 1).sum())
    total = int(floats(ts["step_tokens"]).sum())
    if o.preemptions.sum() == 0:
        assert total == need
        for k in range(len(end)):
            admitted = o.first_sched <= start[k]
            assert running[k] == (admitted & (o.finish > end[k])).sum(), k
            assert waiting[k] == ((o.send < end[k]) & ~admitted).sum(), k
    else:
        assert total > need
        assert (running + waiting <= len(o.ids)).all()


def test_kv_cache_usage_from_block_counts(run):
    """Without shared prefixes: used blocks = Σ over running requests of
    ceil(computed tokens / block_size); usage = used / (num_gpu_blocks − 1) (null block)."""
    if run.cfg.cache.enable_prefix_caching or run.oracle.preemptions.sum():
        pytest.skip("needs unshared blocks and no preemption")
    bs = run.cfg.cache.block_size
    nb = run.json["num_gpu_blocks"]
    usage = floats(run.ts["vllm:kv_cache_usage_perc"])
    held: dict[str, int] = {}
    o = run.oracle
    fin = dict(zip(o.ids, o.finish))
    for k, (_, end, _, after) in enumerate(run.tap.steps):
        held.update(after)
        for rid in [r for r in held if fin[r] <= end]:
            del held[rid]
        used = sum(-(-c // bs) for c in held.values())
        assert usage[k] == pytest.approx(used / (nb - 1), rel=1e-12, abs=1e-15), k


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


@pytest.mark.xfail(strict=True, reason=(
    "bug: result.json counts num_decode_reqs per step plus one first token per request; a "
    "1-token final prefill chunk is a decode row *and* samples the first token, so it is "
    "counted twice (and a recompute prefill after a preemption not at all). Needs the "
    "sampled-token count per step in the step records (engine.Recorder)."))
def test_max_output_tokens_with_a_one_token_final_chunk():
    """One request, 257 prompt tokens through a 256-token budget (chunks 256 + 1), 5 output
    tokens: at most 5 tokens can fall in any 1-s bucket."""
    cfg = resolve_config(load_config(None, BASE + [
        "workload.num_prompts=1", "workload.input_len=257", "workload.output_len=5",
        "scheduler.max_num_batched_tokens=256", "scheduler.max_num_seqs=16"]))
    bench = compute_bench_result(run_experiment(cfg))
    assert bench["total_output_tokens"] == 5
    assert bench["max_output_tokens_per_s"] == 5.0
