"""Cluster routers on hand-made cases (simulator/cluster/routers.py)."""

import numpy as np
import pytest
from servesim.simulator.cluster.routers import (
    CacheAwareRouter,
    LeastLoadRouter,
    PrefixAwareRouter,
    SessionAffinityRouter,
    prompt_block_hashes,
)
from servesim.simulator.errors import ConfigError
from servesim.simulator.registry import available, get_router
from servesim.simulator.request import Request
from servesim.workloads.schema import RequestSpec


class FakeInstance:
    def __init__(self, index, waiting=0, running=0, in_flight=0, kv_usage=0.0, cached=()):
        self.index = index
        self.name = f"vllm-{index}"
        self.num_waiting = waiting
        self.num_running = running
        self.in_flight = in_flight
        self.kv_usage = kv_usage
        self.cached = set(cached)

    def cached_prefix_blocks(self, hashes):
        n = 0
        for h in hashes:
            if h not in self.cached:
                break
            n += 1
        return n


def req(i, ids=(1, 2, 3, 4), prompt_len=64, session=None):
    spec = RequestSpec(arrival_s=0.0, prompt_len=prompt_len, output_len=8, request_id=str(i),
                       prefix_block_ids=tuple(ids), session_id=session)
    return Request(spec, i, 4096, 0.0)


def test_routers_are_registered_plugins():
    names = available()["routers"]
    for n in ("round_robin", "least_load", "power_of_two", "random", "session_affinity",
              "prefix_aware", "cache_aware"):
        assert n in names
    with pytest.raises(ConfigError, match="unknown name 'nope'"):
        get_router("nope")
    with pytest.raises(ConfigError, match="unknown parameter"):
        get_router("prefix_aware")({"prefix_wieght": 1}, None)


def test_prefix_aware_sends_the_request_to_the_replica_holding_its_prefix():
    r = req(0)
    hashes = prompt_block_hashes(r, 16)
    assert len(hashes) == 4
    insts = [FakeInstance(0), FakeInstance(1), FakeInstance(2, cached=hashes)]
    router = PrefixAwareRouter({"cache_view": "exact"}, np.random.default_rng(0))
    assert router.route(r, insts, 0.0) == 2
    # a partial prefix (2 of 4 blocks) still wins over none
    insts[2].cached = set(hashes[:2])
    assert router.route(req(1), insts, 1.0) == 2


@pytest.mark.parametrize("waiting,expect_holder", [(0, True), (3, True), (5, False), (20, False)])
def test_prefix_aware_blend_threshold(waiting, expect_holder):
    """Scores: prefix_weight·prefix + queue_weight·(1 − min(q, Q)/Q). With prefix weight 0.5,
    queue weight 1, Q = 8, the holder (full prefix) wins iff 0.5 + 1 − q/8 > 1, i.e. q < 4."""
    r = req(0)
    hashes = prompt_block_hashes(r, 16)
    insts = [FakeInstance(0), FakeInstance(1), FakeInstance(2, waiting=waiting, cached=hashes)]
    router = PrefixAwareRouter({"cache_view": "exact", "prefix_weight": 0.5, "queue_weight": 1.0,
                                "kv_weight": 0.0, "active_weight": 0.0,
                                "queue_scorer": "linear", "queue_threshold": 8},
                               np.random.default_rng(0))
    assert (router.route(r, insts, 0.0) == 2) is expect_holder


def test_prefix_aware_approximate_view_follows_its_own_routing_history():
    router = PrefixAwareRouter({}, np.random.default_rng(0))  # approximate view by default
    insts = [FakeInstance(i) for i in range(4)]
    first = router.route(req(0), insts, 0.0)
    insts[first].in_flight = 1
    # same prefix later: the index says `first` has it (the engine's cache is never read)
    for k in range(1, 5):
        assert router.route(req(k), insts, 0.01 * k) == first
    # a different prefix goes elsewhere (least loaded)
    assert router.route(req(9, ids=(7, 8, 9, 10)), insts, 0.1) != first


def test_prefix_aware_scrapes_gauges_every_refresh_interval():
    router = PrefixAwareRouter({"cache_view": "exact", "prefix_weight": 0.0, "kv_weight": 0.0,
                                "active_weight": 0.0, "metrics_refresh_s": 0.05},
                               np.random.default_rng(0))
    insts = [FakeInstance(0, waiting=5), FakeInstance(1)]
    assert router.route(req(0), insts, 0.0) == 1
    insts[1].num_waiting = 10  # not scraped yet: still looks empty
    assert router.route(req(1), insts, 0.01) == 1
    assert router.route(req(2), insts, 0.06) == 0


def test_cache_aware_uses_prefix_unless_imbalanced():
    r = req(0)
    router = CacheAwareRouter({"cache_view": "exact"}, np.random.default_rng(0))
    hashes = prompt_block_hashes(r, 16)
    insts = [FakeInstance(0, in_flight=5), FakeInstance(1, in_flight=6),
             FakeInstance(2, in_flight=30, cached=hashes)]
    assert router.route(r, insts, 0.0) == 2  # 30 − 5 ≤ 32: balanced enough
    insts[2].in_flight = 40  # 40 − 5 > 32 and 40 > 1.1·5: imbalanced → least loaded
    assert router.route(req(1), insts, 0.0) == 0
    insts[2].in_flight = 5
    insts[2].cached = set(hashes[:1])  # match rate 1/4 ≤ 0.5: least loaded (ties: first)
    assert router.route(req(2), insts, 0.0) == 0


def test_session_affinity_keeps_a_session_on_one_replica():
    router = SessionAffinityRouter({}, np.random.default_rng(0))
    insts = [FakeInstance(i) for i in range(4)]
    homes = {}
    for turn in range(6):
        for s in range(20):
            i = router.route(req(s * 10 + turn, session=f"s{s}"), insts, float(turn))
            homes.setdefault(s, i)
            assert homes[s] == i
            insts[i].in_flight += 1  # load does not move a session
    assert len(set(homes.values())) == 4  # sessions spread over the replicas
    # no session: fewest requests in flight
    insts[3].in_flight = -1
    assert router.route(req(999), insts, 0.0) == 3


def test_least_load_is_vllm_dp_balancer_with_local_increments():
    router = LeastLoadRouter({}, None)
    insts = [FakeInstance(0, waiting=1), FakeInstance(1), FakeInstance(2)]
    picks = [router.route(req(k), insts, 0.0) for k in range(4)]
    # scores 4,0,0 → engine 1 (first minimum; local waiting+1) → 4,4,0 → 2 → 4,4,4 → 0 → ...
    assert picks == [1, 2, 0, 1]
    insts[0].num_waiting = 0
    assert router.route(req(9), insts, 0.05) == 2  # 8,8,4: not refreshed before 100 ms
    assert router.route(req(10), insts, 0.1) == 0  # refreshed: counts 0, 0, 0


def test_least_load_per_api_server_for_dp_engines():
    """``api_servers: 2`` (a DP engine set with cache.kv_offload, vLLM's balancer in each API
    server, taking requests in turn): the same picks as ``Client._route`` — 4 engines, from
    engines 0 and 2, increments of 2 — [0, 2, 1, 3, 2, 0] (test_conformance_v022)."""
    router = LeastLoadRouter({"api_servers": 2}, None)
    insts = [FakeInstance(i) for i in range(4)]
    assert [router.route(req(k), insts, 0.0) for k in range(6)] == [0, 2, 1, 3, 2, 0]
    with pytest.raises(ConfigError, match="api_servers must be an integer from 1 to 1024"):
        LeastLoadRouter({"api_servers": 0}, None)


def test_dp_with_kv_offload_routes_per_api_server():
    """A single engine config with DP 2 and cache.kv_offload runs as a cluster of 2; its
    router is vLLM's balancer with one table per API server (api_server_count = DP)."""
    from servesim.simulator.cluster.runner import _groups
    from servesim.simulator.config import load_config, resolve_config

    cfg = resolve_config(load_config(None, ["parallel.data_parallel_size=2",
                                            "cache.kv_offload={cpu_bytes: 4GiB}"]))
    cl, groups = _groups(cfg)
    # a dense model's DP ranks publish no counts: zeros every 5 s (client.LB_IDLE_PUBLISH_S)
    assert (cl.router.policy, cl.router.params) == (
        "least_load", {"api_servers": 2, "engine_stats": False, "refresh_s": 5.0})
    assert groups[0][0].replicas == 2
    moe = resolve_config(load_config(None, [
        "model.name=mixtral-8x7b", "hardware.name=h100-sxm", "parallel.tensor_parallel_size=2",
        "parallel.data_parallel_size=2", "cache.kv_offload={cpu_bytes: 4GiB}"]))
    assert _groups(moe)[0].router.params == {"api_servers": 2, "engine_stats": True,
                                             "refresh_s": 0.1}


def test_least_load_without_engine_stats_follows_its_own_picks():
    """``engine_stats: false`` (vLLM 0.22.1 over a dense model's DP ranks): the engines'
    counts are never read; the table resets to zeros at multiples of ``refresh_s``."""
    router = LeastLoadRouter({"engine_stats": False, "refresh_s": 5.0}, None)
    insts = [FakeInstance(0, waiting=9), FakeInstance(1), FakeInstance(2)]
    assert [router.route(req(k), insts, t) for k, t in enumerate((0.0, 1.0, 2.0, 3.0))] == \
        [0, 1, 2, 0]
    assert router.route(req(4), insts, 5.0) == 0  # reset at 5 s: from engine 0 again
    assert router._next == 10.0
    with pytest.raises(ConfigError, match="engine_stats: expected bool, got 1"):
        LeastLoadRouter({"engine_stats": 1}, None)
