"""kind: profile — inference-perf, GuideLLM and AIPerf / genai-perf load profiles (fixtures
written from each tool's documented config schema; no network, no tokenizer)."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import yaml
from servesim.simulator.errors import ConfigError
from servesim.workloads import build_workload
from servesim.workloads.config import ProfileWorkload
from servesim.workloads.profiles import detect_format, load_document, read_profile

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "configs" / "profiles"

IP_TWO_STAGE = {
    "api": {"type": "completion", "streaming": True},
    "data": {"type": "shared_prefix", "shared_prefix": {
        "num_groups": 3, "num_prompts_per_group": 4, "seed": 11,
        "system_prompt_len": {"type": "normal", "mean": 300, "std_dev": 50, "min": 100,
                              "max": 500},
        "question_len": {"type": "uniform", "min": 50, "max": 150},
        "output_len": 32}},
    "load": {"type": "constant", "interval": 2, "request_timeout": 45,
             "stages": [{"rate": 3, "duration": 10}, {"rate": 5, "duration": 6}]},
}


def _write(tmp_path, name, doc):
    p = tmp_path / name
    p.write_text(json.dumps(doc) if name.endswith(".json") else yaml.safe_dump(doc))
    return p


def _workload(path, **kw):
    return build_workload(ProfileWorkload(path=str(path), **kw), block_size=16)


def test_inference_perf_two_stage_shared_prefix_order_and_counts(tmp_path):
    p = _write(tmp_path, "ip.yaml", IP_TWO_STAGE)
    wl = _workload(p)
    reqs = list(wl)
    plan = wl.meta["stages"]
    # per-stage counts: int(rate * duration), as inference-perf's run_stage sends
    stages = np.array([r.extra["stage"] for r in reqs])
    assert [(stages == k).sum() for k in (0, 1)] == [30, 30]
    assert [st["gap_s"] for st in plan] == [0.0, 3.0]  # interval 2 + the timer's 1-s head start
    assert wl.meta["client"] == {"request_timeout_s": 45.0}
    # lengths: inference-perf's numpy draws from default_rng(seed), group by group
    rng = np.random.default_rng(11)
    sys_len = np.clip(np.round(np.clip(rng.normal(300, 50, 3), 100, 500)), 100, 500).astype(int)
    expect = []
    for g in range(3):
        q = np.clip(np.round(np.clip(rng.uniform(50, 151, 4), 50, 150)), 50, 150).astype(int)
        rng.uniform(0, 1, 0)  # (fixed output lengths draw nothing)
        expect += [(int(sys_len[g] + x), 32) for x in q]
    n = 12
    s0 = [r for r in reqs if r.extra["stage"] == 0]
    s1 = [r for r in reqs if r.extra["stage"] == 1]
    table = [(r.prompt_len, r.output_len) for r in s0[:n]]
    assert sorted(table) == sorted(expect)
    # rotation: request j of a stage uses entry j mod (groups x prompts); each stage restarts
    for st in (s0, s1):
        for j, r in enumerate(st):
            assert (r.prompt_len, r.output_len) == table[j % n]
            assert r.prefix_block_ids == s0[j % n].prefix_block_ids
    # shared prefix: one id chain per group (its system prompt's full blocks)
    groups = {r.prefix_block_ids for r in s0[:n]}
    assert len(groups) == 3
    assert sorted(len(g) for g in groups) == sorted(int(x) // 16 for x in sys_len)
    # arrivals: the last request of a constant stage goes out at exactly its duration
    assert s0[-1].arrival_s == pytest.approx(10.0)
    assert s1[-1].arrival_s - plan[1]["start_s"] == pytest.approx(6.0)


def test_inference_perf_profile_runs_with_stage_counts_in_requests_csv(tmp_path):
    from servesim.simulator.config import load_config, resolve_config
    from servesim.simulator.runner import run_experiment

    p = _write(tmp_path, "ip.yaml", IP_TWO_STAGE)
    cfg = resolve_config(load_config(None, ["workload.kind=profile", f"workload.path={p}"]))
    r = run_experiment(cfg, resolved=True)
    st = r.requests["stage"]
    assert [(st == 0).sum(), (st == 1).sum()] == [30, 30]
    start1 = r.workload_meta["stage_windows"][1]["start_s"]
    assert start1 == pytest.approx(max(10.0, r.requests["finish_s"][st == 0].max()) + 3.0)
    assert r.requests["send_s"][st == 1].min() > start1
    assert r.workload_meta["request_timeout_s"] == 45.0


def test_inference_perf_random_and_concurrent(tmp_path):
    doc = {"data": {"type": "random",
                    "input_distribution": {"min": 10, "max": 400, "mean": 200, "std_dev": 50,
                                           "total_count": 7},
                    "output_distribution": {"min": 10, "max": 100, "mean": 50, "std_dev": 10,
                                            "total_count": 7}},
           "load": {"type": "concurrent", "base_seed": 5,
                    "stages": [{"num_requests": 10, "concurrency_level": 2}]}}
    wl = _workload(_write(tmp_path, "ip.yaml", doc))
    reqs = list(wl)
    assert len(reqs) == 10 and wl.meta["stages"][0]["closed"]
    rng = np.random.default_rng(5)
    ins = np.clip(np.round(np.clip(rng.normal(200, 50, 7), 10, 400)), 10, 400).astype(int)
    assert [r.prompt_len for r in reqs[:7]] == ins.tolist()
    assert [r.prompt_len for r in reqs[7:]] == ins[:3].tolist()  # data index mod total_count


def test_guidellm_scenario_stages_lengths_and_warmup():
    wl = _workload(PROFILES / "guidellm_concurrent.json")
    plan = wl.meta["stages"]
    assert [(st["concurrency"], st["num_requests"], st["closed"]) for st in plan] == \
        [(4, 80, True), (16, 80, True)]
    assert wl.meta["warmup"] == {"num_requests": 5}
    reqs = list(wl)
    # GuideLLM's IntegerRangeSampler: Python random.Random(seed) gauss, clipped and rounded;
    # the dataset is re-iterated per benchmark with seed + iteration
    rnd = random.Random(42)
    first = [round(max(256, min(2048, rnd.gauss(1024, 128)))) for _ in range(5)]
    assert [r.prompt_len - 256 for r in reqs[:5]] == first  # + the 256-token shared prefix
    assert all(r.output_len == 128 for r in reqs)
    rnd1 = random.Random(43)
    s1 = [r for r in reqs if r.extra["stage"] == 1]
    assert s1[0].prompt_len - 256 == round(max(256, min(2048, rnd1.gauss(1024, 128))))
    assert len({r.prefix_block_ids for r in reqs}) == 4  # prefix_count


def test_guidellm_flat_layout_and_sweep(tmp_path):
    flat = {"profile": "constant", "rate": [2, 4], "max_seconds": 10,
            "data": "prompt_tokens=256,output_tokens=64", "random_seed": 1}
    spec = read_profile(_write(tmp_path, "g.json", flat))
    assert [(s["rate"], s["duration_s"], s["grace_s"], s["arrivals"]) for s in spec.stages] == \
        [(2.0, 10.0, 0.0, "constant"), (4.0, 10.0, 0.0, "constant")]
    sweep = {"spec": {"profile": {"kind": "sweep", "sweep_size": 5},
                      "data": [{"kind": "synthetic_text", "prompt_tokens": 100,
                                "output_tokens": 10}],
                      "constraints": [{"kind": "max_requests", "count": 20}]}}
    p = _write(tmp_path, "s.json", sweep)
    spec = read_profile(p)
    assert [s["label"] for s in spec.stages] == ["synchronous", "throughput"]
    assert spec.notes  # the rates between need the measured ones
    spec = read_profile(p, sweep_rates=[1.5, 2.5, 3.5])
    assert [s.get("rate") for s in spec.stages] == [None, None, 1.5, 2.5, 3.5]


def test_aiperf_v2_phases_warmup_and_timeout():
    wl = _workload(PROFILES / "aiperf_warmup_profiling.yaml")
    plan = wl.meta["stages"]
    assert [(st["label"], st["warmup"], st["closed"]) for st in plan] == \
        [("warmup", True, True), ("profiling", False, False)]
    assert plan[1]["rate"] == 6.0 and plan[1]["concurrency"] == 64
    assert plan[1]["duration_s"] == 30.0 and plan[1]["grace_s"] == 30.0
    assert wl.meta["client"]["request_timeout_s"] == 120.0
    reqs = list(wl)
    assert sum(r.extra["stage"] == 0 for r in reqs) == 20
    lens = np.array([r.prompt_len for r in reqs])
    assert 450 < lens.mean() < 650


def test_genai_perf_and_flat_configs(tmp_path):
    spec = read_profile(PROFILES / "genai_perf_concurrency.yaml")
    assert spec.format == "genai-perf"
    assert [(s.get("num_requests"), s.get("concurrency"), s.get("warmup", False))
            for s in spec.stages] == [(10, 8, True), (100, 8, False)]
    flat = {"concurrency": 4, "request_count": 50, "warmup_request_count": 5,
            "synthetic_input_tokens_mean": 300, "synthetic_input_tokens_stddev": 0,
            "output_tokens_mean": 20, "num_prefix_prompts": 2, "prefix_prompt_length": 64}
    p = _write(tmp_path, "profile_export_genai_perf.json", {"input_config": flat})
    assert detect_format(load_document(p)) == "genai-perf"
    reqs = list(_workload(p))
    assert len(reqs) == 55 and {r.prompt_len for r in reqs} == {364}
    assert len({r.prefix_block_ids for r in reqs}) == 2


def test_bad_profiles_fail_with_one_line(tmp_path):
    with pytest.raises(ConfigError, match="not a known profile"):
        read_profile(_write(tmp_path, "x.yaml", {"hello": 1}))
    bad = {"load": {"type": "trace_replay", "stages": []}, "data": {"type": "random"}}
    with pytest.raises(ConfigError, match=r"load\.type: 'trace_replay' is not supported"):
        read_profile(_write(tmp_path, "ip.yaml", bad))
    with pytest.raises(ConfigError, match="no such profile file"):
        read_profile(tmp_path / "missing.yaml")


def test_stages_on_native_kinds_and_not_on_sessions():
    from servesim.workloads.config import RandomWorkload, SessionsWorkload

    wl = build_workload(RandomWorkload(num_prompts=5, stages=[
        {"rate": 2, "duration_s": 5}, {"concurrency": 2, "num_requests": 4}]), block_size=16)
    reqs = list(wl)
    assert [r.extra["stage"] for r in reqs] == [0] * 10 + [1] * 4
    assert wl.meta["num_prompts"] == 14
    with pytest.raises(ConfigError, match="sessions"):
        build_workload(SessionsWorkload(stages=[{"rate": 1, "duration_s": 2}]), block_size=16)


def test_trace_convert_writes_a_profiles_requests(tmp_path):
    from servesim.simulator.cli import app
    from typer.testing import CliRunner

    out = tmp_path / "ip.csv"
    r = CliRunner().invoke(app, ["trace", "convert", str(PROFILES / "inference_perf_shared_prefix"
                                                             ".yaml"), "-o", str(out)])
    assert r.exit_code == 0, r.output
    rows = out.read_text().splitlines()
    assert rows[0] == "arrival_s,prompt_len,output_len,prefix_block_ids,request_id"
    assert len(rows) == 1 + 40 + 80
