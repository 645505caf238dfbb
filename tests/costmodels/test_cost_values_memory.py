"""Memory plan by value: weights on the most loaded rank, activation peak (forward and
sampler), non-torch and NCCL terms, CUDA graph pool, KV bytes per token, num_gpu_blocks,
blocks per request and max concurrency, capacity errors and the log lines, recomputed from the
models' config.json numbers and the GPUs' spec sheets with the formulas documented in
``costmodels/memory.py`` (never by calling the code under test for an expected value).
Shared numbers are in ``cmvalues.py``.
"""

from __future__ import annotations

import math

import pytest
from cmutil import make_cfg
from cmvalues import GIB, L8, L70
from servesim.costmodels import plan_memory

# ---------------------------------------------------------------------------------------------
# memory: num_gpu_blocks


def weights_llama(c, tp, pp=1, wbytes=2):
    """Bytes of weights on the most loaded rank: sharded linears over ceil(L/pp) layers,
    norms, vocab-parallel embedding + LM head (vocab padded to 64), final norm, rope cache."""
    h, L, hd = c["h"], c["L"], c["hd"]
    nh, kvh = c["nh"] // tp, max(1, c["nkv"] // tp)
    i_r = -(-c["I"] // tp)
    per_layer = ((nh + 2 * kvh) * hd * h + h * nh * hd + 2 * i_r * h + h * i_r) * wbytes
    layers = -(-L // pp)
    norms = 2 * h * layers * 2
    v = -(-(-(-c["V"] // 64) * 64) // tp)
    emb = v * h * 2
    vocab = 2 * emb + h * 2 if pp == 1 else max(emb, emb + h * 2)
    rope = 131072 * hd * 2
    return per_layer * layers + norms + vocab + rope


def test_llama70b_tp4_num_gpu_blocks_by_value():
    p = plan_memory(make_cfg("model.name=llama-3.1-70b", "hardware.name=h100-sxm",
                             "parallel.tensor_parallel_size=4"))
    c = L70
    total = int(79.11 * GIB)
    requested = math.ceil(total * 0.92)  # vLLM 0.22.1 default utilization (request_memory)
    weights = weights_llama(c, 4)
    assert p.weights_bytes == weights
    # H100 defaults: 1024 seqs, 8192 tokens. Activation peak = max(forward of 8192 tokens,
    # dummy sampler 1024 × vocab × 14 B); forward per token: max(attention block
    # 2h + qkv + out, MLP block 3h + 3·I/tp) bf16 elements
    fwd = 8192 * max(2 * 8192 + (16 + 4) * 128 + 16 * 128, 3 * 8192 + 3 * 28672 // 4) * 2
    sampler = 1024 * 128256 * 14
    act = max(fwd, sampler)
    assert p.activation_peak_bytes == act
    non_torch, comm = int(0.15 * GIB), int(0.35 * GIB)  # + NCCL buffers at TP > 1
    # CUDA-graph estimate (vLLM ≥ 0.21, in the KV budget): 51 capture sizes up to 512, each
    # PIECEWISE and FULL (decode sizes ≤ 1024 seqs); the first capture holds 512 tokens'
    # activations + 4 MiB, the other 50 + 50 graphs 4 MiB each
    graphs = 512 * (3 * 8192 + 3 * 28672 // 4) * 2 + 4 * 2**20 * (1 + 50 + 50)
    assert p.cudagraph_bytes == graphs
    available = requested - weights - act - non_torch - comm - graphs
    assert p.available_kv_bytes == available
    per_token = 80 * 2 * 2 * 128 * 2  # layers · (K+V) · 8/4 KV heads · head_dim · bf16
    assert p.kv_bytes_per_token == per_token
    assert p.num_gpu_blocks == available // (16 * per_token)
    assert p.blocks_per_request == 131072 // 16


def test_pp2_weights_and_kv_per_rank():
    p = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             "parallel.pipeline_parallel_size=2"))
    assert p.weights_bytes == weights_llama(L8, 1, pp=2)
    assert p.kv_bytes_per_token == 16 * 2 * 8 * 128 * 2  # 32 / 2 layers on a stage
    assert p.comm_bytes == int(0.35 * GIB)
    # the last stage limits: the LM head + final norm, the sampler pass (256 × vocab × 14 B;
    # profile_run samples on the last stage only) and the received hidden states + residual
    # (2 × 2,048 tokens × 4,096 × 2 B); the first stage's peak is its forward alone
    fwd = 2048 * (3 * 4096 + 3 * 14336) * 2
    act_last = 2 * 2048 * 4096 * 2 + max(fwd, 256 * 128256 * 14)
    assert p.activation_peak_bytes == act_last
    graphs = 512 * (3 * 4096 + 3 * 14336) * 2 + 4 * 2**20 * (1 + 50 + 34)
    avail = math.ceil(int(79.15 * GIB) * 0.92) - p.weights_bytes - act_last - int(0.15 * GIB) \
        - int(0.35 * GIB) - graphs
    assert (p.available_kv_bytes, p.num_gpu_blocks) == (avail, avail // (16 * 65536))


@pytest.mark.parametrize("mml,bs", [(1000, 16), (4097, 32), (8192, 16)])
def test_blocks_per_request_rounds_up(mml, bs):
    """max_model_len not a multiple of the block size: a full-length request needs
    ceil(mml / bs) blocks; "Maximum concurrency" = num_gpu_blocks / that."""
    p = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             f"model.max_model_len={mml}", f"cache.block_size={bs}"))
    need = -(-mml // bs)
    assert p.blocks_per_request == need
    assert p.block_bytes == bs * 131072
    assert p.num_gpu_blocks == p.available_kv_bytes // (bs * 131072)
    assert p.max_concurrency == pytest.approx(p.num_gpu_blocks / need, rel=1e-12)
    assert p.kv_cache_tokens == p.num_gpu_blocks * bs


def test_fp8_weights_and_kv_memory_by_value():
    p = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=h100-sxm",
                             "model.quantization=fp8", "cache.cache_dtype=fp8"))
    # linears at 1 byte, embedding / LM head / norms / rope cache stay bf16
    assert p.weights_bytes == weights_llama(L8, 1, wbytes=1)
    assert p.kv_bytes_per_token == 32 * 2 * 8 * 128 * 1
    assert p.num_gpu_blocks == p.available_kv_bytes // (16 * 65536)
    assert p.weight_format == "fp8" and p.kv_cache_dtype == "fp8"


def test_mixtral_tp2_weights_hold_every_expert():
    p = plan_memory(make_cfg("model.name=mixtral-8x7b", "hardware.name=h100-sxm",
                             "parallel.tensor_parallel_size=2"))
    h, L, E, I = 4096, 32, 8, 14336
    attn = ((16 + 2 * 4) * 128 * h + h * 16 * 128) * 2
    experts = E * (2 * (I // 2) * h + h * (I // 2)) * 2
    router = E * h * 2  # replicated, bf16
    v = 32000 // 2  # 32000 is a multiple of 64
    want = L * (attn + experts + router) + 2 * h * L * 2 + 2 * v * h * 2 + h * 2 \
        + 32768 * 128 * 2
    assert p.weights_bytes == want
    assert not math.isnan(p.max_concurrency)


# ---------------------------------------------------------------------------------------------
# memory: the remaining terms by value


def test_llama8b_a100_plan_every_term():
    """A100 defaults (256 seqs, 2048 tokens): weights, activation = max(forward of 2048
    tokens, sampler 256 × vocab × 14 B), non-torch 0.15 GiB, no NCCL at TP 1; CUDA graphs
    (51 capture sizes × 2 for FULL_AND_PIECEWISE × 4 MiB + activations of the largest, 512
    tokens; FULL decode graphs only up to 256 = max_num_seqs) come out of the KV budget
    (vLLM ≥ 0.21)."""
    p = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb"))
    total = int(79.15 * GIB)
    assert (p.total_bytes, p.requested_bytes) == (total, math.ceil(total * 0.92))  # 0.92
    assert p.weights_bytes == weights_llama(L8, 1)
    per_tok = max(2 * 4096 + 6144 + 4096, 3 * 4096 + 3 * 14336)  # MLP block is larger
    fwd = 2048 * per_tok * 2
    assert p.activation_peak_bytes == max(fwd, 256 * 128256 * 14) == 256 * 128256 * 14
    assert (p.non_torch_bytes, p.comm_bytes) == (int(0.15 * GIB), 0)
    # PIECEWISE: 51 sizes 1…512; FULL: the 35 decode sizes 1…256; first capture + 84 more
    assert p.cudagraph_captures == (("PIECEWISE", 51, 512), ("FULL", 35, 256))
    assert p.cudagraph_bytes == 512 * per_tok * 2 + 4 * 2**20 * (1 + 50 + 34)
    assert p.cudagraph_in_kv_budget
    avail = math.ceil(total * 0.92) - p.weights_bytes - p.activation_peak_bytes - int(0.15 * GIB) \
        - p.cudagraph_bytes
    assert p.available_kv_bytes == avail
    assert p.num_gpu_blocks == p.num_gpu_blocks_computed == avail // (16 * 131072)
    d = p.as_dict()
    assert d["kv_cache_tokens"] == p.num_gpu_blocks * 16
    assert d["weights_gib"] == p.weights_bytes / GIB and d["total_gib"] == total / GIB
    assert d["available_kv_gib"] == avail / GIB
    assert d["max_concurrency"] == p.num_gpu_blocks / (131072 // 16)


def test_cudagraph_pool_in_the_kv_budget_by_value():
    """One graph per capture size in PIECEWISE mode; FULL_DECODE_ONLY: the uniform decode sizes
    only (≤ max_num_seqs); FULL: every size as a FULL graph; with LoRA, each twice (vLLM's
    ``cudagraph_specialize_lora``: without and with adapters); the estimate leaves the KV
    budget unless VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0."""
    from servesim.costmodels.memory import plan_memory_for
    from servesim.costmodels.specs import load_hardware_spec, load_model_spec

    base = ("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb")
    cfg = make_cfg(*base, "compilation.cudagraph_mode=PIECEWISE")
    spec, hw = load_model_spec(cfg.model), load_hardware_spec(cfg.hardware)
    a = plan_memory_for(cfg, spec, hw)
    off = make_cfg(*base, "compilation.cudagraph_mode=PIECEWISE",
                   "cache.memory_profiler_estimate_cudagraphs=false")
    b = plan_memory_for(off, spec, hw)
    per_tok = 3 * 4096 + 3 * 14336
    graphs = 51 * 4 * 2**20 + 512 * per_tok * 2  # first (512 tokens + 4 MiB) + 50 × 4 MiB
    assert a.cudagraph_captures == (("PIECEWISE", 51, 512),)
    assert a.cudagraph_bytes == b.cudagraph_bytes == graphs
    assert a.available_kv_bytes == b.available_kv_bytes - graphs
    assert a.num_gpu_blocks == a.available_kv_bytes // (16 * 131072)
    dec = plan_memory(make_cfg(*base, "compilation.cudagraph_mode=FULL_DECODE_ONLY"))
    assert dec.cudagraph_captures == (("FULL", 35, 256),)
    assert dec.cudagraph_bytes == 35 * 4 * 2**20 + 256 * per_tok * 2
    full = plan_memory(make_cfg(*base, "compilation.cudagraph_mode=FULL"))
    assert full.cudagraph_captures == (("FULL", 51, 512),) and full.cudagraph_bytes == graphs
    lora = plan_memory(make_cfg(*base, "lora.enable_lora=true", "lora.max_loras=4"))
    assert lora.cudagraph_captures == (("PIECEWISE", 102, 512), ("FULL", 70, 256))
    assert lora.cudagraph_bytes == 512 * per_tok * 2 + 4 * 2**20 * (1 + 101 + 69)
    none = plan_memory(make_cfg(*base, "compilation.cudagraph_mode=NONE"))
    assert none.cudagraph_bytes == 0 and none.available_kv_bytes == b.available_kv_bytes


def test_deepseek_mla_moe_memory_terms():
    """MLA caches the kv_lora_rank + rope latent (512 + 64) per layer on every TP rank; the
    MoE activation per token: 2h + top_k·(3·I_moe/tp + h) + 3·I_shared/tp."""
    p = plan_memory(make_cfg("model.name=deepseek-v3", "hardware.name=h200-sxm",
                             "parallel.tensor_parallel_size=8"))
    assert p.kv_bytes_per_token == 61 * (512 + 64) * 2
    h, tp = 7168, 8
    attn = 2 * h + 16 * (128 + 64) + 512 + 64 + 16 * 128
    dense = 3 * h + 3 * (18432 // tp)
    moe = 2 * h + 8 * (3 * (2048 // tp) + h) + 3 * (2048 // tp)
    fwd = 8192 * max(attn, dense, moe) * 2
    assert p.activation_peak_bytes == max(fwd, 1024 * 129280 * 14)


def test_sliding_window_limits_blocks_per_request():
    """Mistral-7B (window 4096): a request holds at most window − 1 + a step's tokens, capped
    by max_model_len, + 1 block because the window need not start at a block boundary
    (vLLM's ``SlidingWindowSpec.max_memory_usage_bytes``)."""
    p = plan_memory(make_cfg("model.name=mistral-7b-v0.1", "hardware.name=a100-sxm4-80gb"))
    assert p.blocks_per_request == -(-(4096 - 1 + 2048) // 16) + 1 == 385
    assert p.max_concurrency == p.num_gpu_blocks / p.blocks_per_request
    short = plan_memory(make_cfg("model.name=mistral-7b-v0.1", "hardware.name=a100-sxm4-80gb",
                                 "model.max_model_len=5000"))
    assert short.blocks_per_request == -(-5000 // 16) + 1 == 314  # min(6143, 5000) tokens


def test_int4_and_tied_weights_by_value():
    p = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             "model.quantization=int4-awq"))
    assert p.weights_bytes == int(weights_llama(L8, 1, wbytes=0.5 + 2 / 128))


@pytest.mark.parametrize("util,ok", [(0.9, True), (0.235, False)])
def test_capacity_errors_at_their_boundaries(util, ok):
    """Llama-8B weights ≈ 14.99 GiB; at 0.235 × 79.15 GiB = 18.6 GiB the KV budget left after
    activations cannot hold one 131,072-token request (16 GiB)."""
    from servesim.simulator.errors import CapacityError

    cfg = make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                   f"cache.gpu_memory_utilization={util}")
    if ok:
        assert plan_memory(cfg).num_gpu_blocks > 8192
    else:
        with pytest.raises(CapacityError, match="max seq len"):
            plan_memory(cfg)
    with pytest.raises(CapacityError, match="model weights take"):
        plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             "cache.gpu_memory_utilization=0.18"))
    with pytest.raises(CapacityError, match="No available memory"):
        plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             "cache.gpu_memory_utilization=0.195"))


# ---------------------------------------------------------------------------------------------
# memory: forward activations, config.json variants, log lines, graph pool, errors


def test_forward_activation_bytes_by_value():
    """Peak live activations per token (bf16 elements): max(attention block 2h + qkv + out,
    MLP block 3h + 3·I/tp; MoE 2h + top_k·(3·I_moe/tp + h) (+ 3·I_shared/tp))."""
    from servesim.costmodels.memory import forward_activation_bytes
    from servesim.costmodels.specs import load_model_spec

    def spec(name):
        return load_model_spec(make_cfg(f"model.name={name}").model)

    l8 = spec("llama-3.1-8b")
    assert forward_activation_bytes(l8, 100, 2) == 100 * max(
        2 * 4096 + (16 + 2 * 4) * 128 + 16 * 128, 3 * 4096 + 3 * 7168) * 2
    l70 = spec("llama-3.1-70b")
    # TP 16: 4 query heads, 1 (replicated) KV head; MLP 3h + 3·1792
    assert forward_activation_bytes(l70, 10, 16) == 10 * max(
        2 * 8192 + (4 + 2) * 128 + 4 * 128, 3 * 8192 + 3 * 1792) * 2
    mx = spec("mixtral-8x7b")
    assert forward_activation_bytes(mx, 7, 2) == 7 * max(
        2 * 4096 + (16 + 8) * 128 + 16 * 128, 2 * 4096 + 2 * (3 * 7168 + 4096)) * 2
    ds = spec("deepseek-v3")
    attn = 2 * 7168 + 16 * (128 + 64) + 512 + 64 + 16 * 128
    moe = 2 * 7168 + 8 * (3 * 256 + 7168) + 3 * 256
    assert forward_activation_bytes(ds, 3, 8) == 3 * max(attn, 3 * 7168 + 3 * 2304, moe) * 2
    # with few sequences the forward pass, not the sampler, sets the activation peak
    p = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             "scheduler.max_num_seqs=16"))
    assert p.activation_peak_bytes == forward_activation_bytes(l8, 2048, 1) == 2048 * (
        3 * 4096 + 3 * 14336) * 2


def test_tied_embeddings_partial_rotary_and_bias_weights(tmp_path):
    """A config.json with tied embeddings (the LM head is the embedding on one stage, a copy
    on the last stage with PP), q/k/v biases and a partial rotary dimension."""
    import json

    cfgjson = {"architectures": ["X"], "model_type": "llama", "hidden_size": 256,
               "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
               "tie_word_embeddings": True, "attention_bias": True,
               "partial_rotary_factor": 0.5}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfgjson))
    h, hd, L = 256, 32, 4
    v = -(-1000 // 64) * 64  # vocab padded to 1024
    qkv_n = (8 + 2 * 2) * hd
    linears = (qkv_n * h + qkv_n) * 2 + h * h * 2 + 2 * 512 * h * 2 + h * 512 * 2
    norms = 2 * h * L * 2
    rope = 4096 * (hd // 2) * 2
    p1 = plan_memory(make_cfg(f"model.name={path}", "hardware.name=a100-sxm4-80gb"))
    assert p1.weights_bytes == L * linears + norms + v * h * 2 + h * 2 + rope
    p2 = plan_memory(make_cfg(f"model.name={path}", "hardware.name=a100-sxm4-80gb",
                              "parallel.pipeline_parallel_size=2"))
    # 2 layers per stage; the busier end stage holds the embedding or head + final norm
    assert p2.weights_bytes == 2 * linears + 2 * h * 2 * 2 + v * h * 2 + h * 2 + rope


def test_memory_log_lines_and_dict_by_value():
    p = plan_memory(make_cfg("model.name=llama-3.1-70b", "hardware.name=h100-sxm",
                             "parallel.tensor_parallel_size=4"))
    g = GIB
    lines = p.log_lines()
    assert lines[0] == f"Model loading took {p.weights_bytes / g:.4f} GiB"
    assert lines[1] == (
        f"Memory profiling: total_gpu_memory ({p.total_bytes / g:.2f}GiB) x "
        f"gpu_memory_utilization (0.92) = {p.requested_bytes / g:.2f}GiB; model weights take "
        f"{p.weights_bytes / g:.2f}GiB; non_torch_memory takes "
        f"{(p.non_torch_bytes + p.comm_bytes) / g:.2f}GiB; PyTorch activation peak memory "
        f"takes {p.activation_peak_bytes / g:.2f}GiB; the CUDA graph memory estimate takes "
        f"{p.cudagraph_bytes / g:.2f}GiB; the rest of the memory reserved for KV "
        f"Cache is {p.available_kv_bytes / g:.2f}GiB.")
    assert lines[2:4] == [("Profiling CUDA graph memory: PIECEWISE=51 (largest=512), FULL=51 "
                          "(largest=512)"),
                          f"Estimated CUDA graph memory: {p.cudagraph_bytes / g:.2f} GiB total"]
    assert lines[-1] == f"CUDA graph pool ~{p.cudagraph_bytes / g:.2f} GiB (counted in the KV budget)"
    assert lines[-2] == f"# GPU blocks: {p.num_gpu_blocks}, # CPU blocks: 0"
    d = p.as_dict()
    assert d["notes"] == [] and d["model"] == "llama-3.1-70b" and d["hardware"] == "h100-sxm"
    assert (d["tensor_parallel_size"], d["pipeline_parallel_size"]) == (4, 1)
    assert d["cudagraph_in_kv_budget"] is True


def test_sliding_window_request_tokens_exactly():
    p = plan_memory(make_cfg("model.name=mistral-7b-v0.1", "hardware.name=a100-sxm4-80gb",
                             "scheduler.max_num_batched_tokens=2050"))
    assert p.blocks_per_request == -(-(4096 - 1 + 2050) // 16) + 1 == 386


def test_graph_pool_follows_the_capture_sizes():
    p = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             "compilation.max_cudagraph_capture_size=64"))
    sizes = [1, 2, 4] + list(range(8, 65, 8))
    per_tok = 3 * 4096 + 3 * 14336
    # (FULL decode graphs: every size ≤ 256 = max_num_seqs; first capture + the others)
    assert p.cudagraph_bytes == (len(sizes) * 2 - 1) * 4 * 2**20 + 64 * per_tok * 2
    q = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             "compilation.cudagraph_capture_sizes=[1,3,100]"))
    assert q.cudagraph_bytes == (3 * 2 - 1) * 4 * 2**20 + 100 * per_tok * 2


def test_max_model_len_error_names_the_estimate():
    """The estimate in vLLM's message: available // block bytes · block size tokens."""
    from servesim.simulator.errors import CapacityError

    ok = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=l4",
                              "model.max_model_len=16384"))
    est = (ok.available_kv_bytes // ok.block_bytes) * 16
    with pytest.raises(CapacityError, match=f"estimated maximum model length is {est}\\."):
        plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=l4"))
    assert ok.model == "llama-3.1-8b" and ok.hardware == "l4"


def test_forward_activation_attention_block_dominates(tmp_path):
    """A narrow MLP (intermediate 64): the attention block 2h + qkv + out sets the peak."""
    import json

    from servesim.costmodels.memory import forward_activation_bytes
    from servesim.costmodels.specs import load_model_spec

    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
        "vocab_size": 1000, "max_position_embeddings": 2048}))
    spec = load_model_spec(make_cfg(f"model.name={path}").model)
    h, hd = 256, 32
    for tp, nh, kv in ((1, 8, 4), (2, 4, 2)):
        attn = 2 * h + (nh + 2 * kv) * hd + nh * hd
        mlp = 3 * h + 3 * -(-64 // tp)
        assert attn > mlp
        assert forward_activation_bytes(spec, 5, tp) == 5 * attn * 2
