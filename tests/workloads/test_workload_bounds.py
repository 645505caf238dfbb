"""Generated workloads, stages and client profiles are bounded like trace files: times within
MAX_ARRIVAL_S, token lengths within MAX_TOKENS, request counts within MAX_REQUESTS; bad values
are one-line errors naming the key (and the profile file). Every input here is small: nothing
is run, and nothing could hang."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from servesim.simulator.config import load_yaml, validate_tree
from servesim.simulator.errors import ConfigError
from servesim.workloads import build_workload
from servesim.workloads.config import LognormalDist, ProfileWorkload
from servesim.workloads.generators import LengthSampler
from servesim.workloads.profiles import read_profile
from servesim.workloads.schema import MAX_ARRIVAL_S
from servesim.workloads.stages import StageControl, staged_requests

ROOT = Path(__file__).resolve().parents[2]
BASE = load_yaml(ROOT / "configs" / "llama8b_a100.yaml")
SRC = "cfg.yaml"


def _error(**workload) -> str:
    wl = {"kind": "random", "num_prompts": 20} if workload.get("kind") is None else {}
    tree = {**BASE, "workload": {**wl, **workload}}
    with pytest.raises(ConfigError) as e:
        validate_tree(tree, SRC)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(("workload", "expect"), [
    ({"stages": [{"concurrency": 2, "duration_s": float("inf")}]},
     "cfg.yaml: workload.stages.0.duration_s: input should be a finite number (got inf)"),
    ({"stages": [{"rate": 1, "duration_s": 10, "gap_s": float("inf")}]},
     "cfg.yaml: workload.stages.0.gap_s: input should be a finite number (got inf)"),
    ({"stages": [{"rate": 1, "duration_s": 10}, {"rate": 1, "duration_s": 10, "gap_s": 99999999}]},
     ("cfg.yaml: workload.stages: the stages span 100000019 s (gaps, durations, num_requests / "
     "rate), longer than the longest run (1e+08 s) (got [")),
    ({"stages": [{"rate": 1e9, "duration_s": 1e7}]},
     ("cfg.yaml: workload.stages.0: rate × duration_s = 1e+16 requests, more than 1e+08 in one "
     "stage")),
    ({"stages": [{"rate": 0.01, "duration_s": 10}]},
     ("cfg.yaml: workload.stages.0: rate × duration_s = 0.01 × 10 rounds to 0 requests "
     "(int(rate·duration_s)); raise rate or duration_s, or give num_requests")),
    ({"stages": [{"rate": 1e-300, "num_requests": 5}]},
     ("cfg.yaml: workload.stages.0.rate: expected inf or a rate of at least 1e-08/s (one request "
     "per 1e+08 s, the longest run) (got 1e-300)")),
    ({"stages": []},
     ("cfg.yaml: workload.stages: an empty list has no stage: list at least one, or leave stages "
     "out for an unstaged run (got [])")),
    ({"stages": [{"rate": 1, "duration_s": 10, "warmup": True}]},
     ("cfg.yaml: workload.stages: every stage is warm-up (warmup: true): nothing would be "
     "measured")),
    ({"stages": [{"rate": 1, "duration_s": 10}], "warmup": {"duration_s": 20}},
     ("cfg.yaml: workload.warmup: warmup {duration_s: 20} covers every measured stage whole "
     "(warm-up applies to the leading requests of each stage): nothing would be measured")),
    ({"warmup": {"num_requests": 20}},
     ("cfg.yaml: workload: warmup.num_requests (20) covers all 20 requests: nothing would "
     "be measured")),
    ({"request_rate": 10, "warmup": {"duration_s": 5}},
     ("cfg.yaml: workload: warmup.duration_s (5 s) covers the whole run (the last request "
     "is sent at 2 s): nothing would be measured")),
    ({"request_rate": 1e-300},
     "cfg.yaml: workload.request_rate: expected inf or a rate of at least 1e-08/s"),
    ({"request_rate": 1e-7, "num_prompts": 100},
     ("cfg.yaml: workload: num_prompts / request_rate = 1e+09 s, longer than the longest "
     "run (1e+08 s); raise the rate")),
    ({"ramp_up_strategy": "linear", "ramp_up_start_rps": 1, "ramp_up_end_rps": float("inf")},
     "cfg.yaml: workload.ramp_up_end_rps: input should be a finite number (got inf)"),
    ({"ramp_up_strategy": "linear", "ramp_up_start_rps": float("inf"),
      "ramp_up_end_rps": float("inf")},
     "cfg.yaml: workload.ramp_up_start_rps: input should be a finite number (got inf)"),
])
def test_generated_workload_bounds(workload, expect):
    assert _error(**workload).startswith(expect)


@pytest.mark.parametrize(("workload", "expect"), [
    ({"system_prompt_len": 10**12},
     "cfg.yaml: workload.system_prompt_len: input should be less than or equal to 2147483647"),
    ({"turns": 0}, "cfg.yaml: workload.turns: a session has at least 1 turn (got 0)"),
    ({"turns": "1e9x"},
     ("cfg.yaml: workload.turns: expected a number or a distribution {dist: fixed|uniform|"
     "lognormal|exponential|empirical, ...} (got '1e9x')")),
    ({"first_input": {"dist": "uniform", "low": 1, "high": 1e12}},
     "cfg.yaml: workload.first_input: high: 1e+12 is more than 2147483647 tokens"),
    ({"think_time_s": {"dist": "exponential", "mean": 1e300}},
     "cfg.yaml: workload.think_time_s: mean: 1e+300 is more than 1e+08 s"),
    ({"think_time_s": "inf"},
     "cfg.yaml: workload.think_time_s.fixed.value: input should be a finite number (got inf)"),
    ({"session_rate": 1e-300},
     "cfg.yaml: workload.session_rate: expected inf or a rate of at least 1e-08/s"),
])
def test_sessions_bounds(workload, expect):
    assert _error(kind="sessions", num_sessions=5, **workload).startswith(expect)


def test_number_strings_are_the_fixed_shorthand():
    """YAML 1.1 reads ``1e3`` as a string: it is the number shorthand all the same."""
    tree = {**BASE, "workload": {"kind": "sessions", "num_sessions": 2, "turns": "1e3"}}
    assert validate_tree(tree, SRC).workload.turns.value == 1000


def test_huge_sigma_think_times_are_clipped():
    x = LengthSampler(LognormalDist(median=1, sigma=1000), np.random.default_rng(0),
                      integer=False).sample(1000)
    assert np.isfinite(x).all() and x.max() <= MAX_ARRIVAL_S
    n = LengthSampler(LognormalDist(median=100, sigma=1000), np.random.default_rng(0)).sample(100)
    assert n.max() <= 2**31 - 1


def test_closed_stage_of_zero_requests_sends_none():
    plan = [{"index": 0, "closed": True, "num_requests": 0, "start_s": 0.0}]
    gen = staged_requests(plan, 0, lambda k: iter(()), StageControl())
    assert list(itertools.islice(gen, 5)) == []


# --------------------------------------------------------------------------------------------
# profiles

GL = {"spec": {"profile": {"kind": "concurrent", "streams": [2]},
               "data": [{"kind": "synthetic_text", "prompt_tokens": 64, "output_tokens": 8}],
               "constraints": [{"kind": "max_requests", "count": 10}]}}
IP = {"data": {"type": "shared_prefix", "shared_prefix": {
          "num_groups": 2, "num_prompts_per_group": 2, "system_prompt_len": 32,
          "question_len": 16, "output_len": 8}},
      "load": {"type": "constant", "request_timeout": 30,
               "stages": [{"rate": 2, "duration": 5}]}}
AI = {"schemaVersion": "2.0", "benchmark": {
    "dataset": {"type": "synthetic", "entries": 10, "isl": 64, "osl": 8},
    "phases": [{"name": "profiling", "type": "poisson", "rate": 2, "duration": "10s",
                "gracePeriod": "5s"}]}}
GP = {"perf_analyzer": {"stimulus": {"concurrency": 2},
                        "measurement": {"mode": "request_count", "num": 10}},
      "input": {"synthetic_tokens": {"mean": 64, "stddev": 0},
                "output_tokens": {"mean": 8, "stddev": 0}}}


def _patched(doc, path, value):
    doc = json.loads(json.dumps(doc))
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


def _profile_error(tmp_path, doc, build=False) -> str:
    """The error of reading (``build``: of building the workload of) profile ``doc``; values
    are checked when the profile is read, before any table of lengths is built."""
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump(doc))
    with pytest.raises(ConfigError) as e:
        if build:
            list(itertools.islice(build_workload(ProfileWorkload(path=str(p)), block_size=16), 5))
        else:
            read_profile(p)
    msg = str(e.value)
    assert "\n" not in msg
    return msg.removeprefix(f"{p}: ")


@pytest.mark.parametrize(("doc", "path", "value", "expect"), [
    (GL, ("spec", "constraints", 0, "count"), 0,
     "guidellm profile: constraints[0].count: expected a whole number > 0 and <= 1e+08, got 0"),
    (GL, ("spec", "constraints", 0), {"kind": "max_duration", "seconds": 1e300},
     "guidellm profile: constraints[0].seconds: expected a number > 0 and <= 1e+08, got 1e+300"),
    (GL, ("spec", "profile", "streams"), [0],
     "guidellm profile: profile.streams: expected a whole number > 0, got 0"),
    (GL, ("spec", "profile", "streams"), [-3],
     "guidellm profile: profile.streams: expected a whole number > 0, got -3"),
    (GL, ("spec", "data", 0, "prompt_tokens_min"), 4000,
     "guidellm profile: data.prompt_tokens_min 4000 > prompt_tokens_max"),
    (IP, ("load", "stages", 0, "rate"), float("nan"),
     "inference-perf profile: load.stages[0].rate: expected a number > 0, got nan"),
    (IP, ("load", "stages", 0, "rate"), -4,
     "inference-perf profile: load.stages[0].rate: expected a number > 0, got -4"),
    (IP, ("load", "stages", 0, "rate"), 1e12,
     ("inference-perf profile: load.stages[0]: rate × duration_s = 5e+12 requests, more than "
     "1e+08 in one stage")),
    (IP, ("load", "stages", 0, "duration"), 1e300,
     ("inference-perf profile: load.stages[0].duration: expected a number > 0 and <= 1e+08, "
     "got 1e+300")),
    (IP, ("load", "stages", 0, "duration"), 0.1,
     "inference-perf profile: load.stages[0]: rate × duration_s = 2 × 0.1 rounds to 0 requests"),
    (IP, ("load", "request_timeout"), 0,
     "inference-perf profile: load.request_timeout: expected a number > 0, got 0"),
    (IP, ("load", "request_timeout"), -1,
     "inference-perf profile: load.request_timeout: expected a number > 0, got -1"),
    (IP, ("data", "shared_prefix", "output_len"), "abc",
     "inference-perf profile: data.shared_prefix.output_len: expected a number, got 'abc'"),
    (IP, ("data", "shared_prefix", "num_groups"), 0,
     "inference-perf profile: data.shared_prefix.num_groups: expected a whole number > 0, got 0"),
    (IP, ("data", "shared_prefix", "num_groups"), 1e11,
     ("inference-perf profile: data.shared_prefix: num_groups × num_prompts_per_group = 2e+11 "
     "prompts, more than 1e+06")),
    (IP, ("data", "shared_prefix", "system_prompt_len"), 10**12,
     ("inference-perf profile: data.shared_prefix.system_prompt_len: expected a whole number >= 0 "
     "and <= 2147483647, got 1000000000000")),
    (AI, ("benchmark", "phases", 0, "rate"), 0,
     "aiperf profile: benchmark.phases[0].rate: expected a number > 0, got 0"),
    (AI, ("benchmark", "phases", 0, "gracePeriod"), "-5s",
     ("aiperf profile: benchmark.phases[0].grace_period: expected a number >= 0 and <= 1e+08, "
     "got '-5s'")),
    (AI, ("benchmark", "phases", 0, "duration"), "99999999999h",
     ("aiperf profile: benchmark.phases[0].duration: expected a number > 0 and <= 1e+08, "
     "got '99999999999h'")),
    (GP, ("perf_analyzer", "measurement", "num"), -1,
     "genai-perf profile: request_count: expected a whole number > 0 and <= 1e+08, got -1"),
    (GP, ("perf_analyzer", "stimulus", "concurrency"), 0,
     "genai-perf profile: concurrency: expected a whole number > 0, got 0"),
])
def test_profile_bounds(tmp_path, doc, path, value, expect):
    assert _profile_error(tmp_path, _patched(doc, path, value)).startswith(expect)


def test_profile_warmup_covering_every_stage(tmp_path):
    doc = _patched(GL, ("spec", "profile", "warmup"), {"value": 1000000000, "mode": "requests"})
    assert _profile_error(tmp_path, doc, build=True) == (
        "guidellm profile: warmup {num_requests: 1000000000} covers every measured stage whole "
        "(warm-up applies to the leading requests of each stage): nothing would be measured")


@pytest.mark.parametrize("select", [[5], [-1], []])
def test_guidellm_benchmark_selection_names_the_available_ones(tmp_path, select):
    p = tmp_path / "g.json"
    p.write_text(json.dumps(GL))
    with pytest.raises(ConfigError) as e:
        read_profile(p, benchmarks=select)
    assert str(e.value) == (f"{p}: guidellm profile: benchmarks: {select} selects no benchmark "
                            "or one that does not exist (the profile has 1: indices 0..0)")


def test_valid_small_profiles_still_build(tmp_path):
    for name, doc in (("g.json", GL), ("i.yaml", IP), ("a.yaml", AI), ("p.yaml", GP)):
        p = tmp_path / name
        p.write_text(json.dumps(doc) if name.endswith(".json") else yaml.safe_dump(doc))
        reqs = list(itertools.islice(build_workload(ProfileWorkload(path=str(p)),
                                                    block_size=16), 50))
        assert reqs and all(1 <= r.prompt_len <= 200 for r in reqs)


def test_a_request_rate_beside_stages_is_said_to_be_unused():
    """Stages replace the arrival process: a request_rate set beside them (the example
    config's 12 req/s, say) was silently ignored; now a warning says so (none for inf)."""
    import warnings

    from servesim.simulator.config import load_config

    stages = "workload.stages=[{rate: 2, duration_s: 10}]"
    with pytest.warns(UserWarning, match=r"workload.request_rate 12.0 is not used: the stages "
                      r"set each stage's load"):
        load_config(None, ["workload.request_rate=12", stages])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(None, ["workload.request_rate=inf", stages])
