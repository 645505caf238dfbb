"""Sweep spec parsing/validation and the sweep runner (layout, resume, failures) with a fake
point function, so these run in seconds without the simulator."""

from __future__ import annotations

import json
import math

import pytest
import yaml
from servesim.simulator.errors import ConfigError
from servesim.simulator.sweep import build_tree, load_spec, parse_spec, run_sweep
from sweep_fakes import fake_point

BASE = {"scheduler": {"max_num_seqs": 16},
        "workload": {"num_prompts": 5, "input_len": 64, "output_len": 8}}


def write_spec(tmp_path, spec: dict, name: str = "sw.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(spec, sort_keys=False))
    return p


def spec2(**kw) -> dict:
    s = {"base": BASE, "experiment_name": "exp",
         "arms": {"big": {"scheduler.max_num_batched_tokens": 2048},
                  "small": ["scheduler.max_num_batched_tokens=64"]},
         "seeds": [0, 1, 2], "request_rates": [1, 2]}
    s.update(kw)
    return s


# --- parsing -----------------------------------------------------------------------------------


def test_points_and_layout_names():
    spec = parse_spec(spec2(), "sw.yaml")
    pts = spec.points()
    assert len(pts) == 2 * 2 * 3
    assert [a.name for a in spec.arms] == ["big", "small"]
    assert pts[0].dirname == "SERVE-big-BENCH-1" and pts[0].run_name == "run=0.json"
    assert {p.dirname for p in pts} == {"SERVE-big-BENCH-1", "SERVE-big-BENCH-2",
                                        "SERVE-small-BENCH-1", "SERVE-small-BENCH-2"}
    assert spec.override_keys == ["scheduler.max_num_batched_tokens"]


def test_common_random_numbers_and_override_order():
    spec = parse_spec(spec2(overrides={"workload.num_prompts": 7,
                                       "scheduler.max_num_batched_tokens": 999}), "sw.yaml")
    p = next(x for x in spec.points() if x.arm == "small" and x.seed == 2 and x.rate == 2)
    tree = build_tree(spec.base_tree, p.overrides, p.seed, p.rate)
    # arm overrides win over global overrides; the sweep sets seed and rate last
    assert tree["scheduler"]["max_num_batched_tokens"] == 64
    assert tree["workload"] == {"num_prompts": 7, "input_len": 64, "output_len": 8,
                                "request_rate": 2.0, "seed": 2}
    q = next(x for x in spec.points() if x.arm == "big" and x.seed == 2 and x.rate == 2)
    assert build_tree(spec.base_tree, q.overrides, q.seed, q.rate)["workload"] == tree["workload"]


def test_grid_num_seeds_inf_rate_and_baseline():
    spec = parse_spec({"base": BASE, "grid": {"scheduler.max_num_seqs": [8, 16],
                                              "scheduler.policy": ["fcfs"]},
                       "num_seeds": 4, "request_rates": ["inf", 0.5],
                       "baseline": "max_num_seqs=16,policy=fcfs"}, "g.yaml")
    assert [a.name for a in spec.arms] == ["max_num_seqs=16,policy=fcfs",
                                           "max_num_seqs=8,policy=fcfs"]
    assert spec.seeds == [0, 1, 2, 3]
    assert spec.rates[0] == math.inf
    labels = sorted({p.rate_label for p in spec.points()})
    assert labels == ["0.5", "inf"]
    # finite rates sort before inf
    assert spec.points()[0].rate == 0.5


def test_no_arms_uses_base_rate_label():
    spec = parse_spec({"base": {"workload": {"request_rate": 3}}}, "b.yaml")
    (p,) = spec.points()
    assert p.arm == "base" and p.dirname == "SERVE-base-BENCH-3" and p.seed == 0


def test_base_path_relative_to_sweep_file(tmp_path):
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs" / "base.yaml").write_text(yaml.safe_dump(BASE))
    (tmp_path / "sweeps").mkdir()
    p = write_spec(tmp_path / "sweeps", {"base": "../cfgs/base.yaml", "seeds": [3]})
    spec = load_spec(p)
    assert spec.base_tree == BASE and spec.experiment_name == "sw"


@pytest.mark.parametrize("bad, needle", [
    ({"arms": {"a": {"scheduler.max_num_seqs": "lots"}}},
     "arms.a at request_rate 1: scheduler.max_num_seqs"),
    ({"arms": {"a": {"scheduler.no_such_key": 1}}}, "scheduler.no_such_key: unknown key"),
    ({"arms": {"a": {"max_num_seqs": 1}}}, "arms.a.max_num_seqs: override key"),
    ({"arms": {"a/b": {}}}, "arms.a/b: arm names must be file-name-safe"),
    ({"arms": {"a": ["scheduler.max_num_seqs"]}}, "arms.a[0]: expected 'section.key=value'"),
    ({"arms": []}, "arms: expected a non-empty mapping"),
    ({"grid": {"scheduler.max_num_seqs": []}}, "grid.scheduler.max_num_seqs: expected a non-empty"),
    ({"seeds": [1, 1]}, "seeds: duplicate"),
    ({"seeds": [0], "num_seeds": 2}, "seeds: give either"),
    ({"num_seeds": 0}, "num_seeds: expected a positive integer"),
    ({"request_rates": [1, -2]}, "request_rates[1]: expected a positive number"),
    ({"request_rates": [1, 1.0]}, "request_rates: duplicate"),
    ({"overrides": {"workload.seed": 3}}, "overrides.workload.seed: the sweep sets"),
    ({"arms": {"a": {"workload.request_rate": 3}}}, "arms.a.workload.request_rate: conflicts"),
    ({"baseline": "nope"}, "baseline: 'nope' is not an arm"),
    ({"experiment_name": "a b"}, "experiment_name: expected a file-name-safe"),
    ({"bogus": 1}, "bogus: unknown key"),
    ({"base": "missing.yaml"}, "base: config file 'missing.yaml' not found"),
    ({"overrides": {"workload.input_len": -1}}, "overrides: workload.input_len"),
    ({"arms": {"a": {"scheduler.policy": "nope"}}},
     "arms.a at request_rate 1: scheduler.policy: unknown name 'nope'"),
    ({"arms": {"a": {"scheduler.max_num_batched_tokens": 8}}},
     "arms.a at request_rate 1: scheduler.max_num_batched_tokens (8) must be greater"),
])
def test_validation_errors_are_one_line_and_named(tmp_path, bad, needle):
    spec = {**spec2(), **bad}
    if "num_seeds" in bad and "seeds" not in bad:
        del spec["seeds"]
    p = write_spec(tmp_path, spec)
    with pytest.raises(ConfigError) as ei:
        load_spec(p)
    msg = str(ei.value)
    assert "\n" not in msg
    assert msg.startswith(str(p)), msg
    assert needle in msg, msg


def test_invalid_base_names_base_file(tmp_path):
    (tmp_path / "base.yaml").write_text("scheduler:\n  max_num_seqs: x\n")
    p = write_spec(tmp_path, {"base": "base.yaml"})
    with pytest.raises(ConfigError, match=r"base\.yaml: scheduler\.max_num_seqs"):
        load_spec(p)


def test_cli_exit_2_on_bad_spec(tmp_path, capsys):
    from servesim.simulator.cli import main

    p = write_spec(tmp_path, {**spec2(), "seeds": "zero"})
    with pytest.raises(SystemExit) as ei:
        main(["sweep", str(p), "-o", str(tmp_path / "out"), "--quiet"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "seeds: expected a non-empty list" in err
    assert len(err.strip().splitlines()) == 1


# --- running (fake points) ---------------------------------------------------------------------


def _run(tmp_path, name, **kw):
    spec = parse_spec(spec2(), "sw.yaml")
    return spec, run_sweep(spec, tmp_path / name, point_fn=fake_point, **kw)


def test_layout_and_records(tmp_path):
    _spec, out = _run(tmp_path, "o", jobs=2)
    exp = tmp_path / "o" / "exp"
    assert out.num_run == 12 and out.num_failed == 0 and out.num_skipped == 0
    run = json.loads((exp / "SERVE-small-BENCH-2" / "run=1.json").read_text())
    assert run["run_number"] == 1 and run["seed"] == 1 and run["arm"] == "small"
    assert run["scheduler.max_num_batched_tokens"] == 64 and run["request_rate"] == 2.0
    assert "wall_seconds" not in run and "date" in run
    summ = json.loads((exp / "SERVE-small-BENCH-2" / "summary.json").read_text())
    assert [r["run_number"] for r in summ] == [0, 1, 2]
    lines = (exp / "summary.csv").read_text().splitlines()
    assert len(lines) == 13
    header = lines[0].split(",")
    assert header[:5] == ["arm", "request_rate", "seed", "run_number",
                          "scheduler.max_num_batched_tokens"]
    assert "date" not in header and "latencies" not in header and "mean_ttft_ms" in header
    assert lines[1].startswith("big,1.0,0,0,2048,")
    assert (exp / "ab.csv").is_file()
    ttft = [r for r in out.ab_rows if r["metric"] == "mean_ttft_ms"]
    assert {r["verdict"] for r in ttft} == {"B worse"}  # planted +200 ms
    assert not list(exp.rglob("*.tmp"))


def test_resume_reruns_only_missing_points_and_matches(tmp_path):
    _, _full = _run(tmp_path, "full", jobs=2)
    _, part = _run(tmp_path, "part", jobs=2, max_points=5)  # "interrupted" after 5 points
    assert part.num_run == 5
    with pytest.raises(ConfigError, match="pass --resume"):
        _run(tmp_path, "part", jobs=2)
    _, rest = _run(tmp_path, "part", jobs=2, resume=True)
    assert rest.num_skipped == 5 and rest.num_run == 7
    a = (tmp_path / "full" / "exp" / "summary.csv").read_bytes()
    b = (tmp_path / "part" / "exp" / "summary.csv").read_bytes()
    assert a == b
    _, again = _run(tmp_path, "part", jobs=1, resume=True)
    assert again.num_run == 0 and again.num_skipped == 12


def test_resume_reruns_points_whose_definition_changed(tmp_path):
    spec = parse_spec(spec2(), "sw.yaml")
    run_sweep(spec, tmp_path, point_fn=fake_point, jobs=1)
    spec_b = parse_spec(spec2(arms={"big": {"scheduler.max_num_batched_tokens": 2048},
                                    "small": {"scheduler.max_num_batched_tokens": 32}}),
                        "sw.yaml")
    out = run_sweep(spec_b, tmp_path, point_fn=fake_point, jobs=1, resume=True)
    assert out.num_skipped == 6 and out.num_run == 6


def test_failures_are_recorded_and_retried_on_resume(tmp_path):
    s = spec2(arms={"ok": {}, "bad": {"workload.num_prompts": 13}})
    spec = parse_spec(s, "sw.yaml")
    out = run_sweep(spec, tmp_path, point_fn=fake_point, jobs=2)
    assert out.num_failed == 6
    fail = json.loads((tmp_path / "exp" / "SERVE-bad-BENCH-1" / "run=0.failure.json")
                      .read_text())
    assert fail["error"] == "RuntimeError: unlucky num_prompts"
    assert len(out.rows) == 6 and out.ab_rows == []  # no pairs for the failed arm
    out2 = run_sweep(spec, tmp_path, point_fn=fake_point, jobs=1, resume=True)
    assert out2.num_run == 6 and out2.num_skipped == 6


def test_bootstrap_intervals_written_to_ab_csv(tmp_path):
    import csv

    from servesim.reports.ab import mean_ci

    spec = parse_spec(spec2(), "sw.yaml")
    out = run_sweep(spec, tmp_path, point_fn=fake_point, jobs=1, ab_method="bootstrap")
    rows = list(csv.DictReader((tmp_path / "exp" / "ab.csv").open()))
    assert rows and {r["method"] for r in rows} == {"bootstrap"}
    r = next(r for r in out.ab_rows if r["metric"] == "mean_ttft_ms" and r["request_rate"] == 1)
    by = {(x["arm"], x["seed"]): x["mean_ttft_ms"] for x in out.rows if x["request_rate"] == 1}
    d = [by[("small", s)] - by[("big", s)] for s in (0, 1, 2)]
    assert (r["diff"], r["ci_low"], r["ci_high"]) == mean_ci(d, method="bootstrap")


def test_resume_reruns_points_whose_resolved_inputs_changed(tmp_path, monkeypatch):
    """The spec is the same, but what its points resolve to is not: a drop-in config.json
    edited, a user calibration file added, other servesim code (a default or a formula
    changed). Such points are rerun, not reused (their hash covered only the raw tree)."""
    from servesim.simulator.experiments import points

    model = tmp_path / "m" / "config.json"
    model.parent.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "torch_dtype": "bfloat16", "hidden_size": 1024, "intermediate_size": 4096,
           "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 4,
           "vocab_size": 1000, "max_position_embeddings": 8192}
    model.write_text(json.dumps(cfg))
    monkeypatch.setenv("SERVESIM_CALIBRATION_DIR", str(tmp_path / "cal"))
    s = spec2(base={**BASE, "model": {"name": str(model)}}, request_rates=[1])
    out = tmp_path / "out"

    def resumed():
        return run_sweep(parse_spec(s, "sw.yaml"), out, point_fn=fake_point, jobs=1,
                         resume=True)

    assert run_sweep(parse_spec(s, "sw.yaml"), out, point_fn=fake_point, jobs=1).num_run == 6
    assert (resumed().num_run, resumed().num_skipped) == (0, 6)
    model.write_text(json.dumps({**cfg, "num_hidden_layers": 8}))
    assert resumed().num_run == 6
    (tmp_path / "cal").mkdir()
    (tmp_path / "cal" / "a100-sxm4-80gb.yaml").write_text("gpu: a100-sxm4-80gb\n")
    assert resumed().num_run == 6
    assert resumed().num_run == 0
    monkeypatch.setattr(points, "code_hash", lambda: "another version")
    assert resumed().num_run == 6
    assert resumed().num_run == 0


def test_inputs_hash_sees_resolved_defaults_not_spelling():
    """Two spellings of one resolved config hash alike; a value equal to a default only when
    unset (gpu_memory_utilization 0.92 written out) hashes as the unset tree; 0.9 does not."""
    from servesim.simulator.experiments.points import inputs_hash

    base = {"workload": {"num_prompts": 5}}
    assert inputs_hash(base) == inputs_hash({**base, "cache": {"gpu_memory_utilization": 0.92}})
    assert inputs_hash(base) != inputs_hash({**base, "cache": {"gpu_memory_utilization": 0.9}})
    assert inputs_hash({"model": {"name": "nope"}}) != inputs_hash({"model": {"name": "nop"}})


def test_inputs_hash_covers_the_draft_model_not_where_files_live(tmp_path, monkeypatch):
    """A draft model's config.json is an input (editing it changes the hash); the shipped
    model and GPU files read from another folder with the same bytes (another checkout or
    install) hash alike; a file name that cannot be a path (NUL byte) hashes as the point's
    error instead of crashing the sweep."""
    import shutil

    from servesim.costmodels import specs
    from servesim.simulator.experiments.points import inputs_hash

    draft = tmp_path / "draft.json"
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "torch_dtype": "bfloat16", "hidden_size": 1024, "intermediate_size": 4096,
           "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 4,
           "vocab_size": 128256, "max_position_embeddings": 131072}
    draft.write_text(json.dumps(cfg))
    tree = {"hardware": {"name": "h100-sxm"}, "workload": {"num_prompts": 5},
            "speculative_config": {"method": "draft_model", "model": str(draft),
                                   "num_speculative_tokens": 3, "acceptance": {"rate": 0.6}}}
    before = inputs_hash(tree)
    assert before != inputs_hash({**tree, "speculative_config": None})
    draft.write_text(json.dumps({**cfg, "num_hidden_layers": 16}))
    assert inputs_hash(tree) != before

    plain = {"workload": {"num_prompts": 5}}
    here = inputs_hash(plain)
    moved = tmp_path / "configs"
    shutil.copytree(specs.configs_dir(), moved)
    monkeypatch.setattr(specs, "configs_dir", lambda: moved)
    assert inputs_hash(plain) == here

    assert len(inputs_hash({"hardware": {"calibration": "cal\0.yaml"}})) == 16


def test_top_level_engine_flags_are_sweepable(tmp_path):
    """-O, --performance-mode and --cpu-offload-gb are top-level keys: arms may set them (a
    'section.key' path is required otherwise)."""
    spec = parse_spec(spec2(arms={"O0": {"optimization_level": 0},
                                  "offload": ["cpu_offload_gb=2"]}), "sw.yaml")
    pts = {p.arm: p for p in spec.points() if p.seed == 0 and p.rate == 1}
    assert build_tree(spec.base_tree, pts["O0"].overrides, 0, 1)["optimization_level"] == 0
    assert build_tree(spec.base_tree, pts["offload"].overrides, 0, 1)["cpu_offload_gb"] == 2
    with pytest.raises(ConfigError, match="must be a dotted path 'section.key' or one of "
                       "optimization_level, performance_mode, cpu_offload_gb"):
        parse_spec(spec2(arms={"x": {"max_num_seqs": 4}}), "sw.yaml")
