"""Plan robustness: bad input is a one-line error naming the plan file and key (exit 2) before
anything runs, not a candidate that "does not fit"; --resume continues only the same plan;
output paths that cannot be folders; price files; why a candidate has no capacity."""

from __future__ import annotations

import re

import pytest
import yaml
from servesim.simulator.cli import run_cli
from servesim.simulator.errors import ServesimError
from servesim.simulator.plan import load_plan
from servesim.simulator.plan.runner import run_plan

from .synthetic import synthetic_eval, synthetic_fit

PLAN = {"name": "p0", "base": {"model": {"name": "llama-3.1-8b", "max_model_len": 8192}},
        "workload": {"kind": "random", "num_prompts": 50, "input_len": 256, "output_len": 32},
        "slo": {"ttft_ms": 2000, "tpot_ms": 60}, "target_request_rate": 20,
        "search": {"hardware": ["a100-sxm4-80gb"]}, "seeds": [0],
        "tolerance": {"rel_width": 0.3, "max_evals": 4, "first_guess_rps": 2.0}}


def write(tmp_path, file="plan.yaml", **kw):
    d = {**PLAN, **kw}
    p = tmp_path / file
    p.write_text(yaml.safe_dump({k: v for k, v in d.items() if v is not None}, sort_keys=False))
    return p


@pytest.mark.parametrize("kw, msg", [
    ({"search": {"foo.bar": [1]}},
     "search.foo.bar: foo: unknown key (not a field of this section)"),
    ({"search": {"scheduler.polcy": ["fcfs"]}},
     "search.scheduler.polcy: scheduler.polcy: unknown key (not a field of this section)"),
    ({"set": ["scheduler.polcy=fcfs"]},
     "base/set/workload: scheduler.polcy: unknown key (not a field of this section)"),
    ({"workload": {"kind": "random", "num_prompts": 50, "bogus": 3}},
     "base/set/workload: workload.bogus: unknown key (not a field of this section)"),
    ({"workload": {"kind": "trace", "path": "nope.csv"}},
     "workload: nope.csv: no such file (relative paths are read from the working directory)"),
    ({"seeds": [-1]}, "seeds[0]: expected an integer >= 0, got -1"),
    ({"seeds": [0, 0]}, "seeds: duplicate seeds in [0, 0]"),
    ({"seeds": [True]}, "seeds[0]: Input should be a valid integer"),
    ({"search": {"hardware": []}}, "search: hardware: expected a non-empty list of values"),
    ({"search": {"tp": [1], "tensor_parallel_size": [2]}},
     "search: tensor_parallel_size: the same axis as tp (parallel.tensor_parallel_size)"),
    ({"search": {"workload.request_rate": [5]}},
     ("search: workload.request_rate: the planner sets it (the search rate, seeds:); it cannot "
     "be an axis")),
    ({"search": {"workload.seed": [5]}},
     ("search: workload.seed: the planner sets it (the search rate, seeds:); it cannot be an "
     "axis")),
    ({"target_request_rate": float("inf")}, "target_request_rate: Input should be a finite number"),
    ({"target_request_rate": "inf"}, "target_request_rate: Input should be a finite number"),
    ({"min_duration_s": float("inf")}, "min_duration_s: Input should be a finite number"),
    ({"slo": {"ttft_ms": float("inf")}}, "slo.ttft_ms: Input should be a finite number"),
    ({"tolerance": {"first_guess_rps": float("inf")}},
     "tolerance.first_guess_rps: Input should be a finite number"),
    ({"tolerance": {"max_rps": float("inf")}}, "tolerance.max_rps: Input should be a finite number"),
    ({"tolerance": {"min_rps": 100, "max_rps": 1}},
     "tolerance: min_rps 100 must be below max_rps 1"),
    ({"prices": "nope.yaml"}, "prices: {dir}/nope.yaml: price file not found"),
    ({"prices": "garbage.yaml"},
     "prices: garbage.yaml:1:12: invalid YAML: expected ',' or ']', but got '<stream end>'"),
])
def test_bad_plan_input_is_a_one_line_error_before_anything_runs(kw, msg, tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "garbage.yaml").write_text("not: [valid")
    plan = write(tmp_path, **kw)
    want = f"plan.yaml: {msg.format(dir=tmp_path)}"
    with pytest.raises(ServesimError) as e:
        load_plan(plan.name)
    assert str(e.value) == want
    assert run_cli(["plan", plan.name, "-o", "out", "-q"]) == 2
    assert capsys.readouterr().err == f"error: {want}\n"
    assert not (tmp_path / "out").exists()


def test_bad_price_entry(tmp_path):
    (tmp_path / "prices.yaml").write_text("gpus: {a100-sxm4-80gb: {usd_per_gpu_hour: lots}}\n")
    with pytest.raises(ServesimError) as e:
        load_plan(write(tmp_path, prices=str(tmp_path / "prices.yaml")))
    assert str(e.value) == (f"{tmp_path}/plan.yaml: prices: {tmp_path}/prices.yaml: "
                            "gpus.a100-sxm4-80gb.usd_per_gpu_hour: expected a finite number "
                            ">= 0, got 'lots'")


def _run(spec_file, out, **kw):
    spec, plan_dir = load_plan(spec_file)
    return run_plan(spec, plan_dir, out, evaluate=synthetic_eval, fit_check=synthetic_fit,
                    quiet=True, write_report=False, source=str(spec_file), **kw)


def test_resume_refuses_the_folder_of_another_plan(tmp_path, capsys):
    q0 = write(tmp_path, "q0.yaml")
    p1 = write(tmp_path, "p1.yaml", name="p1", slo={"ttft_ms": 1})
    out = tmp_path / "U9"
    _run(q0, out)
    before = (out / "plan.json").read_bytes()
    with pytest.raises(ServesimError) as e:
        _run(p1, out, resume=True)
    assert str(e.value) == (f"{out}: holds the results of another plan ({q0.resolve()}), not "
                            f"of {p1.resolve()}; --resume continues only the same plan; choose "
                            "another -o")
    assert (out / "plan.json").read_bytes() == before
    assert run_cli(["plan", str(p1), "-o", str(out), "--resume", "-q"]) == 2
    assert capsys.readouterr().err.startswith(f"error: {out}: holds the results of another plan")
    # the same plan file resumes
    _run(q0, out, resume=True)
    # --resume with --overwrite: conflicting
    assert run_cli(["plan", str(q0), "-o", str(out), "--resume", "--overwrite", "-q"]) == 2
    assert capsys.readouterr().err == (
        "error: --resume and --overwrite: conflicting options (--resume continues the plan in "
        "OUTPUT, --overwrite clears it); pass one\n")


def test_output_that_cannot_be_a_folder(tmp_path, capsys):
    q0 = write(tmp_path, "q0.yaml")
    afile = tmp_path / "realfile"
    afile.write_text("x")
    with pytest.raises(ServesimError) as e:
        _run(q0, afile, resume=True)
    assert str(e.value) == f"{afile}: exists and is not a folder; choose another plan output folder"
    with pytest.raises(ServesimError) as e:
        _run(q0, afile / "sub")
    assert str(e.value) == (f"{afile / 'sub'}: {afile} is a file, not a folder; choose another "
                            "plan output folder")
    assert run_cli(["plan", str(q0), "-o", str(afile / "sub"), "-q"]) == 2
    assert capsys.readouterr().err == (f"error: {afile / 'sub'}: {afile} is a file, not a "
                                       "folder; choose another plan output folder\n")


def test_no_capacity_reason_names_the_lowest_rate_simulated_and_the_miss(tmp_path):
    plan = write(tmp_path, slo={"ttft_ms": 1}, confirm=False,
                 tolerance={"max_evals": 3, "first_guess_rps": 2.0})
    res = _run(plan, tmp_path / "out")
    (row,) = res["candidates"]
    assert not row["fits"]
    assert re.fullmatch(r"SLO not met at the lowest rate simulated, 0\.5 req/s: P99 TTFT "
                        r"1\d\d\.\d ms > 1 ms \(the search stopped at max_evals 3\)",
                        row["reason"]), row["reason"]
