"""Memory model: num_gpu_blocks as vLLM computes it, capacity errors, log lines."""

from __future__ import annotations

import math

import pytest
from cmutil import make_cfg
from servesim.costmodels import plan_memory
from servesim.simulator.errors import CapacityError, ConfigError

GIB = 2**30
# (at utilization 0.9, the figures of the hand derivations below; vLLM 0.22.1's default 0.92 is
# pinned in test_cost_values_memory.py)
L8B = ("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb", "cache.gpu_memory_utilization=0.9")


def test_llama8b_a100_num_gpu_blocks():
    """Expected value, derived the way vLLM profiles it (A100 defaults: 256 seqs, 2048 tokens):

    total_gpu_memory 79.15 GiB × 0.9            = 71.235 GiB requested
    − weights (8.03e9 params · 2 B + 32 MiB rope cache)  = 14.989 GiB ("Model loading took 14.99 GiB")
    − activation peak: max(forward 2048 tok ≈ 0.20 GiB, dummy sampler 256 × 128256 × 14 B
      ≈ 0.43 GiB)                                = 0.428 GiB
    − non-torch (cuBLAS workspaces)              = 0.15 GiB
    − CUDA-graph memory estimate (vLLM ≥ 0.21 profiles it and takes it out of the KV budget,
      VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1): FULL_AND_PIECEWISE captures 51 PIECEWISE
      sizes (1…512) and 35 FULL decode sizes (1…256 = max_num_seqs); the first capture holds
      512 tokens' activations (512 × (3·4096 + 3·14336) × 2 B = 54 MiB) + 4 MiB, each of the
      other 50 + 34 graphs 4 MiB: 394 MiB   = 0.385 GiB
    = 55.28 GiB of KV cache / (16 tokens × 128 KiB = 2 MiB per block) = 28,305 blocks,
    i.e. 452,880 tokens, 3.46x concurrency at 131,072 tokens (28,502 blocks without the
    graph estimate: 394 MiB / 2 MiB = 197 blocks more).

    vLLM logs for Llama-3-8B on an 80 GB A100 at 0.9 report ≈ 54–56 GiB of KV cache, i.e.
    ≈ 27,000–29,000 blocks (the exact figure moves by version with activation profiling).
    """
    p = plan_memory(make_cfg(*L8B))
    assert p.weights_bytes / GIB == pytest.approx(14.99, abs=0.01)
    assert p.block_bytes == 16 * 131_072
    assert 27_000 <= p.num_gpu_blocks <= 29_500
    assert p.num_gpu_blocks == 28_305  # regression pin of the derivation above
    assert p.cudagraph_bytes == (54 + 4 + 4 * (50 + 34)) * 2**20
    off = plan_memory(make_cfg(*L8B, "cache.memory_profiler_estimate_cudagraphs=false"))
    assert off.num_gpu_blocks == 28_502
    assert p.kv_cache_tokens == p.num_gpu_blocks * 16
    assert p.max_concurrency == pytest.approx(p.num_gpu_blocks / (131072 / 16))


def test_as_dict_is_json_friendly():
    import json

    d = plan_memory(make_cfg(*L8B)).as_dict()
    assert d["num_gpu_blocks"] == 28_305 and d["kv_cache_tokens"] == 452_880
    assert d["cudagraph_captures"] == (("PIECEWISE", 51, 512), ("FULL", 35, 256))
    assert d["kv_bytes_per_token"] == 131_072 and "weights_gib" in d
    json.dumps(d)


def test_log_lines_look_like_vllm():
    lines = plan_memory(make_cfg(*L8B)).log_lines()
    text = "\n".join(lines)
    assert "Model loading took 14.98" in text
    assert "Available KV cache memory: 55.28 GiB" in text
    assert "GPU KV cache size: 452,880 tokens" in text
    assert "Maximum concurrency for 131,072 tokens per request: 3.46x" in text
    assert "# GPU blocks: 28305" in text


def test_kv_cache_memory_bytes_sets_the_kv_cache_whatever_the_utilization():
    """vLLM ``determine_available_memory``: with ``kv_cache_memory_bytes`` the KV cache gets
    exactly that (profiling skipped, gpu_memory_utilization ignored): 16 GiB / (16 tokens ×
    128 KiB) = 8,192 blocks = 131,072 tokens, one max_model_len request (1.00x); an override
    of the block count still wins, as in ``get_num_blocks``."""
    for util in ("0.9", "0.3"):
        p = plan_memory(make_cfg(*L8B, "cache.kv_cache_memory_bytes=16G",
                                 f"cache.gpu_memory_utilization={util}"))
        assert (p.available_kv_bytes, p.num_gpu_blocks) == (16 * GIB, 8192)
    text = "\n".join(p.log_lines())
    assert "Reserved 16.00 GiB memory for KV Cache as specified by kv_cache_memory_bytes" in text
    assert "Maximum concurrency for 131,072 tokens per request: 1.00x" in text
    assert "CUDA graph pool ~0.38 GiB (beside the given KV cache size)" in text
    assert "Estimated CUDA graph memory" not in text  # (vLLM skips profiling)
    p = plan_memory(make_cfg(*L8B, "cache.kv_cache_memory_bytes=16G",
                             "cache.num_gpu_blocks_override=1000", "model.max_model_len=16000"))
    assert (p.num_gpu_blocks, p.num_gpu_blocks_computed) == (1000, 8192)
    # 2.5e9 bytes // 2 MiB = 1,192 blocks = 19,072 tokens < one 131,072-token request
    with pytest.raises(CapacityError, match="estimated maximum model length is 19072"):
        plan_memory(make_cfg(*L8B, "cache.kv_cache_memory_bytes=2.5g"))
    # more than the device holds beside the weights and the CUDA-graph pool (394 MiB = 0.38
    # GiB, see above): 79.15 − 14.99 − 0.15 − 0.38 = 63.63 GiB
    with pytest.raises(CapacityError, match=r"cache.kv_cache_memory_bytes: 51200 blocks need "
                       r"100.00 GiB of KV cache, more than the 63.63 GiB left on the GPU beside "
                       r"the model weights \(14.99 GiB\) and CUDA graphs \(0.38 GiB\)"):
        plan_memory(make_cfg(*L8B, "cache.kv_cache_memory_bytes=100G"))


@pytest.mark.parametrize("text, value", [
    ("25.6k", 25_600), ("1k", 1000), ("1K", 1024), ("2g", 2_000_000_000), ("2G", 2 * GIB),
    ("1T", 2**40), (" 3m ", 3_000_000), ("12345", 12345), (4096, 4096),
])
def test_human_readable_byte_counts_as_vllm_parses_them(text, value):
    """``vllm.utils.argparse_utils.human_readable_int``: lower-case suffixes are decimal
    (decimals allowed), upper-case binary (whole numbers only)."""
    from servesim.simulator.config import load_config

    cfg = load_config(None, [])
    cfg.cache.kv_cache_memory_bytes = text  # (validate_assignment)
    assert cfg.cache.kv_cache_memory_bytes == value


def test_token_counts_take_the_human_readable_form_too():
    """vLLM parses --max-model-len and --max-num-batched-tokens the same way."""
    from servesim.simulator.config import load_config

    cfg = load_config(None, ["model.max_model_len=32K", "scheduler.max_num_batched_tokens=16k"])
    assert (cfg.model.max_model_len, cfg.scheduler.max_num_batched_tokens) == (32768, 16000)
    for bad in ("0", "-2", "'0'", "0.0", "'0k'"):  # (after parsing: 0 tokens)
        with pytest.raises(ConfigError, match="model.max_model_len: expected a positive number "
                           r"of tokens, or auto \(-1: the longest that fits in the KV cache\)"):
            load_config(None, [f"model.max_model_len={bad}"])
    with pytest.raises(ConfigError, match="model.max_model_len: expected a number of tokens, "
                       "or auto, not a boolean"):
        load_config(None, ["model.max_model_len=true"])
    with pytest.raises(ConfigError, match="not a boolean"):
        load_config(None, ["model.max_model_len=false"])


def test_human_readable_binary_suffix_refuses_decimals():
    from servesim.simulator.config import load_config

    with pytest.raises(ConfigError, match="decimals are not allowed with binary suffixes like "
                       "G: did you mean 1.5g"):
        load_config(None, ["cache.kv_cache_memory_bytes=1.5G"])


def test_override_and_utilization():
    p = plan_memory(make_cfg(*L8B, "cache.num_gpu_blocks_override=1000",
                             "model.max_model_len=16000"))
    assert p.num_gpu_blocks == 1000 and p.num_gpu_blocks_computed == 28_305
    assert any("num_gpu_blocks_override=1000" in s for s in p.log_lines())
    # vLLM 0.22.1 get_kv_cache_configs checks one max_model_len request against the override's
    # size (1000 blocks × 16 tokens = 16,000), not the profiled memory: 16,001 is refused
    with pytest.raises(CapacityError, match=r"model.max_model_len=16001: To serve at least one "
                       r"request with the model's max seq len \(16001\), \(1.96 GiB KV cache is "
                       r"needed, which is larger than the available KV cache memory \(1.95 GiB\)"
                       r"\. Based on the available memory, the estimated maximum model length "
                       r"is 16000\."):
        plan_memory(make_cfg(*L8B, "cache.num_gpu_blocks_override=1000",
                             "model.max_model_len=16001"))


def test_max_model_len_auto_fits_the_kv_cache():
    """vLLM ``--max-model-len auto`` (-1, ``_auto_fit_max_model_len``): the derived length
    when one request of it fits the KV cache, else the longest that fits (binary search over
    one request's blocks), against the override's size when there is one. Llama-3.1-8B on
    A100: 28,305 blocks hold 131,072 tokens; 1,000 blocks of 16 tokens hold 16,000; 2.5e9
    bytes of KV are 1,192 blocks of 2 MiB = 19,072 tokens. Mistral-7B's 4,096-token sliding
    window: a request of L > 4,096 tokens takes ceil(min(L, 4,095 + 2,048) / 16) + 1 blocks,
    ≤ 300 for L ≤ 4,784."""
    from servesim.simulator.config import load_config, resolve_config

    def fitted(*ov):
        cfg = resolve_config(load_config(None, [*L8B, "model.max_model_len=auto", *ov]))
        return cfg, plan_memory(cfg)

    cfg, p = fitted()
    assert cfg.model.max_model_len == p.max_model_len == 131_072
    assert ("Auto-fit max_model_len: full model context length 131072 fits in available GPU "
            "memory") in p.log_lines()
    cfg, p = fitted("cache.num_gpu_blocks_override=1000")
    assert (cfg.model.max_model_len, p.blocks_per_request, p.max_concurrency) == (16_000, 1000, 1)
    lines = p.log_lines()
    assert ("Auto-fit max_model_len: reduced from 131072 to 16000 to fit in available GPU "
            "memory (1.95 GiB available for KV cache)") in lines
    assert lines.index("Overriding num_gpu_blocks=28305 with num_gpu_blocks_override=1000") \
        < lines.index("GPU KV cache size: 16,000 tokens")
    assert fitted("cache.kv_cache_memory_bytes=2.5g")[0].model.max_model_len == 19_072
    assert fitted("model.name=mistral-7b-v0.1",
                  "cache.num_gpu_blocks_override=300")[0].model.max_model_len == 4784
    assert fitted("model.max_model_len=-1", "cache.num_gpu_blocks_override=300")[
        0].model.max_model_len == 4800
    # the resolved config holds the fitted length: resolving its dump again changes nothing
    cfg = fitted("cache.num_gpu_blocks_override=1000")[0]
    again = resolve_config(load_config(None, [f"model.max_model_len={cfg.model.max_model_len}",
                                              *L8B, "cache.num_gpu_blocks_override=1000"]))
    assert again.config_hash() == cfg.config_hash()
    with pytest.raises(CapacityError, match="Cannot auto-fit max_model_len: not enough GPU "
                       "memory available to serve even a single token"):
        fitted("cache.kv_cache_memory_bytes=1M")


def test_auto_fit_edges_as_vllm():
    """Sliding window at lengths within the window: vLLM's admission cap is still
    ceil(min(window − 1 + budget, L) / 16) + 1 blocks, so 256 blocks hold L ≤ 4,080 (not
    4,096, which is refused); the prefix check sees the fitted length; a plan of an unresolved
    auto config fits too, and a resolved config keeps its fitted length when changed later;
    with no KV cache at all vLLM's message leaves out the estimate."""
    from servesim.simulator.config import load_config, resolve_config

    mistral = [*L8B, "model.name=mistral-7b-v0.1", "cache.num_gpu_blocks_override=256"]
    cfg = resolve_config(load_config(None, [*mistral, "model.max_model_len=auto"]))
    assert cfg.model.max_model_len == 4080
    with pytest.raises(CapacityError, match=r"\(4096\), \(0.5 GiB KV cache is needed.*"
                       "estimated maximum model length is 4080"):
        plan_memory(make_cfg(*mistral, "model.max_model_len=4096"))
    with pytest.raises(ConfigError, match=r"workload.prefix_len: 2000 is longer than "
                       r"model.max_model_len \(1600\)"):
        resolve_config(load_config(None, [*L8B, "model.max_model_len=auto",
                                          "cache.num_gpu_blocks_override=100",
                                          "workload.prefix_len=2000"]))
    raw = load_config(None, [*L8B, "model.max_model_len=-1", "cache.num_gpu_blocks_override=1000"])
    assert plan_memory(raw).max_model_len == 16_000
    cfg = resolve_config(raw)
    cfg.cache.num_gpu_blocks_override = 2000
    assert plan_memory(cfg).max_model_len == 16_000  # (fitted once, at resolve)
    with pytest.raises(CapacityError) as e:
        plan_memory(make_cfg(*L8B, "model.max_model_len=1000", "cache.kv_cache_memory_bytes=1M"))
    assert "available KV cache memory (0.0 GiB). Try increasing" in str(e.value)
    lo = plan_memory(make_cfg(*L8B, "cache.gpu_memory_utilization=0.5"))
    # fixed costs do not scale with utilization: fewer than half the blocks... of the excess
    assert lo.num_gpu_blocks < 28_305 / 2 + 8_000
    assert lo.available_kv_bytes == pytest.approx(
        math.ceil(int(79.15 * GIB) * 0.5) - lo.weights_bytes - lo.activation_peak_bytes
        - lo.non_torch_bytes - lo.cudagraph_bytes, abs=1)


def test_fp8_kv_doubles_blocks():
    p = plan_memory(make_cfg(*L8B, "cache.cache_dtype=fp8"))
    assert p.num_gpu_blocks == pytest.approx(2 * 28_305, abs=2)


def test_70b_on_one_a100_does_not_fit_and_fits_with_tp4():
    with pytest.raises(CapacityError, match=r"model weights take 131\.\d+ GiB per GPU but only "
                                            r"72\.82 GiB available at "  # 79.15 × 0.92
                                            r"gpu_memory_utilization=0\.92") as e:
        plan_memory(make_cfg("model.name=llama-3.1-70b", "hardware.name=a100-sxm4-80gb"))
    assert "\n" not in str(e.value)
    p = plan_memory(make_cfg("model.name=llama-3.1-70b", "hardware.name=a100-sxm4-80gb",
                             "parallel.tensor_parallel_size=4"))
    assert p.weights_bytes / GIB == pytest.approx(131.45 / 4, rel=0.01)
    assert p.comm_bytes > 0  # NCCL buffers at TP > 1
    assert p.kv_bytes_per_token == 327_680 // 4
    assert p.num_gpu_blocks > 131072 // 16


def test_max_model_len_must_fit_in_kv_cache():
    # 8B weights (15 GiB) on an L4 (22 GiB) leave ~4 GiB: 131,072 tokens need 16 GiB
    with pytest.raises(CapacityError, match=r"To serve at least one request with the model's "
                                            r"max seq len \(131072\), \(16\.0 GiB KV cache is "
                                            r"needed, which is larger than the available KV "
                                            r"cache memory") as e:
        plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=l4"))
    assert "gpu_memory_utilization" in str(e.value) and "max_model_len" in str(e.value)
    p = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=l4",
                             "model.max_model_len=16384"))
    assert p.num_gpu_blocks > 16384 // 16


def test_tp_must_divide_heads():
    with pytest.raises(ConfigError, match="parallel.tensor_parallel_size"):
        plan_memory(make_cfg(*L8B, "parallel.tensor_parallel_size=3", resolve=False))


def test_mla_and_moe_plans():
    p = plan_memory(make_cfg("model.name=deepseek-v3", "hardware.name=h200-sxm",
                             "parallel.tensor_parallel_size=8"))
    assert p.weight_format == "fp8"  # the checkpoint's quantization_config
    assert p.kv_bytes_per_token == 70_272  # latent replicated on each TP rank
    assert 70 * GIB < p.weights_bytes < 90 * GIB  # ≈ 671 GB fp8 / 8
    mx = plan_memory(make_cfg("model.name=mixtral-8x7b", "hardware.name=h100-sxm",
                              "parallel.tensor_parallel_size=2"))
    assert mx.weights_bytes / GIB == pytest.approx(46.7e9 * 2 / 2 / GIB, rel=0.01)


def test_int4_weights_leave_more_kv():
    a = plan_memory(make_cfg(*L8B))
    q = plan_memory(make_cfg(*L8B, "model.quantization=int4-awq"))
    assert q.weights_bytes < 0.45 * a.weights_bytes
    assert q.num_gpu_blocks > a.num_gpu_blocks


def test_cudagraph_pool_counts_against_kv_unless_the_estimate_is_off():
    """VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 (``cache.memory_profiler_estimate_cudagraphs:
    false``) gives the KV cache the graph pool back, and vLLM's warning says so; eager mode
    captures nothing."""
    a = plan_memory(make_cfg(*L8B))
    b = plan_memory(make_cfg(*L8B, "cache.memory_profiler_estimate_cudagraphs=false"))
    assert a.cudagraph_bytes == b.cudagraph_bytes == 394 * 2**20
    assert (a.cudagraph_in_kv_budget, b.cudagraph_in_kv_budget) == (True, False)
    assert b.available_kv_bytes - a.available_kv_bytes == 394 * 2**20
    assert b.num_gpu_blocks - a.num_gpu_blocks == 197
    # 394 MiB / 79.15 GiB = 0.00486 of the device: 0.9 − that = 0.8951, 0.9 + that = 0.9049
    assert ("CUDA graph memory profiling is disabled (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"
            "=0). Without it, CUDA graph memory is not accounted for during KV cache "
            "allocation, which may require lowering --gpu-memory-utilization to avoid OOM. "
            "Consider re-enabling it (the default as of v0.21.0) and increasing "
            "--gpu-memory-utilization from 0.9000 to 0.9049.") in b.log_lines()
    lines = a.log_lines()
    i = lines.index("Profiling CUDA graph memory: PIECEWISE=51 (largest=512), FULL=35 "
                    "(largest=256)")
    assert lines[i + 1:i + 4] == [
        "Estimated CUDA graph memory: 0.38 GiB total",
        "Available KV cache memory: 55.28 GiB",
        ("CUDA graph memory profiling is enabled (default since v0.21.0). The current "
        "--gpu-memory-utilization=0.9000 is equivalent to --gpu-memory-utilization=0.8951 "
        "without CUDA graph memory profiling. To maintain the same effective KV cache size as "
        "before, increase --gpu-memory-utilization to 0.9049. To disable, set "
        "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.")]
    eager = plan_memory(make_cfg(*L8B, "model.enforce_eager=true"))
    assert eager.cudagraph_bytes == 0 and eager.cudagraph_captures == ()
    assert not any("CUDA graph memory" in s for s in eager.log_lines())
    assert eager.available_kv_bytes == b.available_kv_bytes


def test_explicit_16_bit_kv_cache_dtypes_are_auto_sized():
    """vLLM's --kv-cache-dtype float16 / bfloat16 store 2 bytes per element, as auto does for a
    bf16 model: the same blocks and step times."""
    from servesim.costmodels import build_cost_model
    from servesim.costmodels.batch import BatchShape

    auto = plan_memory(make_cfg(*L8B))
    batch = BatchShape(8, 8000, 0, (), (), 8)
    t_auto = build_cost_model(make_cfg(*L8B)).step_seconds(batch)
    for dt in ("float16", "bfloat16"):
        p = plan_memory(make_cfg(*L8B, f"cache.cache_dtype={dt}"))
        assert (p.num_gpu_blocks, p.kv_bytes_per_token) == (auto.num_gpu_blocks, 128 * 1024)
        assert build_cost_model(make_cfg(*L8B, f"cache.cache_dtype={dt}")).step_seconds(
            batch) == t_auto
    with pytest.raises(ConfigError, match="cache.cache_dtype"):
        make_cfg(*L8B, "cache.cache_dtype=nvfp4")


def test_no_kv_memory_error_names_the_graph_estimate():
    """At 0.1975 of 79.15 GiB (15.63 GiB) the weights, activation peak and non-torch memory
    fit (15.57 GiB) and the 0.38 GiB CUDA-graph estimate does not: the message says so."""
    with pytest.raises(CapacityError, match=r"No available memory for the cache blocks "
                       r"\(weights 14.99 GiB \+ activation peak 0.43 GiB \+ non-torch 0.15 GiB "
                       r"\+ CUDA graph estimate 0.38 GiB exceed 15.63 GiB at "
                       r"gpu_memory_utilization=0.1975\)"):
        plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             "cache.gpu_memory_utilization=0.1975"))
