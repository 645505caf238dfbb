"""result.json contents: vLLM's key set/order and calculate_metrics definitions.

The timelines are in conftest.py; expected values below are worked out by hand from them.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from servesim.reports import VLLM_BENCH_KEYS, compute_bench_result, print_summary
from servesim.reports.bench_stats import _itl_stats, _max_concurrent

DATE = "20260102-030405"

# vllm/benchmarks/serve.py (ecosystem-formats.md §2.3), default metric set ttft,tpot,itl,e2el
# at --metric-percentiles 99, no --save-detailed / --metadata / ramp-up / --max-concurrency.
VLLM_KEYS = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency",
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "latencies", "queue_times",
    "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p99_e2el_ms",
]  # fmt: skip
DETAILED = ["input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts",
            "errors"]  # fmt: skip
EXTRAS = [
    "simulated", "servesim_version", "config_hash", "seed", "dataset_name", "gpu", "num_gpus",
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "num_gpu_blocks",
    "num_preemptions", "prefix_cache_hit_rate", "prefix_cache_queries", "prefix_cache_hits",
    "num_steps", "wall_seconds", "sim_speed",
]  # fmt: skip


def bench_of(make_result, **kw):
    return compute_bench_result(make_result(**kw), date=DATE)


def approx_ms(seconds):
    return pytest.approx(seconds * 1000, rel=1e-12, abs=1e-9)


# --- schema ---------------------------------------------------------------------------------


def test_vllm_bench_keys_constant():
    assert VLLM_BENCH_KEYS == VLLM_KEYS


def test_default_key_order(make_result):
    b = bench_of(make_result)
    assert list(b) == VLLM_KEYS + EXTRAS
    assert b["date"] == DATE
    assert b["endpoint_type"] == "openai" and b["backend"] == "openai"
    assert b["model_id"] == b["tokenizer_id"] == "llama-3.1-8b"
    assert b["label"] is None
    assert b["simulated"] is True


def test_save_detailed_key_order(make_result):
    b = bench_of(make_result, output__save_detailed="true")
    i = VLLM_KEYS.index("latencies")
    assert list(b) == VLLM_KEYS[:i] + DETAILED + VLLM_KEYS[i:] + EXTRAS


def test_percentile_key_names_and_metric_selection(make_result):
    b = bench_of(make_result, output__metric_percentiles="50,90,99.9",
                 output__percentile_metrics="e2el,ttft")  # fmt: skip
    metric_keys = [k for k in b if k.endswith("_ms")]
    # vLLM's fixed order ttft, tpot, itl, e2el regardless of the flag's order
    assert metric_keys == [
        f"{s}_{m}_ms"
        for m in ("ttft", "e2el")
        for s in ("mean", "median", "std", "p50", "p90", "p99.9")
    ]


def test_max_concurrency_and_ramp_up_keys(make_result):
    meta = {
        "num_prompts": 5, "request_rate": math.inf, "burstiness": 1.0, "max_concurrency": 2,
        "ramp_up_strategy": "linear", "ramp_up_start_rps": 1.0, "ramp_up_end_rps": 8.0,
    }  # fmt: skip
    b = bench_of(make_result, meta=meta)
    keys = list(b)
    assert b["request_rate"] == "inf"
    assert b["max_concurrency"] == 2
    i = keys.index("max_concurrency")
    assert keys[i + 1 : i + 5] == ["ramp_up_strategy", "ramp_up_start_rps", "ramp_up_end_rps",
                                   "duration"]  # fmt: skip
    tail = keys[keys.index("p99_e2el_ms") + 1 : keys.index("simulated")]
    assert tail == [
        f"{s}_{m}_ms"
        for m in ("client_queue_time", "e2el_including_client_queue")
        for s in ("mean", "median", "std", "p99")
    ]


# --- metric definitions ---------------------------------------------------------------------


def test_counts_and_throughputs(make_result):
    b = bench_of(make_result)
    assert b["num_prompts"] == 5
    assert (b["completed"], b["failed"]) == (4, 1)
    assert b["duration"] == 2.5
    assert b["total_input_tokens"] == 650  # completed requests only, like vLLM
    assert b["total_output_tokens"] == 10
    assert b["request_throughput"] == pytest.approx(4 / 2.5)
    assert b["output_throughput"] == pytest.approx(10 / 2.5)
    assert b["total_token_throughput"] == pytest.approx(660 / 2.5)
    assert b["request_goodput"] is None  # no SLO configured
    assert b["rtfx"] == 0.0


def test_ttft_tpot_itl_e2el_by_hand(make_result):
    b = bench_of(make_result)
    # TTFT [.5 .6 .5 .4]: mean .5, median .5, population std sqrt(.02/4); p99 rank 2.97
    assert b["mean_ttft_ms"] == approx_ms(0.5)
    assert b["median_ttft_ms"] == approx_ms(0.5)
    assert b["std_ttft_ms"] == approx_ms(math.sqrt(0.02 / 4))
    assert b["p99_ttft_ms"] == approx_ms(0.5 + 0.97 * 0.1)
    # TPOT = (e2el - ttft)/(out - 1): r0 .6/3=.2, r2 1.5/2=.75, r3 .3/1; r1 (1 token) excluded
    tp = [0.2, 0.75, 0.3]
    assert b["mean_tpot_ms"] == approx_ms(sum(tp) / 3)
    assert b["median_tpot_ms"] == approx_ms(0.3)
    assert b["std_tpot_ms"] == approx_ms(float(np.std(tp)))
    assert b["p99_tpot_ms"] == approx_ms(0.3 + 0.98 * 0.45)
    # ITL pooled [.2 .2 .2 .3 .5 1.0]: mean .4, median .25, p99 rank 4.95
    assert b["mean_itl_ms"] == approx_ms(0.4)
    assert b["median_itl_ms"] == approx_ms(0.25)
    assert b["std_itl_ms"] == approx_ms(float(np.std([0.2, 0.2, 0.2, 0.3, 0.5, 1.0])))
    assert b["p99_itl_ms"] == approx_ms(0.5 + 0.95 * 0.5)
    # E2EL [1.1 .6 2.0 .7]: mean 1.1, median .9, p99 rank 2.97 -> 1.1 + .97*.9
    assert b["mean_e2el_ms"] == approx_ms(1.1)
    assert b["median_e2el_ms"] == approx_ms(0.9)
    assert b["p99_e2el_ms"] == approx_ms(1.1 + 0.97 * 0.9)
    # per-request arrays in seconds, 0.0 for the failed request (vLLM's default)
    assert b["latencies"] == pytest.approx([1.1, 0.6, 2.0, 0.7, 0.0])
    assert b["queue_times"] == [0.0] * 5


def test_percentiles_match_numpy_linear(make_result):
    b = bench_of(make_result, output__metric_percentiles="0,25,50,90,99.9,100")
    itl = np.repeat([0.2, 0.5, 1.0, 0.3], [3, 1, 1, 1])
    for p, w in [(0, "0"), (25, "25"), (50, "50"), (90, "90"), (99.9, "99.9"), (100, "100")]:
        assert b[f"p{w}_itl_ms"] == approx_ms(np.percentile(itl, p))
        assert b[f"p{w}_ttft_ms"] == approx_ms(np.percentile([0.5, 0.6, 0.5, 0.4], p))


@pytest.mark.parametrize(
    "slo, good",
    [
        ({"slo__ttft_ms": 550, "slo__tpot_ms": 500}, 2),  # r0, r3 (r1 TTFT .6, r2 TPOT .75)
        ({"slo__tpot_ms": 250}, 2),  # r0 (.2) and r1 (one token: TPOT counts as 0)
        ({"slo__e2el_ms": 1100}, 3),  # inclusive: r0 at exactly 1.1 s, r1, r3
        ({"slo__ttft_ms": 1}, 0),
    ],
)
def test_goodput(make_result, slo, good):
    b = bench_of(make_result, **slo)
    assert b["request_goodput"] == pytest.approx(good / 2.5)


def test_peak_output_tokens_and_concurrency(make_result):
    b = bench_of(make_result)
    # 1-s buckets of num_generated_tokens (one per step): [0,1) .5 .7 .8 .9 = 4; [1,2) 1.0 1.1
    # 1.4 1.5 1.7 = 5
    assert b["max_output_tokens_per_s"] == 5.0
    r = make_result()
    r.steps["num_generated_tokens"] = np.array([1, 1, 1, 1, 2, 1, 1, 1, 1, 7])
    assert compute_bench_result(r, date=DATE)["max_output_tokens_per_s"] == 7.0  # [2,3)
    # timeseries without it: decode rows per step + first tokens of completed requests
    # [0,1) first .5 .8 + decode .7 .9 = 4; [1,2) 1.0 1.4 + 1.1 1.5 1.7 = 5
    del r.steps["num_generated_tokens"]
    assert compute_bench_result(r, date=DATE)["max_output_tokens_per_s"] == 5.0
    r.steps["num_decode_reqs"] = np.array([0, 1, 0, 1, 0, 1, 0, 1, 1, 6])
    assert compute_bench_result(r, date=DATE)["max_output_tokens_per_s"] == 6.0
    # [0,1.1) [.2,.8) [.5,2.5) [1,1.7): three at t=.5 and at t=1.0
    assert b["max_concurrent_requests"] == 3


def test_peak_output_tokens_from_generation_counter(make_result):
    r = make_result()
    del r.steps["num_generated_tokens"]  # a timeseries from before that column
    r.steps["vllm:generation_tokens_total"] = np.cumsum([1, 1, 1, 1, 1, 1, 1, 1, 1, 1]) * 3
    # 3 tokens per step: [0,1) has 4 steps, [1,2) 5 steps, [2,3) 1 step
    assert compute_bench_result(r, date=DATE)["max_output_tokens_per_s"] == 15.0


def test_max_concurrent_requests_counts_per_second_as_vllm():
    # vLLM's buckets: [0, 1] and [1, 2] share second 1; [1, 2] and [2, 3] share second 2
    assert _max_concurrent(np.array([0.0, 1.0, 2.0]), np.array([1.0, 2.0, 3.0]), 0.0) == 2
    # back to back within one second: both count in second 0 (never simultaneous)
    assert _max_concurrent(np.array([0.1, 0.5]), np.array([0.4, 0.9]), 0.1) == 2
    # buckets from t0 = 0.5: [0.5, 1.4] → 0; [1.6, 2.2] → 1; [1.4, 1.45] → 0 (0.9 < 1)
    assert _max_concurrent(np.array([0.5, 1.6, 1.4]), np.array([1.4, 2.2, 1.45]), 0.5) == 2
    assert _max_concurrent(np.array([0.5, 1.6]), np.array([1.4, 2.2]), 0.5) == 1
    assert _max_concurrent(np.array([0.0, 0.5]), np.array([1.0, 2.0]), 0.0) == 2
    assert _max_concurrent(np.array([]), np.array([]), 0.0) == 0


def test_client_queue_times_under_max_concurrency(make_result):
    meta = {"num_prompts": 5, "request_rate": 4.0, "burstiness": 1.0, "max_concurrency": 2}
    send = [0.0, 0.2, 0.8, 1.1, 1.2]  # r2 waited .3 s, r3 .1 s for a client slot
    r = make_result(send=send, meta=meta)
    # the timeline is unchanged; only the send times moved
    r.requests["first_token_s"] = np.array([0.5, 0.8, 1.0, 1.4, np.nan])
    b = compute_bench_result(r, date=DATE)
    assert b["queue_times"] == pytest.approx([0.0, 0.0, 0.3, 0.1, 0.0])
    assert b["mean_client_queue_time_ms"] == approx_ms(0.4 / 4)
    # E2EL from send: [1.1 .6 1.7 .6]; including the client queue: [1.1 .6 2.0 .7]
    assert b["mean_e2el_ms"] == approx_ms(4.0 / 4)
    assert b["mean_e2el_including_client_queue_ms"] == approx_ms(4.4 / 4)


def test_failed_accounting(make_result):
    reasons = ["length", "abort", "rejected", "in_flight", "rejected"]
    b = bench_of(make_result, reasons=reasons)
    assert b["completed"] == 1 and b["failed"] == 4
    assert b["completed"] + b["failed"] == b["num_prompts"]
    assert b["total_input_tokens"] == 100 and b["total_output_tokens"] == 4
    assert b["mean_ttft_ms"] == approx_ms(0.5)
    # TPOT of r0 only; ITLs come from the engine's pool as given
    assert b["mean_tpot_ms"] == approx_ms(0.2)


def test_nothing_completed_is_json_safe(make_result):
    r = make_result(reasons=["rejected"] * 5)
    for c in ("first_token_s", "finish_s", "ttft_s", "e2el_s"):
        r.requests[c] = np.full(5, np.nan)
    r.itl_values, r.itl_counts = np.array([]), np.array([], dtype=np.int64)
    b = compute_bench_result(r, date=DATE)
    assert (b["completed"], b["failed"], b["duration"]) == (0, 5, 0.0)
    assert b["request_throughput"] is None  # undefined over a zero duration
    # vLLM's `np.mean(x or 0)`: empty metric lists report 0
    assert b["mean_ttft_ms"] == 0.0 and b["p99_itl_ms"] == 0.0 and b["std_e2el_ms"] == 0.0
    # vLLM 0.22.1: no successful request, no peak (its steps sampled tokens all the same)
    assert b["max_concurrent_requests"] == 0 and b["max_output_tokens_per_s"] == 0.0
    json.dumps(b, allow_nan=False)


def test_no_nan_in_json_with_details(make_result):
    b = bench_of(make_result, output__save_detailed="true", slo__ttft_ms=550)
    text = json.dumps(b, allow_nan=False)
    assert "NaN" not in text and "Infinity" not in text
    assert b["output_lens"] == [4, 1, 3, 2, 0]
    assert b["ttfts"] == pytest.approx([0.5, 0.6, 0.5, 0.4, 0.0])
    assert b["errors"] == ["", "", "", "", "rejected"]
    assert b["generated_texts"] == [""] * 5


def test_extras(make_result):
    b = bench_of(make_result, parallel__tensor_parallel_size=2, parallel__data_parallel_size=3)
    assert b["num_gpus"] == 6
    assert (b["tensor_parallel_size"], b["pipeline_parallel_size"]) == (2, 1)
    assert b["prefix_cache_hit_rate"] == pytest.approx(48 / 650)
    assert (b["prefix_cache_queries"], b["prefix_cache_hits"]) == (650, 48)
    assert b["num_gpu_blocks"] == 1234 and b["num_preemptions"] == 1 and b["num_steps"] == 10
    assert b["sim_speed"] == pytest.approx(2.5 / 0.05)
    r = make_result(parallel__tensor_parallel_size=2, parallel__data_parallel_size=3)
    assert b["config_hash"] == r.config.config_hash() != make_result().config.config_hash()


def test_extras_fall_back_to_step_counters(make_result):
    r = make_result()
    r.counters = {}
    b = compute_bench_result(r, date=DATE)
    assert (b["prefix_cache_queries"], b["prefix_cache_hits"], b["num_preemptions"]) == (650, 48, 1)
    assert b["sim_speed"] is None


# --- large ITL pools: weighted statistics equal the np.repeat expansion -----------------------


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.floats(1e-4, 2.0), st.integers(0, 40)), min_size=1, max_size=30).filter(
        lambda xs: sum(c for _, c in xs) > 0
    ),
    st.lists(st.floats(0, 100), min_size=1, max_size=4),
)
def test_weighted_itl_stats_match_expansion(pairs, ps):
    import servesim.reports.bench_stats as br

    values = np.array([v for v, _ in pairs])
    counts = np.array([c for _, c in pairs])
    exact = br._stats(np.repeat(values, counts), ps)
    old = br._ITL_EXPAND_LIMIT
    br._ITL_EXPAND_LIMIT = -1
    try:
        weighted = _itl_stats(values, counts, ps)
    finally:
        br._ITL_EXPAND_LIMIT = old
    assert weighted.keys() == exact.keys()
    for k in exact:
        assert weighted[k] == pytest.approx(exact[k], rel=1e-9, abs=1e-9), k


# --- console ----------------------------------------------------------------------------------


def test_print_summary(make_result):
    b = bench_of(make_result, slo__ttft_ms=550, slo__tpot_ms=500)
    buf = io.StringIO()
    print_summary(b, buf)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert lines[1] == "{:<40} {:<10}".format("Successful requests:", 4)
    text = buf.getvalue()
    for row in [
        "{:<40} {:<10}".format("Failed requests:", 1),
        "{:<40} {:<10.2f}".format("Request rate configured (RPS):", 4.0),
        "{:<40} {:<10.2f}".format("Benchmark duration (s):", 2.5),
        "{:<40} {:<10.2f}".format("Request goodput (req/s):", 0.8),
        "{:<40} {:<10.2f}".format("Mean TTFT (ms):", 500.0),
        "{:<40} {:<10.2f}".format("P99 ITL (ms):", 975.0),
        "{s:{c}^{n}}".format(s="Time to First Token", n=50, c="-"),
        "{s:{c}^{n}}".format(s="End-to-end Latency", n=50, c="-"),
    ]:
        assert row in lines, row
    assert "Prefix cache hit rate (%):" in text
    assert "Maximum request concurrency:" not in text  # only with max_concurrency


def test_print_summary_rich_console(make_result):
    from rich.console import Console

    console = Console(file=io.StringIO(), width=120, color_system=None)
    print_summary(bench_of(make_result), console)
    out = console.file.getvalue()
    assert "Serving Benchmark Result" in out and "Mean TPOT (ms):" in out


def test_peak_output_tokens_from_every_step_when_rows_are_sampled(make_result):
    """A sampled timeseries (``timeseries_interval_s``, long runs) sums a 10-s interval's
    tokens into one row at its end: the peak comes from ``token_steps`` (every step's) instead,
    bucketed by floor(t − t0) as above."""
    r = make_result()
    t, k = np.array(r.steps["time_s"]), np.array(r.steps["num_generated_tokens"])
    raw = [(t[5:], k[5:]), (t[:5], k[:5])]  # chunks, in any order
    r.steps = {k: (np.array([10.0]) if k == "time_s" else np.asarray(v)[-1:] * 0 + 10)
               for k, v in r.steps.items()}  # one 10-s row holding all ten tokens
    assert compute_bench_result(r, date=DATE)["max_output_tokens_per_s"] == 10.0
    r.token_steps = raw
    assert compute_bench_result(r, date=DATE)["max_output_tokens_per_s"] == 5.0  # as above


@pytest.mark.parametrize(("interval", "max_rows"), [(1.0, None), (10.0, None), (None, 50)])
def test_peak_output_tokens_do_not_depend_on_the_timeseries_sampling(interval, max_rows,
                                                                     monkeypatch):
    """The same run with every step kept, with 1-s and 10-s timeseries rows, and with raw rows
    giving way to 1-s rows past 50 steps: the same ``max_output_tokens_per_s`` (a 10-s row
    gave 7.4x it before ``token_steps``)."""
    from servesim.simulator import runner
    from servesim.simulator.config import load_config

    over = ["workload.num_prompts=120", "workload.request_rate=5"]
    base = compute_bench_result(runner.run_experiment(load_config(None, over)), date=DATE)
    if max_rows:
        monkeypatch.setattr(runner, "MAX_STEP_ROWS", max_rows)
    if interval:
        over.append(f"output.timeseries_interval_s={interval}")
    res = runner.run_experiment(load_config(None, over))
    tok = res.token_steps
    assert tok is not None and sum(len(t) for t, _ in tok) > len(res.steps["time_s"])
    assert sum(k.sum() for _, k in tok) == res.steps["num_generated_tokens"].sum() == \
        base["total_output_tokens"]
    b = compute_bench_result(res, date=DATE)
    assert b["max_output_tokens_per_s"] == base["max_output_tokens_per_s"] > 0


def test_stage_peaks_do_not_depend_on_the_timeseries_sampling():
    """Per-stage results (views over a window of the run) take their peak from their window
    of ``token_steps``: a 10-s timeseries gives every stage the peak of every-step rows."""
    from servesim.simulator import runner
    from servesim.simulator.config import load_config

    stages = "[{rate: 8, duration_s: 5}, {concurrency: 3, num_requests: 30, gap_s: 2}]"
    over = ["workload.num_prompts=50", f"workload.stages={stages}",
            "workload.warmup={num_requests: 2}"]
    peaks = []
    for extra in ([], ["output.timeseries_interval_s=10"]):
        b = compute_bench_result(runner.run_experiment(load_config(None, over + extra)),
                                 date=DATE)
        peaks.append([b["max_output_tokens_per_s"]]
                     + [s["max_output_tokens_per_s"] for s in b["stages"]])
    assert peaks[0] == peaks[1] and len(peaks[0]) == 3 and min(peaks[0]) > 0


def test_peak_output_buckets_follow_the_steps_not_the_span(make_result):
    """Seconds with no step cost nothing: the last step moved a billion seconds on is one
    more bucket, not a billion-entry array. Buckets from t0 = 0 (the first send): 4 steps
    in [0, 1) s, 5 in [1, 2) s (1.0, 1.1, 1.4, 1.5, 1.7), 1 at 1e9 s: the peak is 5."""
    r = make_result()
    t = r.steps["time_s"].copy()
    t[-1] = 1e9
    r.steps["time_s"] = t
    b = compute_bench_result(r, date=DATE)
    assert b["max_output_tokens_per_s"] == 5.0
