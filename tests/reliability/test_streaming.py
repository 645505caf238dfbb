"""Bounded memory: per-request rows stream to disk in chunks and metrics come from streaming
estimators (defect 12). The streamed path is checked against the in-memory one on the same
run, with the size thresholds lowered so a 3,000-request run crosses all of them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from servesim.reports import write_run
from servesim.simulator import metrics, runner
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.metrics import Distribution, RequestLog
from servesim.simulator.runner import run_experiment

from .conftest import CONFIG

N = 3000
DATE = "20260101-000000"


def _cfg(*extra):
    return resolve_config(load_config(CONFIG, [f"workload.num_prompts={N}",
                                               "workload.request_rate=40", *extra]))


@pytest.fixture(scope="module")
def exact_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("exact") / "run"
    res = run_experiment(_cfg(), resolved=True)
    assert not res.streamed and res.itl_stream is None
    write_run(res, out, date=DATE)
    return res, out


def _streamed(monkeypatch, tmp_path, *extra):
    monkeypatch.setattr(metrics, "CHUNK_ROWS", 256)
    monkeypatch.setattr(metrics, "EXACT_REQUESTS", 700)
    monkeypatch.setattr(metrics, "EXACT_SAMPLES", 900)
    monkeypatch.setattr(runner, "MAX_STEP_ROWS", 10**9)
    spool = tmp_path / "spool"
    res = run_experiment(_cfg(*extra), resolved=True, spool_dir=str(spool))
    return res, spool


def test_streamed_run_writes_the_same_files(exact_run, monkeypatch, tmp_path):
    _, out_e = exact_run
    res_s, spool = _streamed(monkeypatch, tmp_path)
    assert res_s.streamed and res_s.itl_stream is not None
    assert res_s.request_log._mem == []  # every chunk is on disk, none held in memory
    assert len(list(spool.iterdir())) == 1 and any(next(spool.iterdir()).iterdir())
    out_s = tmp_path / "run"
    write_run(res_s, out_s, date=DATE)
    for name in ("requests.csv", "timeseries.csv", "config.resolved.yaml"):
        assert (out_s / name).read_bytes() == (out_e / name).read_bytes(), name
    e = json.loads((out_e / "result.json").read_text())
    s = json.loads((out_s / "result.json").read_text())
    approx = s.pop("approximate_percentiles")
    assert approx["method"] == "ddsketch" and set(approx["metrics"]) == {"ttft", "tpot", "itl",
                                                                          "e2el"}
    alpha = approx["relative_accuracy"]
    assert list(s) == list(e)  # same keys, same order (the flag comes after vLLM's keys)
    for k, v in e.items():
        if k.startswith(("median_", "p99_")):
            # DDSketch: within alpha of the rank-floor(q(n-1)) value; np.percentile
            # interpolates to the next value, which is within 2·alpha here
            assert math.isclose(s[k], v, rel_tol=2 * alpha + 1e-3), k
        elif k.startswith(("mean_", "std_")):
            assert math.isclose(s[k], v, rel_tol=1e-9), k
        else:
            assert s[k] == v, k  # counts, totals, throughputs, per-request lists: exact
    res_s.close()
    assert not any(spool.iterdir())  # spool files removed


def test_streamed_requests_mapping_matches(exact_run, monkeypatch, tmp_path):
    res_e, _ = exact_run
    res_s, _ = _streamed(monkeypatch, tmp_path)
    for col in ("ttft_s", "finish_s", "request_id", "finished_reason", "send_s"):
        a, b = np.asarray(res_e.requests[col]), np.asarray(res_s.requests[col])
        if a.dtype.kind == "f":
            np.testing.assert_array_equal(a, b)
        else:
            assert a.tolist() == b.tolist()
    assert res_s.duration_s == res_e.duration_s
    res_s.close()


def test_sampled_timeseries_streams_across_chunks(monkeypatch, tmp_path):
    """An interval-sampled timeseries built chunk by chunk equals the one-shot sampling."""
    cfg_args = ("output.timeseries_interval_s=0.7",)
    ref = run_experiment(_cfg(*cfg_args), resolved=True).steps
    res, _ = _streamed(monkeypatch, tmp_path, *cfg_args)
    for k, v in ref.items():
        np.testing.assert_allclose(res.steps[k], v, rtol=1e-12, err_msg=k)
    res.close()


def test_request_log_reassembles_index_order(tmp_path):
    """Chunks arrive in end order; windows come back in index order, whatever the window."""
    rng = np.random.default_rng(0)
    n = 1000
    order = np.argsort(np.arange(n) + rng.normal(0, 60, n))  # nearly sorted, stragglers
    log = RequestLog(tmp_path, spill_rows=300)
    for lo in range(0, n, 128):
        idx = order[lo:lo + 128].astype(float)
        chunk = {f: idx * 1.5 for f in metrics.RAW_FIELDS}
        chunk["index"] = idx
        chunk["request_id"] = np.array([f"r{int(i)}" for i in idx], dtype=object)
        chunk["finished_reason"] = np.array(["stop"] * len(idx), dtype=object)
        chunk["error"] = np.array([""] * len(idx), dtype=object)
        log.append(chunk)
    assert log.spilled
    for rows in (1, 77, 1000):
        got = np.concatenate([w["index"] for w in log.windows(rows)])
        np.testing.assert_array_equal(got, np.arange(n))
    ids = np.concatenate([w["request_id"] for w in log.windows(100)])
    assert ids[:3].tolist() == ["r0", "r1", "r2"]
    assert log.max_finish == 1.5 * (n - 1)
    log.close()


def test_distribution_sketch_accuracy():
    """Past the exact limit: exact count/mean/std, percentiles within the relative accuracy
    of the rank value (a lognormal sample, weighted and unweighted halves)."""
    rng = np.random.default_rng(1)
    x = rng.lognormal(-3, 1, 50_000)
    w = rng.integers(1, 5, 50_000)
    d = Distribution(exact_limit=1000)
    d.add(x[:25_000])
    d.add(x[25_000:], w[25_000:])
    assert not d.exact
    full = np.concatenate([x[:25_000], np.repeat(x[25_000:], w[25_000:])])
    assert d.count == len(full)
    assert math.isclose(d.mean, full.mean(), rel_tol=1e-12)
    assert math.isclose(d.std(), full.std(), rel_tol=1e-9)
    s = np.sort(full)
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        exact = s[math.floor(q * (len(s) - 1))]
        assert abs(d.quantile(q) - exact) <= d.relative_accuracy * exact * (1 + 1e-9), q


def test_streamed_run_through_the_cli(monkeypatch, tmp_path):
    """``simulate run --json`` on a spilled run: the folder and the printed JSON are complete,
    the per-request lists are streamed, and the spool beside the folder is gone."""
    from .cli_harness import cli, no_partial_output

    monkeypatch.setattr(metrics, "CHUNK_ROWS", 256)
    monkeypatch.setattr(metrics, "EXACT_REQUESTS", 500)
    monkeypatch.setattr(metrics, "EXACT_SAMPLES", 600)
    o = cli("run", CONFIG, "--set", "workload.num_prompts=1500", "--set",
            "workload.request_rate=60", "-o", tmp_path / "run", "--json")
    assert o.rc == 0, o.err
    printed = json.loads(o.out)
    written = json.loads((tmp_path / "run" / "result.json").read_text())
    assert len(printed["latencies"]) == len(written["latencies"]) == 1500
    assert printed["latencies"] == written["latencies"]
    assert written["approximate_percentiles"]["method"] == "ddsketch"
    no_partial_output(tmp_path, "run")
