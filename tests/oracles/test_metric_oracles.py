"""Metric oracles of the client-side reports: ``requests.csv``, ``result.json``, the planner's
metrics and the fast path, recomputed from raw events (definitions in ``metric_oracle.py``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from metric_oracle import BASE, close, floats, ms, vllm_stats
from servesim.reports.bench_result import compute_bench_result
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.plan.slo import point_metrics
from servesim.simulator.plan.spec import PlanSLO
from servesim.simulator.runner import run_experiment

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
