"""``reports/bench_result.py`` details by value: vLLM's ``errors`` list, JSON-safe numbers,
missing columns, percentile key names, and the streamed path (per-request lists written window
by window, sketched percentiles) against the in-memory computation of the same rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
from servesim.reports.bench_requests import PerRequest, _col, _floats
from servesim.reports.bench_result import (
    _metric_keys,
    _num,
    _take,
    compute_bench_result,
    metrics_in,
    parse_list,
)
from servesim.reports.bench_stats import percentile_word
from servesim.simulator import metrics
from servesim.simulator.config import load_config
from servesim.simulator.metrics import (
    Distribution,
    LazyRequests,
    RequestLog,
    RunResult,
    derive_request_columns,
)

DATE = "20260101-000000"


def test_errors_list_for_failed_requests(make_result):
    """vLLM's ``errors``: "" for a success; the request's error text when it has one, else
    its finished_reason (also when the text is empty or a missing-value spelling)."""
    r = make_result(reasons=["length", "abort", "rejected", "in_flight", "rejected"],
                    output__save_detailed="true")
    r.requests["error"] = np.array(["", "client went away", "", "nan", "prompt too long"],
                                   dtype=object)
    b = compute_bench_result(r, date=DATE)
    assert b["errors"] == ["", "client went away", "rejected", "in_flight", "prompt too long"]
    r.requests["error"] = np.array(["", "None", None, "x", ""], dtype=object)
    b = compute_bench_result(r, date=DATE)
    assert b["errors"] == ["", "abort", "rejected", "x", "rejected"]
    del r.requests["error"]
    assert compute_bench_result(r, date=DATE)["errors"] == [
        "", "abort", "rejected", "in_flight", "rejected"]


def test_json_safe_numbers():
    assert _num(None) is None
    assert _num(np.bool_(True)) is True and _num(False) is False
    assert _num(np.int64(7)) == 7 and type(_num(np.int64(7))) is int
    assert _num(np.float32(0.5)) == 0.5 and type(_num(np.float32(0.5))) is float
    assert _num(math.nan) is None and _num(-math.inf) is None and _num(np.inf) is None
    assert _floats(np.array([1, np.nan, np.inf, 2.5])) == [1.0, 0.0, 0.0, 2.5]
    assert _floats([np.nan, 3], fill=None) == [None, 3.0]
    assert all(type(v) is float for v in _floats(np.array([1, 2], dtype=np.int64)))


def test_missing_columns_and_empty_parts():
    req = {"a": np.array([1, 2])}
    assert _col(req, "a", 2).tolist() == [1, 2]
    assert _col(req, "b", 3, 0).tolist() == [0, 0, 0]
    nan = _col(req, "b", 2)
    assert nan.shape == (2,) and np.isnan(nan).all()
    parts = [np.array([1.0]), np.array([2.0, 3.0])]
    assert _take(parts).tolist() == [1.0, 2.0, 3.0] and parts == []
    assert _take([]).shape == (0,)


def test_percentile_key_spelling():
    assert percentile_word(99.0) == "99" and percentile_word(99.9) == "99.9"
    assert percentile_word(50) == "50"
    assert _metric_keys("ttft", [50.0, 99.9]) == [
        "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99.9_ttft_ms"]
    assert parse_list(" ttft, tpot,,itl ") == ["ttft", "tpot", "itl"]
    assert parse_list(None) == [] and parse_list("") == []


def test_metrics_in_finds_every_metric(make_result):
    b = compute_bench_result(make_result(output__percentile_metrics="ttft,e2el",
                                         output__metric_percentiles="50,99.9"), date=DATE)
    assert "mean_tpot_ms" not in b and "p99.9_e2el_ms" in b
    found = metrics_in(b)
    assert [f[0] for f in found] == ["ttft", "e2el"]
    assert found[1] == ("e2el", "E2EL", "End-to-end Latency", ["50", "99.9"])


# ---------------------------------------------------------------------------------------------
# streamed runs


def _raw(n):
    """n raw rows: every 7th rejected, output 1 + i % 5 tokens, send = arrival."""
    i = np.arange(n, dtype=float)
    reasons = np.array(["rejected" if k % 7 == 3 else "length" for k in range(n)],
                       dtype=object)
    rej = reasons == "rejected"
    first = np.where(rej, np.nan, i * 0.1 + 0.05 + (i % 3) * 0.01)
    out = np.where(rej, 0, 1 + i % 5)
    return {
        "index": i, "arrival_s": i * 0.1, "send_s": i * 0.1, "prompt_len": 10 + i,
        "output_len": out.astype(float), "num_cached_tokens": np.zeros(n),
        "first_scheduled_s": np.where(rej, np.nan, i * 0.1 + 0.01), "first_token_s": first,
        "finish_s": np.where(rej, i * 0.1, first + 0.02 * (out - 1) + (i % 4) * 0.001),
        "num_preemptions": np.zeros(n),
        "request_id": np.array([str(k) for k in range(n)], dtype=object),
        "finished_reason": reasons,
        "error": np.where(rej, "too long", "").astype(object),
        # an engine-only run: no client control, the frontend's times are the send times
        "stage": np.zeros(n), "warmup": np.zeros(n), "attempts": np.ones(n),
        "frontend_arrival_s": i * 0.1, "tokenized_s": i * 0.1, "queued_s": i * 0.1,
        "engine_first_token_s": np.full(n, np.nan), "engine_finish_s": np.full(n, np.nan),
        "first_token_iter_s": np.full(n, np.nan), "finish_iter_s": np.full(n, np.nan),
    }


def _results(tmp_path, n=60):
    raw = _raw(n)
    cfg = load_config(None, ["output.save_detailed=true", "slo.ttft_ms=70"])
    itl = np.round(np.arange(500) * 0.0001 + 0.02, 6)  # distinct: every rank differs
    counts = np.arange(500) % 3 + 1
    # decode tokens per step (0.1 s apart): the busiest 1-s bucket needs steps + first tokens
    t = np.arange(1, 60) * 0.1 + 0.003
    steps = {"time_s": t, "num_decode_reqs": (np.arange(1, 60) % 7).astype(float)}
    mem = RunResult(cfg, derive_request_columns(raw), itl, counts, steps,
                    workload_meta={"num_prompts": n})
    log = RequestLog(tmp_path, spill_rows=0)
    for lo in range(0, n, 16):  # chunks in end order
        log.append({k: v[lo:lo + 16][::-1] for k, v in raw.items()})
    stream = Distribution(exact_limit=0)
    stream.add(itl, counts)
    streamed = RunResult(cfg, LazyRequests(log), np.zeros(0), np.zeros(0, np.int64), steps,
                         workload_meta={"num_prompts": n}, request_log=log, itl_stream=stream)
    return mem, streamed


def test_streamed_lists_equal_in_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "CHUNK_ROWS", 16)  # several windows
    mem, st = _results(tmp_path)
    assert st.streamed
    a, b = (compute_bench_result(r, date=DATE) for r in (mem, st))
    for k in ("input_lens", "output_lens", "ttfts", "start_times", "generated_texts",
              "errors", "latencies", "queue_times"):
        assert isinstance(b[k], PerRequest) and len(b[k]) == 60, k
        assert list(b[k]) == a[k], k
        assert [x for w in b[k].windows() for x in w] == a[k], k
    assert list(b["itls"]) == [None] * 60 and a["itls"] == [None] * 60
    for k in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
              "request_throughput", "request_goodput", "max_concurrent_requests",
              "max_output_tokens_per_s", "mean_ttft_ms", "std_ttft_ms", "median_ttft_ms",
              "p99_ttft_ms", "mean_itl_ms", "std_itl_ms"):
        assert b[k] == pytest.approx(a[k], rel=1e-9), k
    assert b["approximate_percentiles"]["metrics"] == ["itl"]
    assert "approximate_percentiles" not in a
    # peak 1-s bucket, by hand: steps' decode tokens + first tokens of completed requests
    done = mem.requests["finished_reason"] != "rejected"
    times = np.r_[steps_of(mem)["time_s"], mem.requests["first_token_s"][done]]
    weights = np.r_[steps_of(mem)["num_decode_reqs"], np.ones(done.sum())]
    peak = np.bincount(np.floor(times).astype(int), weights=weights).max()
    assert a["max_output_tokens_per_s"] == b["max_output_tokens_per_s"] == peak


def steps_of(r):
    return r.steps


def test_peak_tokens_from_the_generation_counter_first_bucket(make_result):
    """With vllm:generation_tokens_total the per-step tokens are its differences (the first
    step's from 0) and first tokens are not added again."""
    r = make_result()
    del r.steps["num_generated_tokens"]  # a timeseries from before that column
    r.steps["vllm:generation_tokens_total"] = np.cumsum([9, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    # steps end at .5 .7 .8 .9 | 1.0 1.1 1.4 1.5 1.7 | 2.5: [0,1) = 9 + 3 = 12
    assert compute_bench_result(r, date=DATE)["max_output_tokens_per_s"] == 12.0


def test_sketched_percentiles_within_relative_accuracy(tmp_path, monkeypatch):
    """Past EXACT_SAMPLES a metric's median/percentiles come from the sketch (relative error
    ≤ 0.1% of the order statistic around the rank), mean/std stay exact."""
    monkeypatch.setattr(metrics, "EXACT_SAMPLES", 5)
    mem, st = _results(tmp_path)
    a = compute_bench_result(mem, date=DATE)
    monkeypatch.setattr(metrics, "EXACT_SAMPLES", 5)
    b = compute_bench_result(st, date=DATE)
    ap = b["approximate_percentiles"]
    assert (ap["metrics"], ap["method"], ap["relative_accuracy"]) == (
        ["ttft", "tpot", "itl", "e2el"], "ddsketch", 0.001)
    done = np.array([x for x in mem.requests["finished_reason"]]) != "rejected"
    ttft = np.sort(mem.requests["ttft_s"][done]) * 1000
    n = len(ttft)
    for key, q in (("median_ttft_ms", 0.5), ("p99_ttft_ms", 0.99)):
        lo, hi = ttft[math.floor(q * (n - 1))], ttft[math.ceil(q * (n - 1))]
        assert lo * 0.999 <= b[key] <= hi * 1.001, key
    for key in ("mean_ttft_ms", "std_ttft_ms", "mean_e2el_ms", "std_tpot_ms", "mean_itl_ms"):
        assert b[key] == pytest.approx(a[key], rel=1e-9), key
    itl = np.sort(np.repeat(mem.itl_values, mem.itl_counts)) * 1000
    m = len(itl)
    lo, hi = itl[math.floor(0.99 * (m - 1))], itl[math.ceil(0.99 * (m - 1))]
    assert lo * 0.999 <= b["p99_itl_ms"] <= hi * 1.001


# ---------------------------------------------------------------------------------------------
# traffic, identity and servesim keys


def test_traffic_and_identity_keys(make_result):
    from datetime import UTC, datetime
    from importlib import metadata

    r = make_result(meta={"num_prompts": 5, "request_rate": float("inf"),
                          "burstiness": float("inf"), "seed": 42},
                    parallel__data_parallel_size=2, output__label="run-a",
                    hardware__name="h100-sxm")
    before = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    b = compute_bench_result(r)
    after = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    assert before <= b["date"] <= after and len(b["date"]) == 15
    assert (b["request_rate"], b["burstiness"]) == ("inf", "inf")
    assert b["label"] == "run-a" and b["num_prompts"] == 5
    assert (b["seed"], b["gpu"], b["num_gpus"], b["data_parallel_size"]) == (42, "h100-sxm",
                                                                            2, 2)
    assert b["dataset_name"] == "random"  # not in meta: the workload kind
    assert b["servesim_version"] == metadata.version("servesim")
    r2 = make_result(meta={"request_rate": 2.5, "burstiness": 0.5, "dataset_name": "sharegpt"})
    b2 = compute_bench_result(r2, date=DATE)
    assert (b2["request_rate"], b2["burstiness"]) == (2.5, 0.5)
    assert b2["dataset_name"] == "sharegpt"
    assert b2["num_prompts"] == 1000  # from the config's workload when meta has none
    assert b2["seed"] == 0 and b2["label"] is None


def test_counters_fall_back_to_the_last_step_and_the_capacity(make_result):
    r = make_result()
    r.counters = {}
    r.steps["vllm:num_preemptions_total"] = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 3])
    r.steps["vllm:prefix_cache_hits_total"] = np.array([0] * 9 + [50])
    r.capacity = {"num_gpu_blocks": 777}
    b = compute_bench_result(r, date=DATE)
    assert (b["num_preemptions"], b["prefix_cache_hits"], b["num_gpu_blocks"]) == (3, 50, 777)
    assert b["prefix_cache_hit_rate"] == pytest.approx(50 / 650)
    assert b["num_steps"] is None and b["wall_seconds"] is None


def test_short_runs_still_have_throughputs(make_result):
    r = make_result()
    r.requests["finish_s"] = np.array([0.6, 0.8, 0.9, 0.95, np.nan])  # duration 0.95 s
    b = compute_bench_result(r, date=DATE)
    assert b["duration"] == 0.95
    assert b["request_throughput"] == pytest.approx(4 / 0.95)
    assert b["output_throughput"] == pytest.approx(10 / 0.95)


def test_per_request_itls_when_the_engine_provides_them(make_result):
    r = make_result(output__save_detailed="true")
    r.request_itls = [[0.2, 0.2, 0.2], [], [0.5, np.nan], [0.3], []]
    b = compute_bench_result(r, date=DATE)
    assert b["itls"] == [[0.2, 0.2, 0.2], [], [0.5, 0.0], [0.3], []]
    assert compute_bench_result(make_result(output__save_detailed="true"),
                                date=DATE)["itls"] == [None] * 5


def test_bare_config_and_missing_columns_use_vllm_defaults(make_result):
    """A RunResult from elsewhere: a config without output/slo sections (vLLM's defaults:
    ttft,tpot,itl,e2el at p99, no goodput, no details) and requests with only timestamps
    (TTFT/E2EL from first token/finish − send, send = arrival, lengths 0 when absent)."""
    from types import SimpleNamespace

    full = make_result()
    cfg = full.config
    bare = SimpleNamespace(model=cfg.model, hardware=cfg.hardware, parallel=cfg.parallel,
                           workload=cfg.workload, config_hash=cfg.config_hash)
    keep = ("finished_reason", "arrival_s", "first_token_s", "finish_s", "output_len",
            "request_id")
    r = RunResult(bare, {k: full.requests[k] for k in keep}, full.itl_values, full.itl_counts,
                  full.steps, counters=full.counters, workload_meta=full.workload_meta)
    a = compute_bench_result(full, date=DATE)
    b = compute_bench_result(r, date=DATE)
    for k in ("mean_ttft_ms", "p99_ttft_ms", "mean_e2el_ms", "median_tpot_ms", "p99_itl_ms",
              "latencies", "completed", "total_output_tokens", "max_concurrent_requests"):
        assert b[k] == a[k], k
    assert b["total_input_tokens"] == 0 and b["request_goodput"] is None
    assert "input_lens" not in b and b["queue_times"] == [0.0] * 5
    # NaN latencies in the columns are filled from the timestamps too
    full.requests["ttft_s"] = np.full(5, np.nan)
    full.requests["e2el_s"] = np.full(5, np.nan)
    c = compute_bench_result(full, date=DATE)
    assert (c["mean_ttft_ms"], c["mean_e2el_ms"]) == (a["mean_ttft_ms"], a["mean_e2el_ms"])
    # an output section with vllm bench --metadata: its keys go right after num_prompts
    bare.output = SimpleNamespace(metadata={"team": "perf", "n": 3}, label="x",
                                  percentile_metrics="ttft", metric_percentiles="50")
    d = compute_bench_result(r, date=DATE)
    keys = list(d)
    assert keys[keys.index("num_prompts") + 1:keys.index("request_rate")] == ["team", "n"]
    assert (d["team"], d["n"], d["label"]) == ("perf", 3, "x")
    assert "p50_ttft_ms" in d and "mean_tpot_ms" not in d
