"""Every shipped experiment config validates (resolves, fits in memory) and runs."""

from pathlib import Path

import pytest
from servesim.costmodels import plan_memory
from servesim.simulator.config import load_config, resolve_config
from servesim.simulator.runner import run_experiment

CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml")
                 if p.name != "prices.yaml")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_validates_and_runs(path):
    kind = (load_config(path).workload.kind)
    small = "workload.num_sessions=10" if kind == "sessions" else "workload.num_prompts=40"
    cfg = resolve_config(load_config(path, [small]))
    assert plan_memory(cfg).num_gpu_blocks > 0
    r = run_experiment(cfg, resolved=True)
    assert (r.requests["finished_reason"] != "rejected").all()
