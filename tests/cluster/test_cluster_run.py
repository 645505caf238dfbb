"""Cluster runs end to end (simulator/cluster/runner.py): equivalence with the single engine,
config resolution per group, results, and the Mooncake comparison of routers."""

import csv
import io
import os
from pathlib import Path

import numpy as np
import pytest
from servesim.simulator.config import load_config, resolve_config, validate_tree
from servesim.simulator.errors import ConfigError
from servesim.simulator.runner import run_experiment

ROOT = Path(__file__).resolve().parents[2]
# ../shared/traces beside the repository (absent in a fresh clone: the test skips);
# SERVESIM_SHARED_TRACES points elsewhere (a worktree's checkout).
TRACES = Path(os.environ.get("SERVESIM_SHARED_TRACES", ROOT.parent / "shared" / "traces"))
MOONCAKE = TRACES / "mooncake_conversation.jsonl"

BASE = {"model": {"name": "llama-3.1-8b", "max_model_len": 8192},
        "hardware": {"name": "h100-sxm"},
        "workload": {"kind": "random", "num_prompts": 150, "input_len": 1024, "output_len": 64,
                     "range_ratio": 0.5, "prefix_len": 256, "request_rate": 30, "seed": 3}}


def cfg_of(tree):
    return resolve_config(validate_tree(tree, "test"))


def test_plain_config_has_no_cluster_keys_and_no_cluster_outputs(tmp_path):
    from servesim.reports import write_run

    cfg = cfg_of(dict(BASE))
    assert "cluster" not in cfg.to_yaml() and "kv_offload" not in cfg.to_yaml()
    dumped = cfg.model_dump(mode="json")
    dumped.pop("cluster")
    dumped["cache"].pop("kv_offload")
    dumped["cache"].pop("kv_cache_memory_bytes")
    dumped["cache"].pop("memory_profiler_estimate_cudagraphs")
    # (as the other extension keys left at their defaults: client timeouts, load stages)
    dumped.pop("client")
    dumped.pop("speculative_config")
    dumped.pop("lora")
    dumped["workload"].pop("stages")
    dumped["workload"].pop("warmup")
    dumped.pop("optimization_level")  # (vLLM's -O2 and balanced performance mode)
    dumped.pop("performance_mode")
    dumped.pop("cpu_offload_gb")
    dumped["scheduler"].pop("max_num_partial_prefills")
    dumped["scheduler"].pop("max_long_partial_prefills")
    dumped["scheduler"].pop("stream_interval")
    dumped["frontend"].pop("stream_chunk_s")
    dumped["output"].pop("metadata")
    assert dumped == cfg.dump_tree(mode="json")
    res = run_experiment(cfg, resolved=True)
    assert res.instances == [] and res.extras == {} and res.files == {}
    bench = write_run(res, tmp_path / "run")
    assert not any(k.startswith(("cluster", "cpu_")) for k in bench)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "config.resolved.yaml", "requests.csv", "result.json", "run_info.json", "timeseries.csv"]


def test_one_instance_cluster_equals_the_single_engine():
    """The cluster path runs the same engine: one instance behind any router gives the same
    requests (every column) and ITLs as the single-engine run (engine only: cluster runs do
    not model the API-server frontend yet)."""
    single = run_experiment(cfg_of(dict(BASE, frontend={"enable": False})), resolved=True)
    tree = dict(BASE, cluster={"instances": [{"name": "one"}], "router": {"policy": "round_robin"}})
    clus = run_experiment(cfg_of(tree), resolved=True)
    for k, v in single.requests.items():
        a, b = np.asarray(v), np.asarray(clus.requests[k])
        if a.dtype.kind == "f":
            np.testing.assert_array_equal(a, b, err_msg=k)
        else:
            assert list(a) == list(b), k
    np.testing.assert_array_equal(single.itl_values, clus.itl_values)
    np.testing.assert_array_equal(single.itl_counts, clus.itl_counts)
    assert single.counters["prefix_cache_hits"] == clus.counters["prefix_cache_hits"]
    for k, v in single.steps.items():
        np.testing.assert_array_equal(v, clus.steps[k], err_msg=k)


def test_groups_resolve_with_their_own_hardware_defaults():
    tree = dict(BASE, cluster={"instances": [
        {"name": "h100", "replicas": 1},
        {"name": "a100", "replicas": 2, "hardware": {"name": "a100-sxm4-80gb"},
         "scheduler": {"max_num_seqs": 128}}]})
    cfg = cfg_of(tree)
    h, a = cfg.cluster.instances
    assert h.scheduler["max_num_seqs"] == 1024 and h.scheduler["max_num_batched_tokens"] == 8192
    assert a.scheduler["max_num_seqs"] == 128 and a.scheduler["max_num_batched_tokens"] == 2048
    assert a.hardware.name == "a100-sxm4-80gb"
    assert resolve_config(cfg) == cfg  # a resolved config resolves to itself
    res = run_experiment(cfg, resolved=True)
    assert res.extras["num_gpus"] == 3
    assert res.extras["gpu"] == "a100-sxm4-80gb+h100-sxm"
    assert [n for n, _ in res.instances] == ["h100-0", "a100-0", "a100-1"]
    assert sum(i["requests_routed"] for i in res.extras["cluster_instances"]) == 150
    assert len(res.requests["finished_reason"]) == 150


@pytest.mark.parametrize("cluster,match", [
    ({"instances": [{"name": "p", "role": "prefill"}]}, "role: decode"),
    ({"instances": [{"name": "a"}, {"name": "a"}]}, "unique"),
    ({"instances": [{"name": "a"}, {"name": "b", "cache": {"block_size": 32}}]},
     "block_size"),
    ({"instances": [{"name": "a/b"}]}, "folder"),
    ({"instances": [{"name": "a"}], "router": {"policy": "nope"}}, "unknown name 'nope'"),
])
def test_cluster_config_errors(cluster, match):
    with pytest.raises(ConfigError, match=match):
        run_experiment(cfg_of(dict(BASE, cluster=cluster)), resolved=True)


def test_session_affinity_keeps_every_turn_on_one_instance():
    tree = {"model": {"name": "llama-3.1-8b", "max_model_len": 8192},
            "hardware": {"name": "h100-sxm"},
            "workload": {"kind": "sessions", "num_sessions": 30, "session_rate": 5,
                         "turns": {"dist": "fixed", "value": 3}, "seed": 1},
            "cluster": {"instances": [{"name": "v", "replicas": 3}],
                        "router": {"policy": "session_affinity"}}}
    res = run_experiment(cfg_of(tree), resolved=True)
    rows = list(csv.DictReader(io.StringIO(res.files["routing.csv"])))
    sid = dict(zip(res.requests["request_id"], range(len(res.requests["request_id"]))))
    assert len(rows) == 90 and len(sid) == 90
    homes: dict[str, set] = {}
    for r in rows:  # request ids of the sessions workload: "<session>-<turn>"
        homes.setdefault(r["request_id"].rsplit("-", 1)[0], set()).add(r["instance"])
    assert len(homes) == 30 and all(len(v) == 1 for v in homes.values())
    assert len({next(iter(v)) for v in homes.values()}) == 3


def test_shipped_cluster_configs_load():
    for name in ("cluster_pd_llama70b_h100.yaml", "cluster_prefix_router_llama8b.yaml"):
        cfg = resolve_config(load_config(ROOT / "configs" / name))
        assert cfg.cluster is not None


@pytest.mark.skipif(not MOONCAKE.is_file(), reason="shared/traces is absent")
def test_mooncake_prefix_aware_beats_round_robin():
    """First 2,000 Mooncake conversation requests on 4 × Llama-3.1-8B / H100."""
    tree = {"model": {"name": "llama-3.1-8b"}, "hardware": {"name": "h100-sxm"},
            "workload": {"kind": "trace", "path": str(MOONCAKE), "max_requests": 2000},
            "cluster": {"instances": [{"name": "vllm", "replicas": 4}],
                        "router": {"policy": "round_robin"}}}
    from servesim.reports.bench_result import compute_bench_result

    out = {}
    for policy in ("round_robin", "prefix_aware"):
        tree["cluster"]["router"]["policy"] = policy
        out[policy] = compute_bench_result(run_experiment(cfg_of(tree), resolved=True))
    rr, pa = out["round_robin"], out["prefix_aware"]
    assert pa["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"]
    assert pa["mean_ttft_ms"] < rr["mean_ttft_ms"]


def test_plan_candidates_are_cluster_shapes():
    from servesim.simulator.plan.runner import Candidate, _check_fit
    from servesim.simulator.plan.spec import base_tree, expand_candidates, load_plan

    spec, d = load_plan(ROOT / "configs" / "plans" / "cluster_rag_llama8b.yaml")
    cands = [Candidate(n, a, t) for n, a, t in expand_candidates(spec, base_tree(spec, d))]
    assert [c.name for c in cands] == ["4x-agg-prefix", "2p2d", "3p1d"]
    for c in cands:
        _check_fit(c, spec, None or __import__(
            "servesim.simulator.plan.point", fromlist=["resolve_tree"]).resolve_tree)
        assert c.fits, c.reason
        assert c.gpus_per_replica == 4 and c.hardware == "h100-sxm"


def test_router_decision_latency_counts_in_ttft():
    tree = dict(BASE, workload=dict(BASE["workload"], num_prompts=1),
                cluster={"instances": [{"name": "a"}], "router": {"policy": "random"}})
    fast = run_experiment(cfg_of(tree), resolved=True)
    tree["cluster"]["router"]["decision_latency_s"] = 0.25
    slow = run_experiment(cfg_of(tree), resolved=True)
    assert slow.requests["send_s"][0] == fast.requests["send_s"][0]
    assert slow.requests["ttft_s"][0] == pytest.approx(fast.requests["ttft_s"][0] + 0.25)


def test_unset_cache_extension_keys_stay_out_of_the_groups_and_the_hash():
    """A resolved group's ``cache`` dict leaves out ``kv_cache_memory_bytes`` while it is
    null (as ``dump_tree`` does), so cluster configs hash as before the key existed; a set
    value reaches every group."""
    path = ROOT / "configs" / "cluster_pd_llama70b_h100.yaml"
    plain = resolve_config(load_config(path))
    spelled = resolve_config(load_config(path, ["cache.kv_cache_memory_bytes=null"]))
    assert plain.config_hash() == spelled.config_hash()
    assert "kv_cache_memory_bytes" not in plain.dump_tree()["cache"]
    assert all("kv_cache_memory_bytes" not in g.cache for g in plain.cluster.instances)
    sized = resolve_config(load_config(path, ["cache.kv_cache_memory_bytes=20G"]))
    assert [g.cache["kv_cache_memory_bytes"] for g in sized.cluster.instances] == \
        [20 * 2**30] * len(sized.cluster.instances)


def test_mla_groups_on_different_gpus_share_the_largest_default_block_size():
    """DeepSeek-V3 prefill on H200 (vLLM's FlashAttention-MLA: block 16) and decode on B200
    (FlashInfer-MLA: 32), block size unset: both groups use 32, which both backends take
    (prefix ids are per block); a block size the config sets is kept (and must match)."""
    tree = {"model": {"name": "deepseek-v3", "quantization": "fp8", "max_model_len": 32768},
            "hardware": {"name": "h200-sxm"}, "parallel": {"tensor_parallel_size": 8},
            "cluster": {"instances": [
                {"name": "prefill", "role": "prefill"},
                {"name": "decode", "role": "decode", "hardware": {"name": "b200"}}]}}
    cfg = cfg_of(tree)
    assert [g.cache["block_size"] for g in cfg.cluster.instances] == [32, 32]
    tree["cache"] = {"block_size": 64}
    assert [g.cache["block_size"] for g in cfg_of(tree).cluster.instances] == [64, 64]


def test_max_model_len_auto_fits_each_group():
    """max_model_len auto in a cluster: each group fits its own KV cache (the top-level
    section, TP 1 for a 70B model here, need not fit on its own); groups that fit different
    lengths are refused, naming the length to set (1,000 and 2,000 blocks of 16 tokens)."""
    tree = {"model": {"name": "llama-3.1-70b", "max_model_len": "auto"},
            "hardware": {"name": "h100-sxm"},
            "workload": {"num_prompts": 4, "input_len": 64, "output_len": 8},
            "cluster": {"instances": [{"name": "a", "replicas": 2,
                                       "parallel": {"tensor_parallel_size": 4}}]}}
    cfg = cfg_of(tree)
    assert cfg.model.max_model_len == cfg.cluster.instances[0].model.max_model_len == 131_072
    het = {"model": {"name": "llama-3.1-8b", "max_model_len": "auto"},
           "hardware": {"name": "h100-sxm"}, "cache": {"num_gpu_blocks_override": 1000},
           "cluster": {"instances": [{"name": "big"}, {"name": "small", "cache": {
               "num_gpu_blocks_override": 2000}}]}}
    with pytest.raises(ConfigError, match=r"got \(16, 32000\), first group \(16, 16000\)\): "
                       r"request prefix ids are per block; max_model_len auto fitted each "
                       r"group's KV cache: set it to at most 16000"):
        cfg_of(het)
