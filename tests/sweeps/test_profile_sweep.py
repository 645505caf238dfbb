"""profile_sweep: GuideLLM's sweep (synchronous, throughput, then the rates between)."""

from __future__ import annotations

import pytest
from servesim.simulator.errors import ConfigError
from servesim.simulator.sweep import build_tree, parse_spec, run_sweep


def thr_point(base_tree: dict, overrides: list, seed: int, rate) -> dict:
    """Request throughput: 2/s one at a time, 20/s flat out, the offered rate otherwise."""
    w = build_tree(base_tree, overrides, seed, rate)["workload"]
    if rate is None:
        thr = 2.0 if w.get("max_concurrency") == 1 else 20.0
    else:
        thr = float(rate)
    return {"request_rate": "inf" if rate is None else rate, "request_throughput": thr,
            "max_concurrency": w.get("max_concurrency"), "burstiness": w.get("burstiness"),
            "mean_ttft_ms": 10.0, "completed": 10}


def test_profile_sweep_runs_sync_throughput_then_rates_between(tmp_path):
    spec = parse_spec({"base": {"workload": {"kind": "random", "num_prompts": 20}},
                       "experiment_name": "gsweep", "seeds": [0, 1],
                       "profile_sweep": {"sweep_size": 5, "max_concurrency": 64}},
                      check_configs=False)
    out = run_sweep(spec, tmp_path, point_fn=thr_point, jobs=1)
    assert out.num_failed == 0 and out.num_run == 2 * 2 + 3 * 2
    # linspace(2, 20, 4)[1:] = 8, 14, 20
    assert spec.profile_rates == {"base": [8.0, 14.0, 20.0]}
    dirs = sorted(p.name for p in out.exp_dir.iterdir() if p.is_dir())
    assert dirs == ["SERVE-base-BENCH-14", "SERVE-base-BENCH-20", "SERVE-base-BENCH-8",
                    "SERVE-base-BENCH-synchronous", "SERVE-base-BENCH-throughput"]
    rows = {(r["request_rate"], r["seed"]): r for r in out.rows}
    assert rows[(8.0, 0)]["burstiness"] == "inf" and rows[(8.0, 0)]["max_concurrency"] == 64
    again = run_sweep(spec, tmp_path, point_fn=thr_point, jobs=1, resume=True)
    assert again.num_run == 0 and again.num_skipped == 10


def test_profile_sweep_spec_errors():
    base = {"workload": {"kind": "random"}}
    with pytest.raises(ConfigError, match="sweep_size: expected an integer >= 3"):
        parse_spec({"base": base, "profile_sweep": {"sweep_size": 2}}, check_configs=False)
    with pytest.raises(ConfigError, match="conflicts with request_rates"):
        parse_spec({"base": base, "profile_sweep": {}, "request_rates": [1]},
                   check_configs=False)
