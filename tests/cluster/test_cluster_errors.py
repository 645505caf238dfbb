"""Cluster configs that cannot be simulated: one-line errors (exit 2) naming the key, the
router parameter or the instance group, before anything is simulated; never an internal
error after the run, nor a "successful" run with meaningless numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
from servesim.simulator.cluster.routers import PrefixAwareRouter
from servesim.simulator.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
P = str(REPO / "configs" / "cluster_prefix_router_llama8b.yaml")
D = str(REPO / "configs" / "cluster_pd_llama70b_h100.yaml")
SMALL = {P: "workload.num_sessions=5", D: "workload.num_prompts=30"}


# F4 / F7: non-finite latencies and bandwidths (a crash writing result.json, or a run with
# no timings); zero bandwidth was already refused
@pytest.mark.parametrize("config,setting,message", [
    (D, "cluster.kv_transfer.bandwidth_gbps=.inf",
     "cluster.kv_transfer.bandwidth_gbps: input should be a finite number (got inf)"),
    (D, "cluster.kv_transfer.latency_us=.inf",
     "cluster.kv_transfer.latency_us: input should be a finite number (got inf)"),
    (D, "cluster.kv_transfer.overhead_us=.nan",
     "cluster.kv_transfer.overhead_us: input should be a finite number (got nan)"),
    (D, "cluster.kv_transfer.bandwidth_gbps=0",
     "cluster.kv_transfer.bandwidth_gbps: input should be greater than 0 (got 0)"),
    (P, "cluster.router.decision_latency_s=.inf",
     "cluster.router.decision_latency_s: input should be a finite number (got inf)"),
    (P, "cache.kv_offload={cpu_bytes: 8GiB, latency_us: .inf}",
     "cache.kv_offload.latency_us: input should be a finite number (got inf)"),
    (P, "cache.kv_offload={cpu_bytes: 8GiB, bandwidth_gbps: .inf}",
     "cache.kv_offload.bandwidth_gbps: input should be a finite number (got inf)"),
    # F12: an absurd CPU tier (1EiB was already refused as unparseable)
    (P, "cache.kv_offload={cpu_bytes: 99999999999999999999999}",
     ("cache.kv_offload.cpu_bytes: at most 1PiB (1125899906842624 bytes) of CPU memory "
     "(got 99999999999999999999999)")),
])
def test_non_finite_or_absurd_numbers_are_refused(cli_error, config, setting, message):
    assert cli_error(config, SMALL[config], setting) == (
        f"error: {config} (with --set overrides): {message}")


def test_one_pib_of_cpu_memory_is_accepted():
    from servesim.simulator.cluster.config import KVOffloadConfig

    assert KVOffloadConfig(cpu_bytes="1024TiB").cpu_bytes == 1 << 50


# F6 / F8: router parameters out of range (internal errors, or silently other behaviour)
@pytest.mark.parametrize("policy,params,message", [
    ("session_affinity", "{virtual_nodes: 0}",
     "router session_affinity: virtual_nodes: expected an integer from 1 to 10000, got 0"),
    ("session_affinity", "{virtual_nodes: -5}",
     "router session_affinity: virtual_nodes: expected an integer from 1 to 10000, got -5"),
    ("session_affinity", "{virtual_nodes: true}",
     "router session_affinity: virtual_nodes: expected int, got True"),
    ("prefix_aware", "{lru_capacity_per_server: -1}",
     "router prefix_aware: lru_capacity_per_server: expected an integer >= 1, got -1"),
    ("prefix_aware", "{prefix_weight: .nan}",
     "router prefix_aware: prefix_weight: expected a finite number >= 0, got nan"),
    ("prefix_aware", "{prefix_weight: .inf}",
     "router prefix_aware: prefix_weight: expected a finite number >= 0, got inf"),
    ("prefix_aware", "{prefix_weight: -1}",
     "router prefix_aware: prefix_weight: expected a finite number >= 0, got -1.0"),
    ("prefix_aware", "{metrics_refresh_s: .nan}",
     "router prefix_aware: metrics_refresh_s: expected a finite number >= 0, got nan"),
    ("prefix_aware", "{queue_threshold: 0}",
     "router prefix_aware: queue_threshold: expected an integer >= 1, got 0"),
    ("cache_aware", "{cache_threshold: .nan}",
     "router cache_aware: cache_threshold: expected a finite number from 0 to 1, got nan"),
    ("least_load", "{refresh_s: -1}",
     "router least_load: refresh_s: expected a finite number >= 0, got -1.0"),
])
def test_router_params_out_of_range_are_refused(cli_error, policy, params, message):
    assert cli_error(P, SMALL[P], f"cluster.router.policy={policy}",
                     f"cluster.router.params={params}") == f"error: {P}: {message}"


def test_router_params_in_range_are_accepted():
    r = PrefixAwareRouter({"prefix_weight": 0, "metrics_refresh_s": 0.0,
                           "lru_capacity_per_server": 1})
    assert r.prefix_weight == 0.0 and r.lru_capacity_per_server == 1
    with pytest.raises(ConfigError, match=r"^router prefix_aware: kv_weight: expected a finite "
                       r"number >= 0, got inf$"):
        PrefixAwareRouter({"kv_weight": 10 ** 400})


# F9: P/D between different models
def test_prefill_and_decode_groups_must_serve_the_same_model(cli_error):
    line = cli_error(D, SMALL[D], "cluster.instances=[{name: p, role: prefill}, "
                     "{name: d, role: decode, model: {name: llama-3.1-8b, "
                     "max_model_len: 32768}}]")
    assert line == (f"error: {D}: cluster.instances[1] (d): serves model llama-3.1-8b but "
                    "cluster.instances[0] (p) serves llama-3.1-70b: prefill and decode groups "
                    "must serve the same model (the KV cache moves between them as is)")


# F10: data_parallel_size was silently dropped in clusters
def test_data_parallel_size_in_a_group_is_refused(cli_error):
    line = cli_error(P, SMALL[P], "cluster.instances=[{name: v, replicas: 2, "
                     "parallel: {data_parallel_size: 4}}]")
    assert line == (f"error: {P}: cluster.instances[0] (v): parallel.data_parallel_size: 4 is "
                    "not used in a cluster (each instance is one engine); set the group's "
                    "replicas instead")


def test_top_level_data_parallel_size_is_refused_with_a_cluster(cli_error):
    line = cli_error(P, SMALL[P], "parallel.data_parallel_size=4")
    assert line == (f"error: {P}: parallel.data_parallel_size: 4 is not used in a cluster "
                    "(each instance is one engine); set cluster.instances[i].replicas instead")


# F13: an error while resolving a group names the group
def test_resolve_error_in_a_group_names_the_group(cli_error):
    line = cli_error(P, SMALL[P], "cluster.instances=[{name: v, "
                     "parallel: {tensor_parallel_size: 3}}]")
    assert line == (f"error: {P}: cluster.instances[0] (v): parallel.tensor_parallel_size: 3 "
                    "does not divide the model's num_attention_heads (32)")
