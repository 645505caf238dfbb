"""One small capacity plan on the real simulator, through the CLI (a few seconds)."""

from __future__ import annotations

import json

import pandas as pd
import yaml
from typer.testing import CliRunner

PLAN = {
    "name": "tiny",
    "base": {"model": {"name": "llama-3.1-8b", "max_model_len": 4096}},
    "workload": {"kind": "random", "num_prompts": 60, "input_len": 256, "output_len": 32,
                 "range_ratio": 0.25},
    "slo": {"ttft_ms": 400, "tpot_ms": 40},
    "target_request_rate": 20,
    "search": {"hardware": ["h100-sxm"], "model.name": ["llama-3.1-8b", "llama-3.1-70b"]},
    "seeds": [0],
    "tolerance": {"rel_width": 0.25, "max_evals": 6},
    "confirm": False,
    "min_duration_s": 20,
}


def test_tiny_plan_on_the_real_simulator(tmp_path):
    from servesim.simulator.cli import app

    plan = tmp_path / "tiny.yaml"
    plan.write_text(yaml.safe_dump(PLAN))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["plan", str(plan), "-o", str(out), "--jobs", "1", "--quiet"])
    assert res.exit_code == 0, res.output
    df = pd.read_csv(out / "plan.csv")
    fit = df[df["fits"]]
    skipped = df[~df["fits"]]
    assert len(fit) == 1 and len(skipped) == 1
    assert skipped["candidate"].iloc[0] == "h100-sxm_llama-3.1-70b"
    assert "CapacityError" in skipped["reason"].iloc[0]  # 70B bf16 weights > one 80 GB GPU
    row = fit.iloc[0]
    assert row["capacity_rps"] > 0 and row["replicas"] >= 1
    assert row["gpus"] == row["replicas"]
    runs = sorted((out / "points").glob("SERVE-h100-sxm_llama-3.1-8b-BENCH-*/run=0.json"))
    assert len(runs) == row["n_evals"]
    j = json.loads(runs[0].read_text())
    assert "p99_ttft_ms" in j and j["plan_point"]["request_rate"] == j["request_rate"]
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    # the points folder is a sweep folder too (arm = candidate)
    assert len(pd.read_csv(out / "points" / "summary.csv")) == len(runs)
    res = CliRunner().invoke(app, ["report", str(out / "points")])
    assert res.exit_code == 0, res.output
    assert "Recommended" in (out / "report.md").read_text().split("\n\n")[1]
