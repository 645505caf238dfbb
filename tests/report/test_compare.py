"""simulate compare: sim vs measured vllm bench JSONs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from servesim.reports.compare import COMPARE_METRICS, compare_files, mape, write_csv
from servesim.simulator.errors import ServesimError

FIX = Path(__file__).parent / "fixtures"


def _sim(tmp_path: Path, name: str, rate: float, **vals) -> Path:
    d = {"simulated": True, "request_rate": rate, **vals}
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


def test_hand_made_pair(tmp_path):
    sim = _sim(tmp_path, "sim.json", 12.0, mean_ttft_ms=110.0, p99_ttft_ms=900.0,
               request_throughput=11.0, output_throughput=1500.0)
    meas = tmp_path / "meas.json"
    meas.write_text(json.dumps({"request_rate": 12.0, "mean_ttft_ms": 100.0,
                                "p99_ttft_ms": 1000.0, "request_throughput": 11.0,
                                "output_throughput": 1200.0, "mean_tpot_ms": 40.0}))
    rows = {r["metric"]: r for r in compare_files([sim, meas])}
    assert set(rows) == set(COMPARE_METRICS)
    assert rows["mean_ttft_ms"]["error"] == pytest.approx(10.0)
    assert rows["mean_ttft_ms"]["abs_error"] == pytest.approx(10.0)
    assert rows["mean_ttft_ms"]["rel_error_pct"] == pytest.approx(10.0)
    assert rows["p99_ttft_ms"]["abs_error"] == pytest.approx(100.0)
    assert rows["p99_ttft_ms"]["rel_error_pct"] == pytest.approx(-10.0)
    assert rows["request_throughput"]["rel_error_pct"] == pytest.approx(0.0)
    assert rows["output_throughput"]["rel_error_pct"] == pytest.approx(25.0)
    assert rows["mean_tpot_ms"]["status"] == "missing in sim"
    assert rows["p99_e2el_ms"]["status"] == "missing in both"
    assert mape(list(rows.values())) == pytest.approx((10 + 10 + 0 + 25) / 4)


def test_real_vllm_schema_fixture_and_rate_matching(tmp_path):
    meas12 = json.loads((FIX / "vllm_bench_measured.json").read_text())
    sim12 = _sim(tmp_path, "s12.json", 12.0, **{k: meas12[k] * 1.1 for k in COMPARE_METRICS})
    sim6 = _sim(tmp_path, "s6.json", 6.0, p99_ttft_ms=400.0, p99_itl_ms=50.0)
    rows = compare_files([sim6, sim12, FIX / "vllm_bench_measured.json",
                          FIX / "vllm_bench_measured_6qps.json"])
    at12 = [r for r in rows if r["request_rate"] == 12.0]
    at6 = {r["metric"]: r for r in rows if r["request_rate"] == 6.0}
    assert all(r["sim_file"].endswith("s12.json") for r in at12)
    assert all(r["status"] == "ok" and r["rel_error_pct"] == pytest.approx(10.0) for r in at12)
    assert at6["p99_ttft_ms"]["error"] == pytest.approx(-20.0)
    assert at6["p99_itl_ms"]["status"] == "missing in measured"  # old run without ITL
    out = tmp_path / "cmp.csv"
    write_csv(rows, out)
    lines = out.read_text().splitlines()
    assert lines[0].startswith("request_rate,sim_file,measured_file,metric,sim,measured")
    assert len(lines) == 1 + 2 * len(COMPARE_METRICS)


def test_unmatched_rate_is_a_clear_error(tmp_path):
    a = _sim(tmp_path, "a.json", 3.0)
    b = _sim(tmp_path, "b.json", 4.0)
    with pytest.raises(ServesimError, match="no simulated result with request_rate"):
        compare_files([a, b, FIX / "vllm_bench_measured.json"])


def test_missing_file(tmp_path):
    with pytest.raises(ServesimError, match="no such result file"):
        compare_files([tmp_path / "nope.json", FIX / "vllm_bench_measured.json"])
    assert math.isnan(mape([]))


def test_engine_side_rows_only_when_both_have_them(tmp_path):
    sim = _sim(tmp_path, "sim.json", 4.0, mean_ttft_ms=25.0, mean_engine_ttft_ms=20.0,
               median_engine_ttft_ms=19.0, p99_engine_ttft_ms=40.0)
    meas = tmp_path / "meas.json"  # engine side from a scrape of /metrics
    meas.write_text(json.dumps({"request_rate": 4.0, "mean_ttft_ms": 30.0,
                                "mean_engine_ttft_ms": 25.0}))
    rows = compare_files([sim, meas])
    client = {r["metric"]: r for r in rows if r["side"] == "client"}
    engine = {r["metric"]: r for r in rows if r["side"] == "engine"}
    assert client["mean_ttft_ms"]["rel_error_pct"] == pytest.approx(-100 / 6)
    assert engine["mean_engine_ttft_ms"]["rel_error_pct"] == pytest.approx(-20.0)
    assert engine["median_engine_ttft_ms"]["status"] == "missing in measured"
    plain = tmp_path / "plain.json"  # a vllm bench file alone: no engine rows at all
    plain.write_text(json.dumps({"request_rate": 4.0, "mean_ttft_ms": 30.0}))
    assert {r["side"] for r in compare_files([sim, plain])} == {"client"}
