"""CPU KV-offload tier (simulator/cluster/offload.py): vLLM OffloadingConnector semantics."""

import pytest
from servesim.simulator.cluster.offload import ARCPolicy, CPUTier, LRUPolicy
from servesim.simulator.config import resolve_config, validate_tree
from servesim.simulator.runner import run_experiment

IDS = " ".join(str(i) for i in range(1, 17))  # 16 shared blocks = 256 tokens


def offload_config(tmp_path, kv_offload, rows):
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_len,output_len,prefix_block_ids\n" + "\n".join(rows)
                     + "\n")
    cache = {"block_size": 16, "num_gpu_blocks_override": 20}  # 19 usable blocks
    if kv_offload is not None:
        cache["kv_offload"] = kv_offload
    tree = {"model": {"name": "llama-3.1-8b", "max_model_len": 300},
            "hardware": {"name": "h100-sxm"}, "cache": cache,
            "workload": {"kind": "trace", "path": str(trace)}}
    return resolve_config(validate_tree(tree, "test"))


ROWS = [f"0.0,256,2,{IDS}",  # A: 16 shared blocks
        "1.0,290,2,",        # B: unique, needs all 19 blocks: evicts every block of A
        f"2.0,256,2,{IDS}"]  # C: A's prompt again


def test_prefix_evicted_from_gpu_is_loaded_back_from_cpu(tmp_path):
    res = run_experiment(offload_config(tmp_path, {"cpu_bytes": "1GiB"}, ROWS), resolved=True)
    req = res.requests
    assert list(req["finished_reason"]) == ["length"] * 3
    # GPU tier: nothing of A survived B (all three GPU lookups miss)
    assert res.counters["prefix_cache_hits"] == 0
    # CPU tier: C's whole prompt comes back from CPU (a full hit: its last token recomputed)
    assert res.extras["cpu_prefix_cache_hits"] == 256
    # queries: every request's GPU-missed tokens, once (vLLM connector_prefix_cache_stats)
    assert res.extras["cpu_prefix_cache_queries"] == 256 + 290 + 256
    assert res.extras["cpu_prefix_cache_hit_rate"] == pytest.approx(256 / 802)
    assert res.extras["cpu_offload_loads"] == 1
    assert req["num_cached_tokens"][2] == 256  # vLLM counts external hits as cached
    # the load is charged: latency + 16 blocks × block bytes / PCIe bandwidth (H100: 64 GB/s)
    kvbpt = res.capacity["kv_bytes_per_token"]
    load_s = 10e-6 + 256 * kvbpt / 64e9
    assert res.extras["cpu_offload_mean_load_ms"] == pytest.approx(load_s * 1e3)
    assert req["queue_s"][2] >= load_s - 1e-12
    # ... and it beats recomputing the prompt
    base = run_experiment(offload_config(tmp_path, None, ROWS), resolved=True)
    assert base.requests["num_cached_tokens"][2] == 0
    assert req["ttft_s"][2] < base.requests["ttft_s"][2]
    # B's prompt and A's were both stored (write-through), C's were there already
    assert res.extras["cpu_offload_stored_blocks"] >= 16 + 18


def test_gpu_hit_then_cpu_continuation_and_cpu_capacity(tmp_path):
    """B evicts A's last blocks only: C hits A's head on GPU and the rest on CPU. A CPU tier
    with room for 4 blocks holds only the most recently stored ones."""
    rows = [f"0.0,256,2,{IDS}", "1.0,96,2,", f"2.0,256,2,{IDS}"]
    cfg = offload_config(tmp_path, {"cpu_bytes": "1GiB"}, rows)
    res = run_experiment(cfg, resolved=True)
    gpu_hits = res.counters["prefix_cache_hits"]
    assert 0 < gpu_hits < 256
    assert res.extras["cpu_prefix_cache_hits"] == 256 - gpu_hits
    assert res.requests["num_cached_tokens"][2] == 256
    kvbpt = res.capacity["kv_bytes_per_token"]
    small = offload_config(tmp_path, {"cpu_bytes": 4 * 16 * kvbpt}, ROWS)
    r2 = run_experiment(small, resolved=True)
    assert r2.extras["cpu_offload_blocks"] == 4
    assert r2.extras["cpu_prefix_cache_hits"] == 0  # A's first blocks were evicted from CPU


def test_lru_and_arc_policies():
    lru = LRUPolicy(3)
    for k in (1, 2, 3):
        lru.insert(k, [0.0, 0])
    lru.touch([1])
    assert lru.evict(1, set()) == [2]
    lru.get(3)[1] = 1  # being loaded: not evictable
    assert lru.evict(2, set()) is None
    tier = CPUTier(2, "arc")
    assert tier.store([1, 2], 0.0) == [1, 2]
    tier.policy.touch([1])  # 1 seen again: T2
    assert tier.store([3], 0.0) == [3]  # evicts from T1 (2), keeps 1
    assert tier.lookup(1, 0.0) and not tier.lookup(2, 0.0) and tier.lookup(3, 0.0)
    assert isinstance(tier.policy, ARCPolicy)
    assert not tier.lookup(3, -1.0)  # not ready before its store completes


def test_cpu_bytes_accepts_units():
    """One byte parser for cache.kv_offload.cpu_bytes and cache.kv_cache_memory_bytes: unit
    words, and vLLM's one-letter forms (upper case binary, lower case decimal)."""
    from servesim.costmodels.config import parse_bytes
    from servesim.simulator.config import load_config

    assert parse_bytes("8GiB") == parse_bytes("8G") == 8 << 30
    assert parse_bytes("1.5 GB") == parse_bytes("1.5g") == 1_500_000_000
    assert parse_bytes(1024) == 1024
    with pytest.raises(ValueError):
        parse_bytes("8 parsecs")
    c = load_config(None, ["cache.kv_cache_memory_bytes=16GiB",
                           "cache.kv_offload={cpu_bytes: 4G}"]).cache
    assert (c.kv_cache_memory_bytes, c.kv_offload.cpu_bytes) == (16 << 30, 4 << 30)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_write_through_stores_every_full_block_once_fast_or_exact(tmp_path, async_scheduling):
    """Unique prompts with long decodes: the write-through stores each request's full blocks
    as they fill, decode blocks included: Σ floor((prompt + output − 1) / 16) blocks (the last
    output is never computed), each once; the decode-group fast path stores exactly what the
    per-request loop stores, in the same order (same CPU hits and request rows)."""
    rows = [f"{0.05 * i:.2f},{40 + 23 * i},{50 + 7 * i}," for i in range(12)]
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_len,output_len,prefix_block_ids\n" + "\n".join(rows)
                     + "\n")
    tree = {"model": {"name": "llama-3.1-8b", "max_model_len": 1024},
            "hardware": {"name": "h100-sxm"},
            "cache": {"block_size": 16, "kv_offload": {"cpu_bytes": "4GiB"}},
            "scheduler": {"async_scheduling": async_scheduling},
            "workload": {"kind": "trace", "path": str(trace)}}
    cfg = resolve_config(validate_tree(tree, "test"))
    fast = run_experiment(cfg, resolved=True)
    exact = run_experiment(cfg, resolved=True, fast_path=False)
    want = sum((40 + 23 * i + 50 + 7 * i - 1) // 16 for i in range(12))
    assert exact.extras["cpu_offload_stored_blocks"] == want
    for k in ("cpu_offload_stored_blocks", "cpu_offload_blocks", "cpu_prefix_cache_hits",
              "cpu_prefix_cache_queries"):
        assert fast.extras[k] == exact.extras[k], k
    for k in ("output_len", "num_cached_tokens", "first_token_s", "finish_s"):
        assert list(fast.requests[k]) == list(exact.requests[k]), k
