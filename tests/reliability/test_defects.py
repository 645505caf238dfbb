"""One regression test per numbered defect of issue 16 (each failed before its fix)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from servesim.simulator import runner

from .cli_harness import check_contract, cli, no_partial_output
from .conftest import CONFIG, REPO


def _trace(tmp_path, body: bytes, name="t.csv"):
    p = tmp_path / name
    p.write_bytes(b"arrival_s,prompt_len,output_len\n" + body)
    return p


# 1. Ctrl-C exited 0 (typer returns 130, main ignored it) -------------------------------------


def test_1_interrupted_run_exits_130_and_says_nothing_was_written(small_config, tmp_path,
                                                                   monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run_experiment", boom)
    o = cli("run", small_config, "-o", tmp_path / "out")
    assert o.rc == 130
    msg = (f"interrupted: nothing was written to {tmp_path / 'out'} (a run folder appears only "
           "when complete)")
    assert o.err_lines == [msg]
    assert not (tmp_path / "out").exists()
    no_partial_output(tmp_path, "out")


def test_1_interrupt_swallowed_by_typer_still_exits_130(monkeypatch):
    from servesim.costmodels import memory

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(memory, "plan_memory", boom)
    monkeypatch.setattr("servesim.costmodels.plan_memory", boom)
    o = cli("validate", CONFIG)
    assert o.rc == 130 and o.err_lines == ["interrupted: nothing was written"]


# 2. non-UTF-8 bytes: exit 1 "internal error: UnicodeDecodeError" -----------------------------


def test_2_non_utf8_config(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_bytes(b"model:\n  name: \xff\xfe\n")
    o = cli("validate", p)
    assert o.rc == 2
    check_contract(o, f"{p}:2", "UTF-8")


def test_2_non_utf8_trace_row(tmp_path):
    p = _trace(tmp_path, b"0,10,10\n1,\xff\xfe,3\n2,5,5\n")
    o = cli("trace", "stats", p)
    assert o.rc == 2
    check_contract(o, f"{p}:3", "UTF-8")
    o = cli("trace", "stats", p, "--skip-bad-rows", "--json")
    assert o.rc == 0, o.err
    s = json.loads(o.out)
    assert (s["requests"], s["skipped_bad_rows"]) == (2, 1)


# 3. truncated .gz: "aborted", exit 130; non-gzip .gz: exit 1 BadGzipFile --------------------


def test_3_truncated_and_fake_gzip(tmp_path):
    rows = b"".join(b"%d,10,5\n" % i for i in range(20000))
    data = gzip.compress(b"arrival_s,prompt_len,output_len\n" + rows)
    trunc = tmp_path / "trunc.csv.gz"
    trunc.write_bytes(data[: len(data) // 2])
    o = cli("trace", "stats", trunc)
    assert o.rc == 2
    check_contract(o, str(trunc), "truncated gzip")
    fake = _trace(tmp_path, b"0,1,1\n", name="fake.csv.gz")
    o = cli("trace", "stats", fake)
    assert o.rc == 2
    check_contract(o, str(fake), "not a valid gzip file")


# 4. --seed -1 / 2**32 failed with exit 1 after the simulation had started ------------------


@pytest.mark.parametrize("seed", ["-1", "4294967296"])
def test_4_bad_seed_is_a_config_error_before_simulating(seed, small_config, tmp_path,
                                                        monkeypatch):
    calls = []
    monkeypatch.setattr(runner, "run_experiment", lambda *a, **k: calls.append(1))
    o = cli("run", small_config, "--seed", seed, "-o", tmp_path / "out")
    assert o.rc == 2 and not calls
    check_contract(o, str(small_config), "workload.seed")
    o = cli("validate", small_config, "--set", f"workload.seed={seed}")
    assert o.rc == 2
    check_contract(o, "workload.seed")


# 5. unwritable -o failed after simulating (results lost); trace convert into a new folder --


@pytest.mark.parametrize("where", ["existing_file", "under_a_file"])
def test_5_unwritable_output_fails_before_simulating(where, small_config, tmp_path,
                                                     monkeypatch):
    f = tmp_path / "afile"
    f.write_text("x")
    out = f if where == "existing_file" else f / "run"
    calls = []
    monkeypatch.setattr(runner, "run_experiment", lambda *a, **k: calls.append(1))
    o = cli("run", small_config, "-o", out)
    assert o.rc == 2 and not calls
    check_contract(o, str(out))
    assert f.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_5_read_only_folder(small_config, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    calls = []
    monkeypatch.setattr(runner, "run_experiment", lambda *a, **k: calls.append(1))
    o = cli("run", small_config, "-o", ro / "run")
    assert o.rc == 2 and not calls
    check_contract(o, str(ro / "run"))


def test_5_trace_convert_creates_missing_folder(tmp_path):
    src = _trace(tmp_path, b"0,10,10\n1,5,3\n")
    out = tmp_path / "new" / "sub" / "c.csv"
    o = cli("trace", "convert", src, "-o", out)
    assert o.rc == 0, o.err
    assert [r.split(",")[:3] for r in out.read_text().splitlines()[1:]] == [
        ["0.0", "10", "10"], ["1.0", "5", "3"]]


# 6. -o onto an existing run overwrote silently, leaving the old report beside it -----------


def test_6_existing_run_folder_is_refused_unless_overwrite(small_config, tmp_path):
    out = tmp_path / "run"
    assert cli("run", small_config, "-o", out, "-q").rc == 0
    (out / "report.html").write_text("old report of 40 requests")
    before = (out / "result.json").read_bytes()
    o = cli("run", small_config, "-o", out, "--set", "workload.num_prompts=30")
    assert o.rc == 2
    check_contract(o, str(out), "--overwrite")
    assert (out / "result.json").read_bytes() == before
    o = cli("run", small_config, "-o", out, "--set", "workload.num_prompts=30", "--overwrite",
            "-q")
    assert o.rc == 0, o.err
    assert sorted(x.name for x in out.iterdir()) == [
        "config.resolved.yaml", "requests.csv", "result.json", "run_info.json",
        "timeseries.csv"]  # the stale report went with the old run
    assert json.loads((out / "result.json").read_text())["num_prompts"] == 30
    no_partial_output(tmp_path, "run")


def _stub_plan(monkeypatch) -> list:
    """``run_plan`` replaced by one that records its output folder and writes a plan.csv."""
    from servesim.simulator.plan import runner as plan_runner

    calls: list = []

    def fake(spec, plan_dir, output, **kw):
        calls.append((Path(output), kw["resume"]))
        Path(output).mkdir(parents=True, exist_ok=True)
        (Path(output) / "plan.csv").write_text("candidate\n")
        return {"name": "stub", "candidates": []}

    monkeypatch.setattr(plan_runner, "run_plan", fake)
    return calls


def test_6_non_empty_plan_folder_is_refused_unless_resume_or_overwrite(tmp_path, monkeypatch):
    plan = REPO / "configs" / "plans" / "llama8b_chat.yaml"
    calls = _stub_plan(monkeypatch)
    out = tmp_path / "run"  # an earlier run's folder
    out.mkdir()
    (out / "result.json").write_text("{}")
    o = cli("plan", plan, "-o", out, "--json")
    assert o.rc == 2
    check_contract(o, str(out), "--resume", "--overwrite")
    assert calls == [] and sorted(x.name for x in out.iterdir()) == ["result.json"]
    o = cli("plan", plan, "-o", out, "--resume", "--json")  # continue whatever is there
    assert o.rc == 0, o.err
    assert calls == [(out, True)] and (out / "result.json").exists()
    o = cli("plan", plan, "-o", out, "--overwrite", "--json")
    assert o.rc == 0, o.err
    assert json.loads(o.out) == {"name": "stub", "candidates": []}
    assert calls[-1] == (out, False)
    assert sorted(x.name for x in out.iterdir()) == ["plan.csv"]  # the run's file is gone
    o = cli("plan", plan, "-o", out)  # the plan's own folder is no exception
    assert o.rc == 2 and len(calls) == 2


def test_6_plan_overwrite_never_clears_the_plan_file_or_the_working_directory(
        tmp_path, monkeypatch):
    calls = _stub_plan(monkeypatch)
    plan = tmp_path / "plan.yaml"
    plan.write_text((REPO / "configs" / "plans" / "llama8b_chat.yaml").read_text()
                    .replace("../", str(REPO / "configs") + "/"))
    o = cli("plan", plan, "-o", tmp_path, "--overwrite")
    assert o.rc == 2
    check_contract(o, str(tmp_path), "plan file")
    monkeypatch.chdir(tmp_path / "..")
    o = cli("plan", REPO / "configs" / "plans" / "llama8b_chat.yaml", "-o", ".",
            "--overwrite")
    assert o.rc == 2
    check_contract(o, "working directory")
    assert calls == [] and plan.exists()


# 7. trace convert t.csv -o t.csv replaced its own input -------------------------------------


def test_7_convert_refuses_its_own_input(tmp_path):
    src = _trace(tmp_path, b"0,10,10\n1,5,3\n")
    before = src.read_bytes()
    o = cli("trace", "convert", src, "-o", src)
    assert o.rc == 2
    check_contract(o, str(src), "input")
    assert src.read_bytes() == before


# 8. errors echoed the whole value: alias bombs hung, a 200,000-element list gave 1.5 MB ----


def test_8_huge_value_gives_a_short_error(tmp_path):
    p = tmp_path / "big.yaml"
    p.write_text("workload:\n  num_prompts: " + str(list(range(200_000))) + "\n")
    o = cli("validate", p)
    assert o.rc == 2
    check_contract(o, str(p), "workload.num_prompts")
    assert len(o.err) < 300


def test_8_yaml_alias_bomb_is_refused(tmp_path):
    """A list value built from nested aliases: 9**7 ≈ 4.8M values once expanded, which the
    error message used to echo whole."""
    lines = ['    - &a ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, 7):
        prev, cur = chr(96 + i), chr(97 + i)
        lines.append(f"    - &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    p = tmp_path / "bomb.yaml"
    p.write_text("compilation:\n  cudagraph_capture_sizes:\n" + "\n".join(lines) + "\n")
    o = cli("validate", p)
    assert o.rc == 2
    check_contract(o, str(p), "aliases are expanded")


# 9. compare SIM other.json (no metric keys) exited 0 with "nan%" ---------------------------


def test_9_compare_without_metrics(small_config, tmp_path):
    run = tmp_path / "run"
    assert cli("run", small_config, "-o", run, "-q").rc == 0
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"date": "x", "num_prompts": 3}))
    o = cli("compare", run, other)
    assert o.rc == 2
    check_contract(o, str(other), "metric")


# 10. empty YAML ran all defaults; duplicate keys: the last won silently ----------------------


def test_10_empty_yaml_and_duplicate_keys(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here\n")
    o = cli("validate", empty)
    assert o.rc == 2
    check_contract(o, str(empty), "empty config")
    dup = tmp_path / "dup.yaml"
    dup.write_text("workload:\n  num_prompts: 5\n  request_rate: 2\n  num_prompts: 7\n")
    o = cli("validate", dup)
    assert o.rc == 2
    check_contract(o, f"{dup}:4", "num_prompts", "line 2")


# 13. messages ------------------------------------------------------------------------------


def test_13_errors_after_resolution_name_the_file(small_config, tmp_path):
    o = cli("validate", small_config, "--set", "parallel.tensor_parallel_size=3")
    assert o.rc == 2
    check_contract(o, str(small_config), "parallel.tensor_parallel_size")
    o = cli("run", small_config, "--set", "cache.gpu_memory_utilization=0.05", "-o",
            tmp_path / "out")  # a CapacityError raised while setting up the run
    assert o.rc == 2
    check_contract(o, str(small_config), "memory")


def test_13_calibrate_note_is_a_whole_sentence():
    from servesim.kernels.calibrate import build_plan

    notes = [n for n in build_plan("h100-sxm", quick=True).notes if "MLA" in n]
    assert notes and notes[0].endswith("calibrated like every model's")


def test_13_warning_printed_once_per_run_across_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(warnings, "filters", warnings.filters[:])
    monkeypatch.delenv("SERVESIM_WARNINGS", raising=False)
    from servesim.simulator.errors import install_cli_warnings

    path = install_cli_warnings(quiet=False)
    try:
        err = []
        monkeypatch.setattr(sys, "stderr", type("S", (), {"write": err.append})())
        warnings.warn("no calibration file for x", stacklevel=1)
        warnings.warn("no calibration file for x", stacklevel=1)
        assert err == ["warning: no calibration file for x\n"]
        code = ("import warnings, servesim.simulator.errors\n"
                "warnings.warn('no calibration file for x')\n"
                "warnings.warn('another one\\n  on two lines')\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(os.environ), check=True)
        assert r.stderr == "warning: another one on two lines\n"  # the first was seen here
    finally:
        os.unlink(path)


def _measured_copy(run, tmp_path):
    d = json.loads((run / "result.json").read_text())
    d.pop("simulated")
    p = tmp_path / "measured.json"
    p.write_text(json.dumps(d))
    return p


def test_13_tables_keep_every_column_when_piped(small_config, tmp_path):
    run = tmp_path / "run"
    assert cli("run", small_config, "-o", run, "-q").rc == 0
    o = cli("compare", run, _measured_copy(run, tmp_path))  # not a terminal: printed at full width
    assert o.rc == 0, o.err
    assert "…" not in o.out
    for col in ("metric", "sim", "measured", "abs error", "rel error %", "status"):
        assert col in o.out
    assert "mean_ttft_ms" in o.out and "median_e2el_ms" in o.out


def test_13_every_table_command_has_json(small_config, tmp_path):
    run = tmp_path / "run"
    o = cli("run", small_config, "-o", run, "--json")
    assert o.rc == 0 and json.loads(o.out)["num_prompts"] == 40
    o = cli("compare", run, _measured_copy(run, tmp_path), "--json")
    assert o.rc == 0 and json.loads(o.out)["mean_abs_rel_error_pct"] == 0.0
    o = cli("estimate", small_config, "--batch-size", "4", "--context", "100", "--json")
    assert o.rc == 0 and json.loads(o.out)
    fixture = REPO / "tests" / "costmodels" / "fixtures" / "calibration-fixture-a100.yaml"
    o = cli("calibrate", "report", fixture, "--json")
    assert o.rc == 0, o.err
    gemm = json.loads(o.out)["gemm"]
    assert [(g["rows"], g["triton_over_vendor"]["n"]) for g in gemm] == [
        ("M <= 16", 8), ("16 < M < 256", 0), ("M >= 256", 8)]
    import yaml

    spec = tmp_path / "sw.yaml"
    spec.write_text(yaml.safe_dump({
        "base": str(small_config), "experiment_name": "j", "seeds": [0],
        "arms": {"a": {}, "b": {"scheduler.max_num_seqs": 8}}, "request_rates": [4]}))
    o = cli("sweep", spec, "-o", tmp_path / "sw", "--jobs", "1", "--json")
    assert o.rc == 0, o.err
    res = json.loads(o.out)
    assert (res["num_points"], res["num_run"], res["num_failed"]) == (2, 2, 0)
    assert {r["arm"] for r in res["rows"]} == {"a", "b"} and res["ab_rows"]



# Found by the long fuzz profile: a config value with a control character (here the record
# separator, which ``str.splitlines`` breaks on) was echoed raw, splitting the one-line error.


@pytest.mark.parametrize("name", ["\x1e", "a\nb", "x\u2028y"])
def test_error_echoing_control_characters_stays_one_line(small_config, tmp_path, name):
    import yaml

    tree = yaml.safe_load(Path(small_config).read_text())
    tree["model"]["name"] = name
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    o = cli("validate", cfg)
    assert o.rc == 2
    check_contract(o, "model.name")
    escaped = name.encode("unicode_escape").decode("ascii")
    assert f"unknown model '{escaped}'" in o.err_lines[0]
    o = cli("run", f"/tmp/no{name}such.yaml")
    assert o.rc == 2
    check_contract(o, f"/tmp/no{escaped}such.yaml")


# Found by the long fuzz profile: a name too long for the OS to look up (ENAMETOOLONG) as the
# hardware or model name, calibration file or config path was an "internal error".


@pytest.mark.parametrize("key, command, named", [
    ("hardware.name", "validate", "hardware.bf16_tflops"),  # not shipped: give it inline
    ("model.name", "validate", "model.name"),
    ("hardware.calibration", "run", "hardware.calibration"),
])
def test_names_too_long_to_look_up_are_one_line_errors(small_config, tmp_path, key, command,
                                                       named):
    import yaml

    tree = yaml.safe_load(Path(small_config).read_text())
    section, field = key.split(".")
    tree.setdefault(section, {})[field] = "a" * 5000
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    o = cli(command, cfg, *(["-o", tmp_path / "out"] if command == "run" else []))
    assert o.rc == 2
    check_contract(o, str(cfg), named)


def test_config_path_too_long_to_look_up_is_a_one_line_error():
    o = cli("run", "/tmp/" + "a" * 5000 + ".yaml")
    assert o.rc == 2
    check_contract(o, "no such config file")


# Found by re-running the acceptance: values that validate but could not be simulated ended in
# "internal error" (MemoryError, numpy's int64 bounds) or a hang at ``simulate run``.


@pytest.mark.parametrize(("key", "value", "says"), [
    ("cache.num_gpu_blocks_override", 10**8, "CUDA out of memory"),  # 195,312 GiB of KV
    ("cache.kv_cache_memory_bytes", 2**63 - 1, "CUDA out of memory"),
    ("cache.kv_cache_memory_bytes", "9" * 400 + "T", "less than or equal to 9223372036854775807"),
    ("cache.kv_cache_memory_bytes", "9" * 400 + "t", "is too large"),
    ("parallel.data_parallel_size", 10**8, "less than or equal to 1024"),
    ("frontend.api_server_count", 10**8, "less than or equal to 1024"),
    ("workload.prefix_len", 10**9, "longer than model.max_model_len (131072)"),
    ("workload.input_len", 2**63, "less than or equal to 2147483647"),
    ("workload.output_len", 2**63, "less than or equal to 2147483647"),
])
def test_huge_values_are_config_errors_at_run(small_config, tmp_path, key, value, says):
    o = cli("run", small_config, "-o", tmp_path / "run", "--set", f"{key}={value}")
    assert o.rc == 2
    check_contract(o, str(small_config), key, says)
    assert not (tmp_path / "run").exists()


def test_cluster_of_more_engines_than_simulated_is_a_config_error(small_config, tmp_path):
    import yaml

    tree = yaml.safe_load(small_config.read_text())
    tree["cluster"] = {"instances": [{"name": "a", "replicas": 1000},
                                     {"name": "b", "replicas": 25}]}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(tree))
    o = cli("validate", p)
    assert o.rc == 2
    check_contract(o, str(p), "cluster", "1025 instances in all: at most 1024")


@pytest.mark.parametrize("column", ["prompt_len", "output_len"])
def test_trace_token_count_past_int32_is_a_bad_row(tmp_path, column):
    big = "9.223372036854776e+18"  # 2**63: past numpy's int64 in trace stats
    row = f"0,{big},1\n" if column == "prompt_len" else f"0,1,{big}\n"
    src = _trace(tmp_path, b"0,10,10\n" + row.encode())
    for cmd in (["trace", "stats", src], ["trace", "convert", src, "-o", tmp_path / "c.csv"]):
        o = cli(*cmd)
        assert o.rc == 2
        what = column.split("_")[0]
        check_contract(o, f"{src}:3", f"{what} length 9223372036854775808 is out of range")
    assert not (tmp_path / "c.csv").exists()
    o = cli("trace", "stats", src, "--skip-bad-rows", "--json")
    assert o.rc == 0, o.err
    res = json.loads(o.out)  # (strict JSON: one request's rate is "inf", not Infinity)
    assert (res["requests"], res["skipped_bad_rows"], res["mean_rate_rps"]) == (1, 1, "inf")
