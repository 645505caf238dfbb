"""report.md / report.html for run, sweep and plan folders."""

from __future__ import annotations

import re

import pytest
from servesim.reports.render import build_report, detect_kind, write_report
from servesim.simulator.errors import ServesimError


def _check(d, expected_figs):
    md, html = write_report(d)
    text = md.read_text()
    page = html.read_text()
    for name in expected_figs:
        png = d / f"fig_{name}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"](fig_{name}.png)" in text
    imgs = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert len(imgs) == len(expected_figs) and all(len(i) > 1000 for i in imgs)
    assert "<script" not in page and "http://" not in page and "https://" not in page
    # the answer paragraph comes before any figure
    first_para = text.split("\n\n")[1]
    assert text.index(first_para) < text.index("![")
    assert page.index('class="answer"') < page.index("<img")
    return text, page


def test_run_report(run_dir):
    assert detect_kind(run_dir) == "run"
    text, _ = _check(run_dir, ["latency_cdf", "kv_timeline", "step_timeline"])
    first = text.split("\n\n")[1]
    assert "req/s" in first and "TTFT P50" in first and "SLO 2000 ms: met" in first
    assert "preemptions" in first


def test_sweep_report(sweep_dir):
    assert detect_kind(sweep_dir) == "sweep"
    text, _ = _check(sweep_dir, ["latency_vs_rate", "throughput_vs_rate", "pareto",
                                 "ab_deltas"])
    first = text.split("\n\n")[1]
    assert "sarathi vs fcfs" in first and "better" in first
    assert "better on 4" in first
    row = next(ln for ln in text.splitlines() if "| p99_ttft_ms | 4 |" in ln)
    assert "| -10 |" in row and "better" in row  # the planted 10% paired improvement


def test_plan_report(plan_dir):
    assert detect_kind(plan_dir) == "plan"
    text, _ = _check(plan_dir, ["cost", "capacity", "latency_vs_rate", "throughput_vs_rate",
                                "pareto"])
    first = text.split("\n\n")[1]
    assert first.startswith("**Recommended: ")
    assert "h100-sxm" in first and "$" in first and "margin" in first
    assert "l40s_tp1" in first  # the skipped candidate and why
    rep = build_report(plan_dir)
    assert all(f.caption and f.title for f in rep.figures)


def test_not_a_results_folder(tmp_path):
    with pytest.raises(ServesimError, match="not a results folder"):
        detect_kind(tmp_path)


def test_sweep_report_from_summary_csv_uses_the_sweeps_baseline(sweep_dir):
    import json

    import pandas as pd

    exp = sweep_dir / "ab"
    rows = [json.loads(p.read_text()) for p in sorted(exp.glob("*/run=*.json"))]
    df = pd.DataFrame(rows)
    df = pd.concat([df[df.arm == "sarathi"], df[df.arm == "fcfs"]])  # spec order
    df.to_csv(exp / "summary.csv", index=False)
    (exp / "ab.csv").write_text("request_rate,metric,arm_a,arm_b\n4,p99_ttft_ms,sarathi,fcfs\n")
    for p in exp.glob("*/run=*.json"):
        p.unlink()  # the summary alone must do
    md, _ = write_report(exp)
    first = md.read_text().split("\n\n")[1]
    assert first.startswith("**fcfs vs sarathi")


def test_reports_never_load_executors_or_the_simulator(plan_dir, sweep_dir):
    """reports/ renders results: importing all of it and building a plan and a sweep report
    loads neither the experiment executors nor anything that runs a simulation."""
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, sys\n"
        "import servesim.reports as R\n"
        "for m in pkgutil.iter_modules(R.__path__):\n"
        "    importlib.import_module('servesim.reports.' + m.name)\n"
        "from servesim.reports.render import build_report\n"
        f"build_report({str(plan_dir)!r}); build_report({str(sweep_dir)!r})\n"
        "print(sorted(m for m in sys.modules if m.startswith(('servesim.simulator.experiments',"
        " 'servesim.simulator.runner', 'servesim.simulator.engine', 'servesim.simulator.client',"
        " 'servesim.simulator.recorder', 'servesim.simulator.sweep',"
        " 'servesim.simulator.plan.runner', 'servesim.simulator.plan.point'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
