"""`simulate run` / `simulate validate` end to end (subprocess, as a user runs them)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "llama8b_a100.yaml"
SMALL = ["--set", "workload.num_prompts=60"]


def simulate(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-c", "from servesim.simulator.cli import main; main()",
                           *map(str, args)], cwd=cwd, capture_output=True, text=True, check=False,
                          timeout=300)


def test_run_writes_files_and_is_deterministic(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for out, seed in ((a, 0), (b, 0), (c, 1)):
        p = simulate("run", CONFIG, "-o", out, "--seed", seed, "--quiet", *SMALL)
        assert p.returncode == 0, p.stderr
        assert p.stdout == ""
    for name in ("result.json", "requests.csv", "timeseries.csv", "config.resolved.yaml"):
        assert (a / name).is_file()
    ra, rb, rc = (json.loads((d / "result.json").read_text()) for d in (a, b, c))
    assert ra["completed"] + ra["failed"] == ra["num_prompts"] == 60
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert isinstance(ra[f"{stat}_{m}_ms"], float)
    ra.pop("date"), rb.pop("date"), rc.pop("date")
    assert ra == rb
    def lines(d):
        return [ln for ln in (d / "result.json").read_text().splitlines()
                if not ln.lstrip().startswith('"date"')]

    assert lines(a) == lines(b)  # byte-identical except the date line
    assert (a / "requests.csv").read_bytes() == (b / "requests.csv").read_bytes()
    assert ra != rc


def test_run_prints_vllm_summary(tmp_path):
    p = simulate("run", CONFIG, "-o", tmp_path / "r", *SMALL)
    assert p.returncode == 0, p.stderr
    assert "Serving Benchmark Result" in p.stdout and "Mean TTFT (ms):" in p.stdout


def test_validate_prints_capacity():
    p = simulate("validate", CONFIG)
    assert p.returncode == 0, p.stderr
    assert "num_gpu_blocks:" in p.stdout
    assert "Maximum concurrency for" in p.stdout
    assert "GPU KV cache size:" in p.stdout


@pytest.mark.parametrize("args,needle", [
    (["--set", "scheduler.max_num_seqs=abc"], "scheduler.max_num_seqs"),
    (["--set", "workload.request_rate=-1"], "workload.request_rate"),
    (["--set", "model.name=no-such-model"], "no-such-model"),
    (["--set", "model.name=llama-3.1-70b", "--set", "hardware.name=a100-sxm4-80gb"], "GiB"),
    (["--set", "model.name=llama-3.1-8b", "--set", "parallel.tensor_parallel_size=3"],
     "parallel.tensor_parallel_size"),
])
def test_bad_input_is_one_line_exit_2(args, needle, tmp_path):
    p = simulate("run", CONFIG, "-o", tmp_path / "x", *args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr + p.stdout
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "Warning" not in ln
             and "cal = " not in ln]
    assert len(lines) == 1 and needle in lines[0], p.stderr


def test_misspelled_key_in_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.read_text().replace("block_size:", "blok_size:"))
    p = simulate("run", bad)
    assert p.returncode == 2
    assert "cache.blok_size" in p.stderr and str(bad) in p.stderr
    assert "Traceback" not in p.stderr


def test_debug_shows_traceback():
    p = simulate("run", CONFIG, "--set", "scheduler.max_num_seqs=abc", "--debug")
    assert p.returncode != 0 and "Traceback" in p.stderr


def test_missing_file_and_bad_yaml(tmp_path):
    p = simulate("run", tmp_path / "nope.yaml")
    assert p.returncode == 2 and "no such config file" in p.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: [\n")
    p = simulate("validate", bad)
    assert p.returncode == 2 and "invalid YAML" in p.stderr and "Traceback" not in p.stderr


def test_too_long_requests_are_failed_not_dropped(tmp_path):
    p = simulate("run", CONFIG, "-o", tmp_path / "r", "--quiet", "--set", "model.max_model_len=1100",
                 *SMALL)
    assert p.returncode == 0, p.stderr
    r = json.loads((tmp_path / "r" / "result.json").read_text())
    assert r["failed"] > 0 and r["completed"] + r["failed"] == 60
    rows = (tmp_path / "r" / "requests.csv").read_text()
    assert "rejected" in rows


def test_preemptions_with_tiny_cache(tmp_path):
    p = simulate("run", CONFIG, "-o", tmp_path / "r", "--quiet",
                 "--set", "cache.num_gpu_blocks_override=200", "--set", "model.max_model_len=3200", "--set", "workload.num_prompts=200")
    assert p.returncode == 0, p.stderr
    r = json.loads((tmp_path / "r" / "result.json").read_text())
    assert r["num_preemptions"] > 0
    assert r["completed"] == 200 and r["failed"] == 0


def test_prefix_hit_rate_matches_analytic(tmp_path):
    p = simulate("run", CONFIG, "-o", tmp_path / "r", "--quiet",
                 "--set", "workload.prefix_len=1024", "--set", "workload.num_prompts=300")
    assert p.returncode == 0, p.stderr
    r = json.loads((tmp_path / "r" / "result.json").read_text())
    import csv
    with open(tmp_path / "r" / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    total_prompt = sum(int(x["prompt_len"]) for x in rows)
    # Every request but the first hits the 1024-token (64-block) shared prefix.
    analytic = (len(rows) - 1) * 1024 / total_prompt
    assert abs(r["prefix_cache_hit_rate"] - analytic) < 0.01


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_standard_output_that_cannot_be_written_is_a_one_line_error(tmp_path):
    """Standard output on a full disk (``> /dev/full``): exit 2 and one line on stderr, no
    traceback (it was an internal error, exit 1)."""
    import subprocess

    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_len,output_len\n0,10,5\n1,20,6\n")
    with open("/dev/full", "w") as full:
        p = subprocess.run([sys.executable, "-c",
                            "from servesim.simulator.cli import main; main()",
                            "trace", "stats", str(trace)],
                           stdout=full, stderr=subprocess.PIPE, text=True, check=False)
    assert p.returncode == 2
    assert p.stderr == "error: cannot write the output: No space left on device\n"


def test_overwrite_replaces_only_a_run_folder(tmp_path):
    """``--overwrite`` replaces a whole folder, so it takes only a servesim run's (one with
    run_info.json): never the config's own folder, a folder of other files, the working
    directory or a symlink; each is a one-line error (exit 2) that leaves everything as it
    was."""
    cfg = tmp_path / "cfgs" / "c.yaml"
    cfg.parent.mkdir()
    cfg.write_text(CONFIG.read_text())
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "n.txt").write_text("keep me")
    (tmp_path / "link").symlink_to(notes)
    cases = [(cfg.parent, "holds c.yaml, which this run reads"),
             (notes, "holds files that are not a servesim run's (no run_info.json)"),
             (tmp_path / "link", "is a symlink"),
             (Path("."), "is the working directory or holds it")]
    for out, needle in cases:
        p = simulate("run", cfg, "-o", out, "--overwrite", "--quiet", *SMALL, cwd=tmp_path)
        assert p.returncode == 2 and needle in p.stderr and p.stderr.count("\n") == 1, \
            (out, p.stderr)
    assert cfg.is_file() and (notes / "n.txt").read_text() == "keep me"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["cfgs", "link", "notes"]
    run = tmp_path / "run"  # a run folder is replaced
    for _ in range(2):
        p = simulate("run", cfg, "-o", run, "--overwrite", "--quiet", *SMALL, cwd=tmp_path)
        assert p.returncode == 0, p.stderr
    assert (run / "run_info.json").is_file()
