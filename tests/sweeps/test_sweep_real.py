"""Sweeps on the real simulator: local processes, interruption + resume, Ray, A/A and a planted
difference. One small prefill-heavy sweep (3 arms × 2 rates × 3 seeds, 40 prompts each) is run
once uninterrupted and reused as the reference."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from servesim.reports.ab import NO_DIFF
from servesim.simulator.errors import ServesimError
from servesim.simulator.sweep import load_spec, run_sweep

SPEC = {
    "base": {
        "model": {"name": "llama-3.1-8b", "max_model_len": 4096},
        "hardware": {"name": "a100-sxm4-80gb"},
        "scheduler": {"max_num_seqs": 32},
        "workload": {"kind": "random", "num_prompts": 40, "input_len": 1024, "output_len": 8,
                     "range_ratio": 0.2},
    },
    "experiment_name": "real",
    "arms": {
        "big": {"scheduler.max_num_batched_tokens": 2048},
        "big_again": {"scheduler.max_num_batched_tokens": 2048},  # A/A
        "small": {"scheduler.max_num_batched_tokens": 64},  # planted: 16x smaller budget
    },
    "request_rates": [4, 16],
    "seeds": [0, 1, 2],
}
N_POINTS = 3 * 2 * 3


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("spec") / "real.yaml"
    p.write_text(yaml.safe_dump(SPEC, sort_keys=False))
    return p


@pytest.fixture(scope="module")
def reference(spec_file, tmp_path_factory):
    """The uninterrupted local sweep with 2 worker processes."""
    out = tmp_path_factory.mktemp("ref")
    res = run_sweep(load_spec(spec_file), out, jobs=2)
    return res


def test_local_sweep_layout(reference):
    exp = reference.exp_dir
    assert reference.num_run == N_POINTS and reference.num_failed == 0
    dirs = sorted(p.name for p in exp.glob("SERVE-*"))
    assert dirs == ["SERVE-big-BENCH-16", "SERVE-big-BENCH-4", "SERVE-big_again-BENCH-16",
                    "SERVE-big_again-BENCH-4", "SERVE-small-BENCH-16", "SERVE-small-BENCH-4"]
    run = json.loads((exp / "SERVE-small-BENCH-4" / "run=2.json").read_text())
    assert run["run_number"] == 2 and run["seed"] == 2 and run["request_rate"] == 4.0
    assert run["scheduler.max_num_batched_tokens"] == 64 and run["completed"] == 40
    assert "mean_ttft_ms" in run and "p99_itl_ms" in run and run["simulated"] is True
    summ = json.loads((exp / "SERVE-small-BENCH-4" / "summary.json").read_text())
    assert [r["run_number"] for r in summ] == [0, 1, 2]
    assert len((exp / "summary.csv").read_text().splitlines()) == 1 + N_POINTS
    assert (exp / "ab.csv").is_file()


def test_common_random_numbers(reference):
    """Arms of one seed replay the same requests: identical prompt token totals."""
    by = {(r["arm"], r["request_rate"], r["seed"]): r for r in reference.rows}
    for rate in (4.0, 16.0):
        for s in (0, 1, 2):
            tot = {by[(a, rate, s)]["total_input_tokens"] for a in ("big", "big_again", "small")}
            assert len(tot) == 1
    assert len({by[("big", 4.0, s)]["total_input_tokens"] for s in (0, 1, 2)}) == 3


def test_aa_no_difference_and_planted_difference_detected(reference):
    ab = reference.ab_rows
    aa = [r for r in ab if r["arm_b"] == "big_again"]
    assert aa and {r["verdict"] for r in aa} == {NO_DIFF}
    planted = {(r["request_rate"], r["metric"]): r for r in ab if r["arm_b"] == "small"}
    for rate in (4.0, 16.0):
        r = planted[(rate, "mean_e2el_ms")]  # 16 prefill steps per prompt instead of 1
        assert r["verdict"] == "B worse" and r["ci_low"] > 0 and r["n"] == 3
    r = planted[(16.0, "output_throughput")]
    assert r["verdict"] == "B worse" and r["ci_high"] < 0


def test_interrupted_sweep_resumes_to_identical_summary(spec_file, reference, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", "from servesim.simulator.cli import main; main()",
           "sweep", str(spec_file), "-o", str(out), "--jobs", "1", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    exp = out / "real"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list(exp.glob("SERVE-*/run=*.json"))) >= 3:
            os.kill(proc.pid, signal.SIGKILL)  # interrupt mid-sweep, without clean-up
            break
        time.sleep(0.01)
    proc.wait(timeout=30)
    done = len(list(exp.glob("SERVE-*/run=*.json")))
    assert proc.returncode == -signal.SIGKILL, "the sweep finished before it could be killed"
    assert 3 <= done < N_POINTS
    assert not (exp / "summary.csv").exists()
    res = run_sweep(load_spec(spec_file), out, jobs=2, resume=True)
    assert res.num_skipped == done and res.num_run == N_POINTS - done
    assert (exp / "summary.csv").read_bytes() == (reference.exp_dir / "summary.csv").read_bytes()
    assert (exp / "ab.csv").read_bytes() == (reference.exp_dir / "ab.csv").read_bytes()


def test_ray_backend_gives_identical_summary(spec_file, reference, tmp_path, monkeypatch):
    """``--backend ray`` starts a local Ray (num_cpus = jobs), runs the same points as Ray
    tasks and shuts Ray down: the summary is byte-identical to the local one."""
    ray = pytest.importorskip("ray", reason="ray is not installed")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        res = run_sweep(load_spec(spec_file), tmp_path, jobs=2, backend="ray")
    except ServesimError as e:
        if "cannot start/connect to Ray" in str(e):
            pytest.skip(f"local Ray cannot start in this sandbox: {e}")
        raise
    assert not ray.is_initialized()  # the sweep shut down the Ray it started
    assert res.num_run == N_POINTS and res.num_failed == 0
    assert (res.exp_dir / "summary.csv").read_bytes() == \
        (reference.exp_dir / "summary.csv").read_bytes()
