"""Sweep robustness: resuming into another sweep's folder, a baseline arm that never runs,
output paths that cannot be folders, up-front checks of what would fail at run time, huge
rates (fake point function: no simulator)."""

from __future__ import annotations

import hashlib

import pytest
import yaml
from servesim.simulator.cli import run_cli
from servesim.simulator.errors import ServesimError
from servesim.simulator.experiments import fmt_rate
from servesim.simulator.sweep import load_spec, parse_spec, run_sweep
from sweep_fakes import fake_point

BASE = {"scheduler": {"max_num_seqs": 16},
        "workload": {"num_prompts": 5, "input_len": 64, "output_len": 8}}


def write(tmp_path, name: str, spec: dict):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(spec, sort_keys=False))
    return p


def r1(**kw) -> dict:
    s = {"base": BASE, "experiment_name": "exp",
         "arms": {"fcfs": {"scheduler.policy": "fcfs"}, "sarathi": {"scheduler.policy": "sarathi"}},
         "request_rates": [4, 8], "num_seeds": 2}
    s.update(kw)
    return s


def r2() -> dict:
    return {"base": BASE, "experiment_name": "exp",
            "overrides": {"workload.input_len": 512},
            "arms": {"fcfs": {"scheduler.policy": "fcfs"}, "orca": {"scheduler.policy": "orca"}},
            "request_rates": [4], "num_seeds": 1}


def md5(p) -> str:
    return hashlib.md5(p.read_bytes()).hexdigest()


def test_resume_refuses_the_folder_of_another_sweep_file(tmp_path, capsys):
    f1, f2 = write(tmp_path, "r1.yaml", r1()), write(tmp_path, "r2.yaml", r2())
    out = tmp_path / "R"
    assert run_sweep(load_spec(f1), out, point_fn=fake_point, jobs=1).num_run == 8
    run0 = out / "exp" / "SERVE-fcfs-BENCH-4" / "run=0.json"
    before = md5(run0)
    exp = out / "exp"
    with pytest.raises(ServesimError) as e:
        run_sweep(load_spec(f2), out, point_fn=fake_point, jobs=1, resume=True)
    assert str(e.value) == (f"{exp}: holds the results of another sweep ({f1.resolve()}), not "
                            f"of {f2.resolve()}; --resume continues only the same sweep; "
                            "choose another -o")
    # without --resume: no hint to pass --resume
    with pytest.raises(ServesimError) as e:
        run_sweep(load_spec(f2), out, point_fn=fake_point, jobs=1)
    assert str(e.value) == (f"{exp}: holds the results of another sweep ({f1.resolve()}), not "
                            f"of {f2.resolve()}; choose another -o")
    assert md5(run0) == before
    # the command line: one line, exit 2
    assert run_cli(["sweep", str(f2), "-o", str(out), "--resume", "-q"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {exp}: holds the results of another sweep ({f1.resolve()}), not of "
                   f"{f2.resolve()}; --resume continues only the same sweep; choose another -o\n")
    assert md5(run0) == before
    # the same sweep file (even edited: its changed points rerun) still resumes
    f1.write_text(yaml.safe_dump(r1(num_seeds=3), sort_keys=False))
    again = run_sweep(load_spec(f1), out, point_fn=fake_point, jobs=1, resume=True)
    assert (again.num_run, again.num_skipped) == (4, 8)
    # and the same definition under another name too
    f3 = write(tmp_path, "copy.yaml", r1(num_seeds=3))
    assert run_sweep(load_spec(f3), out, point_fn=fake_point, jobs=1, resume=True).num_run == 0


def test_baseline_arm_failing_everywhere_reports_failures_not_an_internal_error(tmp_path):
    spec = parse_spec(r1(arms={"a": {"workload.num_prompts": 13}, "b": {}}), "bf.yaml")
    out = run_sweep(spec, tmp_path, point_fn=fake_point, jobs=1)
    assert out.num_failed == 4 and len(out.failures) == 4
    assert out.failures[0][1] == "RuntimeError: unlucky num_prompts"
    assert out.ab_rows == []
    assert out.ab_note == "no A/B comparison (ab.csv): baseline arm a has no successful run"
    assert (tmp_path / "exp" / "summary.csv").is_file()
    assert not (tmp_path / "exp" / "ab.csv").exists()


def test_output_that_cannot_be_a_folder_is_a_one_line_error(tmp_path, capsys):
    f1 = write(tmp_path, "r1.yaml", r1())
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ServesimError) as e:
        run_sweep(load_spec(f1), afile, point_fn=fake_point, jobs=1)
    assert str(e.value) == f"{afile}: exists and is not a folder; choose another sweep output folder"
    with pytest.raises(ServesimError) as e:
        run_sweep(load_spec(f1), afile / "sub", point_fn=fake_point, jobs=1)
    assert str(e.value) == (f"{afile / 'sub'}: {afile} is a file, not a folder; choose another "
                            "sweep output folder")
    assert run_cli(["sweep", str(f1), "-o", str(afile), "-q"]) == 2
    assert capsys.readouterr().err == (f"error: {afile}: exists and is not a folder; choose "
                                       "another sweep output folder\n")


@pytest.mark.parametrize("spec, msg", [
    (r1(arms={"a": {}, "b": {"hardware.name": "l4", "model.max_model_len": 131072}}),
     "sw.yaml: arms.b: model.max_model_len=131072: To serve at least one request"),
    (r1(arms={"a": {}, "b": {"hardware.calibration": "/nope/cal.yaml"}}),
     "sw.yaml: arms.b: hardware.calibration: no such calibration file /nope/cal.yaml"),
    (r1(overrides={"workload.kind": "trace", "workload.path": "nope.csv"}, arms=None,
        request_rates=None),
     ("sw.yaml: arms.base: workload: nope.csv: no such file (relative paths are read from the "
     "working directory)")),
    (r1(request_rates=None, profile_sweep={"sweep_size": 3, "max_concurrency": -1}),
     ("sw.yaml: profile_sweep.max_concurrency: expected a positive integer (or null: no cap), "
     "got -1")),
    (r1(request_rates=None, profile_sweep={"sweep_size": 3, "max_concurrency": "x"}),
     ("sw.yaml: profile_sweep.max_concurrency: expected a positive integer (or null: no cap), "
     "got 'x'")),
    (r1(num_seeds=None, seeds=[0, -1]), "sw.yaml: seeds[1]: expected an integer >= 0, got -1"),
])
def test_what_would_fail_at_run_time_fails_up_front(spec, msg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = {k: v for k, v in spec.items() if v is not None}
    with pytest.raises(ServesimError) as e:
        parse_spec(spec, "sw.yaml")
    assert str(e.value).startswith(msg)
    assert "\n" not in str(e.value)


def test_huge_rate_gets_a_short_folder_name(tmp_path):
    assert fmt_rate(1e300) == "1e+300" and fmt_rate(4.0) == "4" and fmt_rate(2.5) == "2.5"
    spec = parse_spec(r1(request_rates=[1e300], arms=None, num_seeds=1), "sw.yaml")
    out = run_sweep(spec, tmp_path, point_fn=fake_point, jobs=1)
    assert out.num_failed == 0
    assert (tmp_path / "exp" / "SERVE-base-BENCH-1e+300" / "run=0.json").is_file()
