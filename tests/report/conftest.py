"""Hand-made run, sweep and plan folders (no simulator needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest


def make_run_dir(d: Path, n: int = 200, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    arrival = np.sort(rng.uniform(0, 20, n))
    ttft = rng.lognormal(np.log(0.15), 0.6, n)
    tpot = rng.normal(0.035, 0.005, n)
    out = rng.integers(50, 200, n)
    e2el = ttft + tpot * (out - 1)
    req = pd.DataFrame({
        "request_id": [f"r{i}" for i in range(n)], "arrival_s": arrival,
        "prompt_len": rng.integers(500, 1500, n), "output_len": out,
        "num_cached_tokens": 0, "first_scheduled_s": arrival + 0.01,
        "first_token_s": arrival + ttft, "finish_s": arrival + e2el, "ttft_s": ttft,
        "tpot_s": tpot, "e2el_s": e2el, "queue_s": 0.01, "num_preemptions": 0,
        "finished_reason": "length"})
    req.to_csv(d / "requests.csv", index=False)
    t = np.linspace(0, 25, 500)
    ts = pd.DataFrame({"time_s": t, "step_seconds": 0.03 + 0.01 * rng.random(500),
                       "step_tokens": rng.integers(20, 2048, 500),
                       "vllm:num_requests_running": rng.integers(0, 60, 500),
                       "vllm:num_requests_waiting": rng.integers(0, 5, 500),
                       "vllm:kv_cache_usage_perc": np.clip(t / 30, 0, 1),
                       "num_prefill_tokens": rng.integers(0, 1024, 500)})
    ts.to_csv(d / "timeseries.csv", index=False)
    res = {"date": "20261121-220000", "backend": "vllm", "model_id": "llama-3.1-8b",
           "num_prompts": n, "request_rate": 10.0, "duration": 25.0, "completed": n,
           "failed": 0, "request_throughput": n / 25, "request_goodput": n / 25 * 0.97,
           "output_throughput": out.sum() / 25, "total_token_throughput": 9000.0,
           "mean_ttft_ms": ttft.mean() * 1e3, "median_ttft_ms": np.median(ttft) * 1e3,
           "p99_ttft_ms": np.percentile(ttft, 99) * 1e3, "mean_tpot_ms": tpot.mean() * 1e3,
           "median_tpot_ms": np.median(tpot) * 1e3, "p99_tpot_ms": np.percentile(tpot, 99) * 1e3,
           "mean_e2el_ms": e2el.mean() * 1e3, "median_e2el_ms": np.median(e2el) * 1e3,
           "p99_e2el_ms": np.percentile(e2el, 99) * 1e3, "simulated": True}
    (d / "result.json").write_text(json.dumps(res))
    (d / "config.resolved.yaml").write_text("slo:\n  ttft_ms: 2000\n  tpot_ms: 50\n")
    return d


def make_sweep_dir(d: Path) -> Path:
    """2 arms x 2 rates x 4 seeds; arm 'sarathi' has 10% lower P99 TTFT (paired)."""
    exp = d / "ab"
    for arm, f in (("fcfs", 1.0), ("sarathi", 0.9)):
        for rate in (4, 8):
            for seed in range(4):
                noise = 1 + 0.05 * np.random.default_rng(seed * 10 + rate).standard_normal()
                p = exp / f"SERVE-{arm}-BENCH-{rate}" / f"run={seed}.json"
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(json.dumps({
                    "request_rate": rate, "arm": arm, "seed": seed, "run_number": seed,
                    "p50_ttft_ms": 100 * rate * noise * f, "p99_ttft_ms": 300 * rate * noise * f,
                    "median_ttft_ms": 100 * rate * noise * f,
                    "p99_tpot_ms": 40 * noise, "median_tpot_ms": 30 * noise,
                    "p99_e2el_ms": 5000 * noise, "median_e2el_ms": 4000 * noise,
                    "output_throughput": 128 * rate * 0.98, "request_throughput": rate * 0.98,
                    "request_goodput": rate * 0.9 / f, "max_concurrent_requests": 20 * rate,
                    "tensor_parallel_size": 1, "simulated": True}))
    return d


@pytest.fixture
def run_dir(tmp_path):
    return make_run_dir(tmp_path / "run")


@pytest.fixture
def sweep_dir(tmp_path):
    return make_sweep_dir(tmp_path / "sweep")


@pytest.fixture
def plan_dir(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from plan.synthetic import synthetic_eval, synthetic_fit
    from servesim.simulator.plan import PlanSpec
    from servesim.simulator.plan.runner import run_plan

    spec = PlanSpec.model_validate({
        "name": "t", "workload": {"kind": "random", "num_prompts": 100},
        "slo": {"ttft_ms": 1000, "tpot_ms": 45}, "target_request_rate": 30,
        "search": {"hardware": ["a100-sxm4-80gb", "h100-sxm", "l40s"],
                "tensor_parallel_size": [1, 2]},
        "seeds": [0, 1], "tolerance": {"first_guess_rps": 2.0}})
    out = tmp_path / "plan"
    run_plan(spec, tmp_path, out, evaluate=synthetic_eval, fit_check=synthetic_fit, quiet=True)
    return out
