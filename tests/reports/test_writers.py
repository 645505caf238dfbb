"""The run directory: files, CSV columns, atomicity, byte-for-byte determinism."""

from __future__ import annotations

import csv
import json
import math
import sys

import numpy as np
import pandas as pd
import pytest
import yaml
from servesim.reports import VLLM_BENCH_KEYS, write_run
from servesim.reports.writers import (
    OutputDir,
    RequestsCsvStream,
    atomic_write_text,
    dumps_result,
)
from servesim.simulator.metrics import REQUEST_COLUMNS, STEP_COLUMNS

FILES = ["config.resolved.yaml", "requests.csv", "result.json", "run_info.json",
         "timeseries.csv"]  # fmt: skip


def _reject_constant(name):
    raise ValueError(f"non-JSON constant {name}")


def load_json(path):
    return json.loads(path.read_text(), parse_constant=_reject_constant)


def test_write_run_files(make_result, tmp_path):
    bench = write_run(make_result(), tmp_path / "run", date="20260101-000000")
    out = tmp_path / "run"
    assert sorted(p.name for p in out.iterdir()) == FILES  # no temp files left behind
    res = load_json(out / "result.json")
    # vLLM keys first, in order; host timings only in run_info.json
    assert list(res)[: len(VLLM_BENCH_KEYS)] == VLLM_BENCH_KEYS
    assert "wall_seconds" not in res and "sim_speed" not in res
    assert res == {k: v for k, v in bench.items() if k not in ("wall_seconds", "sim_speed")}
    info = load_json(out / "run_info.json")
    assert info["date"] == "20260101-000000"
    assert info["wall_seconds"] == 0.05 and info["sim_speed"] == pytest.approx(50.0)
    cfg = yaml.safe_load((out / "config.resolved.yaml").read_text())
    assert cfg["model"]["name"] == "llama-3.1-8b"


def test_result_json_has_no_nan(make_result, tmp_path):
    write_run(make_result(output__save_detailed="true"), tmp_path)
    text = (tmp_path / "result.json").read_text()
    load_json(tmp_path / "result.json")
    assert "NaN" not in text and "Infinity" not in text


def test_dumps_result_refuses_nan():
    with pytest.raises(ValueError):
        dumps_result({"x": math.nan})
    assert json.loads(dumps_result({"a": [1, 2.5], "b": None})) == {"a": [1, 2.5], "b": None}


def test_deterministic_except_date(make_result, tmp_path):
    write_run(make_result(), tmp_path / "a", date="20260101-000000")
    r = make_result()
    r.counters["wall_seconds"] = 7.0  # another host, another speed
    write_run(r, tmp_path / "b", date="20270202-111111")
    write_run(make_result(), tmp_path / "c", date="20260101-000000")
    for name in FILES:
        a, b, c = ((tmp_path / d / name).read_bytes() for d in "abc")
        assert a == c, name  # same RunResult, same date: identical bytes
        if name == "result.json":
            la, lb = a.splitlines(), b.splitlines()
            diff = [(x, y) for x, y in zip(la, lb) if x != y]
            assert len(la) == len(lb) and diff == [
                (b'  "date": "20260101-000000",', b'  "date": "20270202-111111",')
            ]
        elif name != "run_info.json":
            assert a == b, name


def test_requests_csv_columns_and_values(make_result, tmp_path):
    r = make_result()
    write_run(r, tmp_path)
    with open(tmp_path / "requests.csv", newline="") as f:
        header = next(csv.reader(f))
    # the contract's columns in order, then the extra ones (send_s) in RunResult order
    assert header == list(REQUEST_COLUMNS) + ["send_s"]
    df = pd.read_csv(tmp_path / "requests.csv")
    assert len(df) == 5
    for c in ("arrival_s", "ttft_s", "e2el_s", "finish_s"):
        np.testing.assert_array_equal(df[c].to_numpy(), r.requests[c])  # repr round-trips
    assert df["finished_reason"].tolist() == ["length", "stop", "length", "stop", "rejected"]
    assert df["prompt_len"].dtype.kind == "i"
    row4 = (tmp_path / "requests.csv").read_text().splitlines()[5]
    assert row4.startswith("r4,1.2,5000,0,0,,,,,,,,0,rejected")  # NaN → empty cell


def test_timeseries_csv_columns(make_result, tmp_path):
    r = make_result()
    write_run(r, tmp_path)
    df = pd.read_csv(tmp_path / "timeseries.csv")
    assert list(df.columns) == list(STEP_COLUMNS)
    assert len(df) == 10
    np.testing.assert_array_equal(
        df["vllm:kv_cache_usage_perc"].to_numpy(), r.steps["vllm:kv_cache_usage_perc"]
    )


def test_empty_steps_still_get_a_header(make_result, tmp_path):
    r = make_result()
    r.steps = {}
    write_run(r, tmp_path)
    assert (tmp_path / "timeseries.csv").read_text() == ",".join(STEP_COLUMNS) + "\n"


def test_missing_request_column_is_an_error(make_result, tmp_path):
    r = make_result()
    del r.requests["queue_s"]
    with pytest.raises(ValueError, match="queue_s"):
        write_run(r, tmp_path)


def test_atomic_write_replaces_whole_file(tmp_path):
    p = tmp_path / "x.txt"
    atomic_write_text(p, "old\n")
    atomic_write_text(p, "new\n")
    assert p.read_text() == "new\n"
    assert [q.name for q in tmp_path.iterdir()] == ["x.txt"]
    assert (p.stat().st_mode & 0o777) == 0o644


# -- requests.csv written during the simulation (forked worker) ---------------------------------

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork-based stream")
@pytest.mark.parametrize("overrides", [
    # FCFS at saturation (rows end nearly in index order), priority with preemptions (far out
    # of order), sessions (follow-ups sent late) and refusals (messages with commas: quoted)
    ["workload.num_prompts=300", "workload.request_rate=inf"],
    ["workload.num_prompts=300", "scheduler.policy=priority",
     "cache.num_gpu_blocks_override=300", "model.max_model_len=4800", "workload.request_rate=30"],
    ["workload.kind=sessions", "workload.num_sessions=20", "workload.turns=3",
     "workload.session_rate=2"],
    ["workload.num_prompts=200", "model.max_model_len=1100", "workload.request_rate=50"],
    # step rows sampled into 1-s intervals (the worker's pre-formatted rows)
    ["workload.num_prompts=200", "output.timeseries_interval_s=1"],
    # the client's columns (stages, warm-up, timeouts with retries); no API-server frontend;
    # extra timeseries columns (speculative decoding counters, quoted names)
    ["workload.num_prompts=200", ("workload.stages=[{rate: 20, num_requests: 80}, "
     "{concurrency: 16, duration_s: 4, grace_s: 1}]"), "workload.warmup={num_requests: 4}",
     "client.request_timeout_s=3", "client.max_retries=1"],
    ["workload.num_prompts=200", "frontend.enable=false"],
    ["workload.num_prompts=150", "model.name=llama-3.1-8b", "hardware.name=h100-sxm",
     "speculative_config={method: eagle3, num_speculative_tokens: 3, acceptance: {rate: 0.6}}"],
])
def test_streamed_requests_csv_is_byte_identical(tmp_path, monkeypatch, overrides):
    from servesim.simulator.config import load_config, resolve_config
    from servesim.simulator.recorder import Recorder
    from servesim.simulator.runner import run_experiment

    monkeypatch.setattr(Recorder, "SINK_ROWS", 7)  # many small batches
    cfg = resolve_config(load_config(None, overrides))
    plain = write_run(run_experiment(cfg, resolved=True), tmp_path / "plain")
    out = OutputDir(tmp_path / "streamed")
    stream = RequestsCsvStream.start(out.file("requests.csv"), cfg.output.timeseries_interval_s)
    assert stream is not None
    streamed = write_run(run_experiment(cfg, resolved=True, request_sink=stream), out,
                         requests_stream=stream)
    assert stream.ok
    for name in ("requests.csv", "timeseries.csv"):  # (timeseries: the worker, meanwhile)
        assert (tmp_path / "streamed" / name).read_bytes() == \
            (tmp_path / "plain" / name).read_bytes()
    assert streamed["completed"] == plain["completed"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork-based stream")
def test_failed_stream_falls_back_to_writing_after(tmp_path):
    from servesim.simulator.config import load_config, resolve_config
    from servesim.simulator.runner import run_experiment

    cfg = resolve_config(load_config(None, ["workload.num_prompts=50"]))
    plain = tmp_path / "plain"
    write_run(run_experiment(cfg, resolved=True), plain)
    out = OutputDir(tmp_path / "streamed")
    stream = RequestsCsvStream.start(out.file("requests.csv"))
    stream.close()  # the worker is gone before the run: rows are dropped, write_run writes
    write_run(run_experiment(cfg, resolved=True, request_sink=stream), out,
              requests_stream=stream)
    for name in ("requests.csv", "timeseries.csv"):
        assert (tmp_path / "streamed" / name).read_bytes() == (plain / name).read_bytes()


@pytest.mark.parametrize(("interval", "max_rows"), [(None, None), (1.0, None), (0.25, None),
                                                    (None, 1000)])
def test_worker_step_rows_preformatted(tmp_path, monkeypatch, interval, max_rows):
    """The stream worker's own StepSampler, fed the same chunks, formats the rows ahead and
    writes timeseries.csv from them (not falling back to formatting the run's columns);
    ``max_rows``: raw rows give way to 1-s intervals past that many steps."""
    from servesim.reports import writers
    from servesim.simulator import runner
    from servesim.simulator.recorder import Recorder
    from servesim.simulator.runner import StepSampler

    if max_rows:
        monkeypatch.setattr(runner, "MAX_STEP_ROWS", max_rows)

    rng = np.random.default_rng(0)
    n = 3000
    raw = {k: rng.random(n) for k in Recorder.STEP}
    raw["time_s"] = np.cumsum(rng.random(n) * 0.01)
    ref = StepSampler(interval)
    rows = writers._StepRows(interval)
    for lo in range(0, n, 700):
        chunk = {k: v[lo:lo + 700].copy() for k, v in raw.items()}
        ref.add({k: v.copy() for k, v in chunk.items()})
        rows.add(chunk)
    steps = ref.columns()
    plain = tmp_path / "plain.csv"
    writers._write_timeseries(plain, steps)

    def no_fallback(*a, **k):
        raise AssertionError("fell back")

    monkeypatch.setattr(writers, "_write_timeseries", no_fallback)
    out = tmp_path / "pre.csv"
    rows.write(str(out), steps)
    assert out.read_bytes() == plain.read_bytes()
    assert (rows.sampler.interval is None) == (interval is None and not max_rows)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork-based stream")
def test_cluster_run_does_not_use_the_stream(tmp_path):
    """Cluster runs do not feed the stream (no meta message): the worker's file is not used and
    write_run writes requests.csv itself."""
    from servesim.simulator.config import load_config, resolve_config
    from servesim.simulator.runner import run_experiment

    cfg = resolve_config(load_config(None, [
        "workload.num_prompts=60", "cache.kv_offload={cpu_bytes: 1GiB}"]))
    plain = tmp_path / "plain"
    write_run(run_experiment(cfg, resolved=True), plain)
    out = OutputDir(tmp_path / "streamed")
    stream = RequestsCsvStream.start(out.file("requests.csv"))
    write_run(run_experiment(cfg, resolved=True, request_sink=stream), out,
              requests_stream=stream)
    assert not stream.ok
    for name in ("requests.csv", "timeseries.csv"):
        assert (tmp_path / "streamed" / name).read_bytes() == (plain / name).read_bytes()
