"""simulate report / compare through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

FIX = Path(__file__).parent / "fixtures"


def test_report_and_compare_commands(run_dir, tmp_path):
    from servesim.simulator.cli import app

    r = CliRunner().invoke(app, ["report", str(run_dir)])
    assert r.exit_code == 0, r.output
    assert (run_dir / "report.html").is_file()
    meas = json.loads((FIX / "vllm_bench_measured.json").read_text())
    sim = tmp_path / "sim.json"
    sim.write_text(json.dumps({"simulated": True, "request_rate": 12.0,
                               "mean_ttft_ms": meas["mean_ttft_ms"] * 0.9}))
    out = tmp_path / "cmp.csv"
    r = CliRunner().invoke(app, ["compare", str(sim), str(FIX / "vllm_bench_measured.json"),
                                 "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "mean_ttft_ms" in r.output and "-10.0" in r.output
    assert "missing" in r.output
    assert out.read_text().count("\n") == 16
