"""Numbers for people in report tables: thousands separators, a few significant digits,
units, never scientific notation."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from servesim.reports.numbers import human
from servesim.reports.plan import plan_rows, print_plan
from servesim.reports.render import md_table


@pytest.mark.parametrize("v, unit, want", [
    (12660.0, "", "12,660"), (12660.4, "req/s", "12,660 req/s"), (1234567, "", "1,234,567"),
    (999.6, "", "1,000"), (19.69187596, "", "19.7"), (6.0, "", "6"), (0.302, "", "0.302"),
    (0.000123456, "ms", "0.000123 ms"), (-10.0, "%", "-10%"), (48.149, "%", "48.1%"),
    (None, "", ""), (math.nan, "ms", ""), (math.inf, "", ""), (True, "", "yes"),
])
def test_human(v, unit, want):
    assert human(v, unit) == want


def test_report_cells_never_use_scientific_notation():
    import pandas as pd

    text = md_table(pd.DataFrame({"a": [12660.0, 1.5e7, 3e-7, 0.5], "b": [1, 2, 3, 4]}))
    assert "| 12,660 | 1 |" in text and "| 15,000,000 | 2 |" in text
    assert "| 0.0000003 | 3 |" in text and "| 0.5 | 4 |" in text
    assert not re.search(r"\de[+-]\d", text)


def test_plan_table_formats_large_capacities(capsys):
    plan = {"name": "big", "target_request_rate": 250000.0, "slo_text": "P99 TTFT ≤ 2000 ms",
            "slo": {"percentile": 99}, "knee_warn": 0.85, "wall_seconds": 1.0,
            "candidates": [{
                "candidate": "h100-sxm_tp1", "hardware": "h100-sxm", "tensor_parallel_size": 1,
                "fits": True, "recommended": True, "rank": 1.0, "capacity_rps": 12660.4,
                "ci_low": 12001.2, "ci_high": 13319.9, "replicas": 20, "gpus": 20,
                "usd_per_hour": 59.8, "usd_per_1m_output_tokens": 0.00052,
                "operating_rps_per_replica": 12500.0, "utilization_of_knee": 0.9873,
                "slo_margin_pct": 3.25, "pareto": True, "warning": ""}]}
    (row,) = plan_rows(plan)
    assert row["req/s"] == "12,660" and row["95% CI"] == "12,001–13,320"
    assert (row["replicas"], row["GPUs"], row["$/h"], row["$/1M tok"], row["load"]) == (
        "20", "20", "$59.80", "$0.001", "99%")
    print_plan(plan, Path("out"), quiet=False)
    shown = capsys.readouterr().out
    assert "12,660" in shown and "250,000 req/s" in shown and "…" not in shown
    assert not re.search(r"\de[+-]\d", shown)
