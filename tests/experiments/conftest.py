"""A small sweep and a small plan on the real simulator (a few seconds each) and their
uninterrupted single-process results: the references of the interruption and Ray tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from servesim.simulator.plan import load_plan
from servesim.simulator.plan.runner import run_plan
from servesim.simulator.sweep import load_spec, run_sweep

BASE = {"model": {"name": "llama-3.1-8b", "max_model_len": 4096},
        "hardware": {"name": "a100-sxm4-80gb", "calibration": "none"}}
SWEEP = {
    "base": {**BASE, "scheduler": {"max_num_seqs": 32},
             "workload": {"kind": "random", "num_prompts": 60, "input_len": 1024,
                          "output_len": 16, "range_ratio": 0.2}},
    "experiment_name": "kill",
    "arms": {"big": {"scheduler.max_num_batched_tokens": 2048},
             "small": {"scheduler.max_num_batched_tokens": 256}},
    "request_rates": [4, 16], "seeds": [0, 1, 2],
}
PLAN = {
    "name": "kill", "base": BASE,
    "workload": {"kind": "random", "num_prompts": 60, "input_len": 256, "output_len": 32,
                 "range_ratio": 0.25},
    "slo": {"ttft_ms": 400, "tpot_ms": 40}, "target_request_rate": 30,
    "search": {"hardware": ["a100-sxm4-80gb", "h100-sxm"]}, "seeds": [0, 1],
    "tolerance": {"rel_width": 0.1, "max_evals": 5}, "min_duration_s": 6,
}


def _yaml(tmp_path_factory, tree: dict) -> Path:
    p = tmp_path_factory.mktemp("spec") / "kill.yaml"
    p.write_text(yaml.safe_dump(tree, sort_keys=False))
    return p


@pytest.fixture(scope="session")
def sweep_file(tmp_path_factory) -> Path:
    return _yaml(tmp_path_factory, SWEEP)


@pytest.fixture(scope="session")
def plan_file(tmp_path_factory) -> Path:
    return _yaml(tmp_path_factory, PLAN)


@pytest.fixture(scope="session")
def sweep_reference(sweep_file, tmp_path_factory) -> Path:
    """The ``-o`` folder of an uninterrupted single-process run."""
    out = tmp_path_factory.mktemp("sref")
    run_sweep(load_spec(sweep_file), out, jobs=1)
    return out


@pytest.fixture(scope="session")
def plan_reference(plan_file, tmp_path_factory) -> Path:
    """The ``-o`` folder of an uninterrupted single-process run."""
    out = tmp_path_factory.mktemp("pref")
    spec, plan_dir = load_plan(plan_file)
    run_plan(spec, plan_dir, out, jobs=1, quiet=True, write_report=False)
    return out
