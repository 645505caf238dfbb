"""``simulate estimate``: table and JSON output."""

from __future__ import annotations

import json

from cmutil import REPO
from servesim.simulator.cli import app
from typer.testing import CliRunner

CONFIG = str(REPO / "configs" / "llama8b_a100.yaml")
runner = CliRunner()


def test_estimate_acceptance_table():
    r = runner.invoke(app, ["estimate", CONFIG, "--batch-size", "1", "--context", "1024"])
    assert r.exit_code == 0, r.output
    out = r.output
    for name in ("qkv_proj", "attn", "o_proj", "gate_up_proj", "down_proj", "lm_head",
                 "sampler", "host", "total", "provenance"):
        assert name in out
    # every op row ends with its provenance
    rows = [ln for ln in out.splitlines() if ln.startswith("│") and "total" not in ln]
    assert rows and all("default" in ln or "spec-sheet" in ln or "calibration:" in ln or
                        "roofline:nearest/" in ln for ln in rows)
    assert "aiconfigurator-core 0.12.0, measured by NVIDIA" in out  # the shipped A100 file


def test_estimate_json_total_between_8_and_14_ms():
    r = runner.invoke(app, ["estimate", CONFIG, "--batch-size", "1", "--context", "1024",
                            "--json"])
    assert r.exit_code == 0, r.output
    start = r.output.index("{")
    data = json.loads(r.output[start:])
    assert 8e-3 <= data["step_seconds"] <= 14e-3
    assert {"name", "count", "seconds", "flops", "bytes", "bound", "provenance"} <= set(
        data["ops"][0])
    assert abs(sum(o["seconds"] for o in data["ops"]) - data["step_seconds"]) < 1e-12
    assert all(o["provenance"] for o in data["ops"])


def test_estimate_with_prefill_and_overrides():
    r = runner.invoke(app, ["estimate", CONFIG, "--batch-size", "4", "--context", "512",
                            "--prefill-tokens", "256", "--prefill-context", "128",
                            "--set", "parallel.tensor_parallel_size=2", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output[r.output.index("{"):])
    assert data["cudagraph"] == "PIECEWISE" and data["padded_batch"] == 272  # 260 → 272
    assert any(o["name"] == "all_reduce" for o in data["ops"])
