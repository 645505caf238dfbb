"""``simulate report`` on malformed run, sweep and plan folders: one line naming the file (and
the key), exit 2; never an internal error, and never a half-replaced report."""

from __future__ import annotations

import json

import pytest
from servesim.simulator.cli import run_cli


def report(capsys, d) -> tuple[int, str]:
    """(exit code, the one error line) of ``simulate report d``."""
    rc = run_cli(["report", str(d)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 0 or (len(lines) == 1 and "Traceback" not in err), err
    return rc, (lines[0] if lines else "")


def _edit_json(p, **changes):
    p.write_text(json.dumps({**json.loads(p.read_text()), **changes}))


# -- run folders ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,content,message", [
    ("result.json", "[1]", "result.json: expected a JSON object at the top level, got list"),
    ("requests.csv", "", "requests.csv: empty CSV file (no header row)"),
    ("requests.csv", b"\xff\xfe\x00bad", ("requests.csv: cannot read CSV ('utf-8' codec can't "
                                         "decode byte 0xff in position 0: invalid start byte)")),
    ("requests.csv", 'a,b\n"1,2\n', ("requests.csv: cannot read CSV (Error tokenizing data. C "
                                    "error: EOF inside string starting at row 1)")),
    ("timeseries.csv", "", "timeseries.csv: empty CSV file (no header row)"),
    ("config.resolved.yaml", "[1, 2]\n", ("config.resolved.yaml: expected a mapping of config "
                                         "sections at the top level, got list")),
    ("config.resolved.yaml", "slo: [1]\n", ("config.resolved.yaml: slo: expected a mapping "
                                           "such as {ttft_ms: 2000}, got [1]")),
    ("config.resolved.yaml", "slo: {ttft_ms: fast}\n", ("config.resolved.yaml: slo: ttft_ms: "
                                                       "expected a number, got 'fast'")),
])
def test_malformed_run_files(capsys, run_dir, name, content, message):
    p = run_dir / name
    (p.write_bytes if isinstance(content, bytes) else p.write_text)(content)
    rc, line = report(capsys, run_dir)
    assert rc == 2
    assert line == f"error: {run_dir}/{message}"


@pytest.mark.parametrize("key,value", [("p99_ttft_ms", "slow"), ("completed", [1]),
                                       ("output_throughput", {"a": 1})])
def test_run_result_values_of_the_wrong_type(capsys, run_dir, key, value):
    _edit_json(run_dir / "result.json", **{key: value})
    rc, line = report(capsys, run_dir)
    assert rc == 2
    assert line.startswith(f"error: {run_dir}/result.json: {key}: expected a number, got ")


def test_missing_p99_is_no_data_not_a_missed_slo(capsys, run_dir):
    """L7: P99 n/a is not a verdict on the SLO."""
    (run_dir / "result.json").write_text(
        (run_dir / "result.json").read_text().replace('"p99_ttft_ms": ', '"p99_ttft_ms": NaN, '
                                                      '"x": '))
    rc, _ = report(capsys, run_dir)
    assert rc == 0
    first = (run_dir / "report.md").read_text().split("\n\n")[1]
    assert "/ P99 n/a (SLO 2000 ms: no data)" in first
    assert "MISSED" not in first and "SLO is missed" not in first


# -- outputs that cannot be written (M8, L8) -----------------------------------------------


@pytest.mark.parametrize("name", ["report.md", "report.html", "fig_latency_cdf.png"])
def test_an_output_path_that_is_a_directory(capsys, run_dir, name):
    (run_dir / name).mkdir()
    rc, line = report(capsys, run_dir)
    assert rc == 2
    assert line == (f"error: {run_dir}/{name}: is a directory (or not a regular file); cannot "
                    "write the report there")


def test_a_failing_report_leaves_the_previous_pair(capsys, run_dir):
    """L8: report.md is not replaced when report.html cannot be written."""
    assert report(capsys, run_dir)[0] == 0
    old_md = (run_dir / "report.md").read_text()
    _edit_json(run_dir / "result.json", model_id="another-model")
    (run_dir / "report.html").unlink()
    (run_dir / "report.html").mkdir()
    rc, _ = report(capsys, run_dir)
    assert rc == 2
    assert (run_dir / "report.md").read_text() == old_md
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]
    (run_dir / "report.html").rmdir()
    assert report(capsys, run_dir)[0] == 0
    assert "another-model" in (run_dir / "report.md").read_text()


# -- sweep folders -------------------------------------------------------------------------


def _first_run(sweep_dir):
    return min(sweep_dir.glob("ab/*/run=*.json"))


@pytest.mark.parametrize("change,message", [
    ("[1]", "expected a JSON object at the top level, got list"),
    ({"request_rate": "abc"}, "request_rate: expected a number, got 'abc'"),
    ({"output_throughput": "x"}, "output_throughput: expected a number, got 'x'"),
    ({"p99_ttft_ms": [1]}, "p99_ttft_ms: expected a number, got [1]"),
])
def test_malformed_sweep_run_files(capsys, sweep_dir, change, message):
    p = _first_run(sweep_dir)
    if isinstance(change, dict):
        _edit_json(p, **change)
    else:
        p.write_text(change)
    rc, line = report(capsys, sweep_dir)
    assert rc == 2
    assert line == f"error: {p}: {message}"


def test_sweep_runs_with_inf_rate_and_breakdown_objects_still_report(capsys, sweep_dir):
    _edit_json(_first_run(sweep_dir), ttft_breakdown_ms={"queue": 1.0}, max_concurrency=None)
    assert report(capsys, sweep_dir)[0] == 0


@pytest.mark.parametrize("content,message", [
    ("", "empty CSV file (no header row)"),
    ("arm,request_rate,output_throughput\nA,abc,xyz\n",
     "column request_rate, line 2: expected a number, got 'abc'"),
    ("arm,request_rate,output_throughput\nA,4,1\nB,8,xyz\n",
     "column output_throughput, line 3: expected a number, got 'xyz'"),
])
def test_malformed_sweep_summary(capsys, tmp_path, content, message):
    (tmp_path / "summary.csv").write_text(content)
    rc, line = report(capsys, tmp_path)
    assert rc == 2
    assert line == f"error: {tmp_path}/summary.csv: {message}"


# -- plan folders --------------------------------------------------------------------------


@pytest.mark.parametrize("content,message", [
    ("{}", "plan.json: no candidates key (is this a plan.json of simulate plan?)"),
    ("[1]", "plan.json: expected a JSON object at the top level, got list"),
    ('{"candidates": []}', "plan.json: no candidates (an empty plan)"),
    ('{"candidates": "x"}', "plan.json: candidates: expected a JSON array, got 'x'"),
    ('{"candidates": [1]}', ("plan.json: candidates[0]: expected an object with a candidate "
                            "name, got 1")),
    ('{"candidates": [{"candidate": "a", "capacity_rps": "fast"}]}',
     "plan.json: candidates[0]: capacity_rps: expected a number, got 'fast'"),
    ('{"candidates": [{"candidate": "a", "fits": true, "recommended": true}]}',
     ("plan.json: candidates[0] (a): replicas: missing (the plan's answer names this "
     "candidate)")),
    ('{"candidates": [{"candidate": "a"}], "slo": [1]}',
     "plan.json: slo: expected a JSON object, got [1]"),
    ('{"candidates": [{"candidate": "a"}], "target_request_rate": "x"}',
     "plan.json: target_request_rate: expected a number, got 'x'"),
    ('{"candidates": [{"candidate": "a"}], "points": [5]}',
     "plan.json: points[0]: expected an object, got 5"),
    ("", "plan.json: cannot read JSON (Expecting value: line 1 column 1 (char 0))"),
])
def test_malformed_plan_json(capsys, tmp_path, content, message):
    (tmp_path / "plan.json").write_text(content)
    rc, line = report(capsys, tmp_path)
    assert rc == 2
    assert line == f"error: {tmp_path}/{message}"


@pytest.mark.parametrize("content,message", [
    ("", "plan.csv: empty CSV file (no header row)"),
    ("a,b\n", "plan.csv: no plan columns (candidate, fits, ...); got a, b"),
    ("candidate,fits,capacity_rps\n", "plan.csv: no candidates (an empty plan)"),
])
def test_malformed_plan_csv(capsys, tmp_path, content, message):
    """L6: a plan.csv without candidates is an error, not "None of the 0 candidates fits"."""
    (tmp_path / "plan.csv").write_text(content)
    rc, line = report(capsys, tmp_path)
    assert rc == 2
    assert line == f"error: {tmp_path}/{message}"


def test_a_minimal_plan_still_reports(capsys, tmp_path):
    (tmp_path / "plan.json").write_text(json.dumps({"candidates": [
        {"candidate": "l4_tp1", "fits": False, "reason": "weights do not fit"}]}))
    rc, _ = report(capsys, tmp_path)
    assert rc == 0
    assert "None of the 1 candidates fits" in (tmp_path / "report.md").read_text()
