"""``--cpu-offload-gb`` (vLLM ``UVAOffloader``): which decoder weights go to pinned CPU memory,
the KV cache they leave room for, and the step time of reading them over the host link. Values
recomputed from Llama-3.1-8B's shapes (bf16) and the A100's spec sheet (PCIe4 x16: 32 GB/s)."""

from __future__ import annotations

import pytest
from cmutil import decode, make_cfg, prefill
from servesim.costmodels import build_cost_model, load_model_spec, plan_memory
from servesim.costmodels.config import ModelConfig
from servesim.costmodels.memory import pp_layer_ranges, uva_offload
from servesim.costmodels.quant import WeightFormat
from servesim.simulator.errors import ConfigError

GIB = 1 << 30
L8B = ("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
       "cache.gpu_memory_utilization=0.9")
# Llama-3.1-8B per layer, bf16 bytes: qkv 4096 x 6144, o 4096 x 4096, gate_up 4096 x 28672,
# down 14336 x 4096, two RMSNorm weights of 4096
QKV, O, GU, DOWN, NORM = (2 * 4096 * 6144, 2 * 4096 * 4096, 2 * 4096 * 28672,
                          2 * 14336 * 4096, 2 * 2 * 4096)
LAYER = QKV + O + GU + DOWN + NORM
BF16 = WeightFormat("bf16", 2.0, "bf16")


def test_pp_layer_ranges_as_vllm_get_pp_indices():
    """L // pp layers per stage; the remainder one each from the second-to-last stage back."""
    assert pp_layer_ranges(32, 3) == [(0, 11), (11, 22), (22, 32)]
    assert pp_layer_ranges(61, 4) == [(0, 15), (15, 30), (30, 46), (46, 61)]
    assert pp_layer_ranges(32, 1) == [(0, 32)]


def test_offloaded_parameters_in_module_order_until_the_limit():
    """Parameters from layer 0 on (qkv, o, gate_up, down, norms), each while the total is
    below the limit, so the last one may pass it: 0.5 GiB takes layer 0 whole and layer 1's
    qkv, o and gate_up (0.703 GiB); PP stages each offload their own first layers."""
    spec = load_model_spec(ModelConfig(name="llama-3.1-8b"))
    u = uva_offload(spec, BF16, 1, 1, 0.5)
    assert u.bytes_per_rank == LAYER + QKV + O + GU
    assert u.layers == {"qkv_proj": 2, "o_proj": 2, "gate_up_proj": 2, "down_proj": 1}
    assert uva_offload(spec, BF16, 1, 1, 0).layers == {}
    everything = uva_offload(spec, BF16, 1, 1, 1000)
    assert everything.bytes_per_rank == 32 * LAYER
    assert set(everything.layers.values()) == {32}
    # TP 2 halves every shard: 0.5 GiB then spans layers 0-1 and layer 2's qkv + o + gate_up
    tp2 = uva_offload(spec, BF16, 2, 1, 0.5)
    assert tp2.bytes_per_rank == 2 * (LAYER - NORM) // 2 + 2 * NORM + (QKV + O + GU) // 2
    assert uva_offload(spec, BF16, 1, 2, 0.5).layers == {
        "qkv_proj": 4, "o_proj": 4, "gate_up_proj": 4, "down_proj": 2}


def test_offload_frees_gpu_memory_for_the_kv_cache():
    """Weights on the GPU drop by the offloaded bytes; the KV cache gains them (2 MiB
    blocks); vLLM logs the total offloaded."""
    base = plan_memory(make_cfg(*L8B))
    off = plan_memory(make_cfg(*L8B, "cpu_offload_gb=1"))
    moved = 2 * LAYER + QKV + O + GU  # layers 0-1, then layer 2 up to its gate_up (1.109 GiB)
    assert off.cpu_offload_bytes == moved
    assert base.weights_bytes - off.weights_bytes == moved
    assert off.available_kv_bytes - base.available_kv_bytes == moved
    assert off.num_gpu_blocks == (base.available_kv_bytes + moved) // (2 * 2**20)
    assert off.log_lines()[0] == "Total CPU offloaded parameters: 1.11"
    assert not any("offloaded" in x for x in base.log_lines())


def test_offloaded_layers_wait_for_the_host_link():
    """Each offloaded layer's linear takes max(its own time, its weight bytes / 32 GB/s): the
    step gains one op, Σ layers × max(0, bytes/32e9 − own time), and every other op is
    unchanged; a fitted GEMM scale scales the GEMMs' own times, not the link."""
    m0 = build_cost_model(make_cfg(*L8B))
    m1 = build_cost_model(make_cfg(*L8B, "cpu_offload_gb=1"))
    offloaded = (("qkv_proj", QKV, 3), ("o_proj", O, 3), ("gate_up_proj", GU, 3),
                 ("down_proj", DOWN, 2))
    for scale in (1.0, 1.5):
        for m in (m0, m1):
            m.set_scales({"gemm": scale} if scale != 1.0 else {})
        for batch in (decode(1, 1000), prefill(2048)):
            ops0 = {o.name: o for o in m0.step_time(batch).breakdown}
            ops1 = {o.name: o for o in m1.step_time(batch).breakdown}
            want = sum(f * max(0.0, nbytes / 32e9 - ops0[name].seconds / ops0[name].count)
                       for name, nbytes, f in offloaded)
            uva = ops1.pop("uva_weight_reads")
            assert (uva.seconds, uva.bytes, uva.bound) == (
                pytest.approx(want, rel=1e-12), sum(f * b for _, b, f in offloaded), "host-link")
            assert {k: o.seconds for k, o in ops1.items() if k not in ("host", "kernel_launch")} \
                == {k: o.seconds for k, o in ops0.items() if k not in ("host", "kernel_launch")}
            assert m1.step_seconds(batch) - m0.step_seconds(batch) == pytest.approx(want,
                                                                                   rel=1e-6)


# Mixtral-8x7B at TP 2, bf16, per layer and rank: qkv (16 + 2·4) heads · 128 × 4096, o 4096 ×
# 2048, router 4096 × 8 (replicated), w13 8 experts × 14336 × 4096, w2 8 × 4096 × 7168, norms
MQKV, MO, MGATE, MW13, MW2, MNORM = (3072 * 4096 * 2, 4096 * 2048 * 2, 4096 * 8 * 2,
                                     8 * 14336 * 4096 * 2, 8 * 4096 * 7168 * 2, 2 * 4096 * 2)
MLAYER = MQKV + MO + MGATE + MW13 + MW2 + MNORM  # 1.3516 GiB


def test_moe_offload_in_vllm_module_order():
    """Mixtral: attention, router, routed experts (w13, w2), norms; 4 GiB spans layers 0-1 and
    layer 2 up to its w2. DeepSeek-V3: its 3 dense layers, then router, shared experts, routed
    experts (vLLM's registration order); a moe_layer_freq of 2 makes every other layer dense."""
    from dataclasses import replace

    mix = load_model_spec(ModelConfig(name="mixtral-8x7b"))
    u = uva_offload(mix, BF16, 2, 1, 4)
    assert u.per_stage == (3 * MLAYER - MNORM,)
    assert u.layers == {"qkv_proj": 3, "o_proj": 3, "gate": 3, "experts.w13": 3,
                        "experts.w2": 3}
    ds = load_model_spec(ModelConfig(name="deepseek-v3"))
    assert list(uva_offload(ds, BF16, 8, 1, 4).layers) == [
        "fused_qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj", "gate_up_proj", "down_proj",
        "gate", "shared_experts.gate_up_proj", "shared_experts.down_proj", "experts.w13",
        "experts.w2"]
    alt = replace(ds, first_k_dense_replace=1, moe_layer_freq=2)
    assert [alt.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    every = uva_offload(alt, BF16, 8, 1, 10_000).layers
    assert (every["gate_up_proj"], every["gate"], every["o_proj"]) == (31, 30, 61)


def test_moe_step_reads_only_the_experts_hit():
    """A routed-expert layer reads over the link only the experts the step's tokens hit,
    E·(1 − (1 − k/E)^T) of 8 (top-2); with the measured fused-MoE time both linears of a
    layer share it: 3 layers × max(0, read(w13) + read(w2) − t)."""
    base = ("model.name=mixtral-8x7b", "hardware.name=h100-sxm",
            "parallel.tensor_parallel_size=2")
    for cal in ("hardware.calibration=none", None):
        extra = (cal,) if cal else ()
        m0 = build_cost_model(make_cfg(*base, *extra))
        m1 = build_cost_model(make_cfg(*base, *extra, "cpu_offload_gb=4"))
        for T in (1, 64):
            hit = 8 * (1 - (1 - 2 / 8) ** T)
            reads = {"qkv_proj": MQKV, "o_proj": MO, "gate": MGATE, "experts.w13": MW13 * hit / 8,
                     "experts.w2": MW2 * hit / 8}
            m0.step_time(decode(T, 100 * T))
            own = {lin.name: m0._gemm_op(lin.op, lin, n, k, T).seconds / lin.layers
                   for lin, n, k in m0._gemms}
            measured = m0._moe_cache.get(T) if cal is None else None
            assert (measured is not None) == (cal is None)  # (H100's file tables Mixtral's MoE)
            want = sum(3 * max(0.0, reads[x] / 64e9 - own[x])
                       for x in reads if not (measured and x.startswith("experts")))
            if measured:
                want += 3 * max(0.0, (reads["experts.w13"] + reads["experts.w2"]) / 64e9
                                - measured[0])
            got = {o.name: o for o in m1.step_time(decode(T, 100 * T)).breakdown}
            assert got["uva_weight_reads"].seconds == pytest.approx(want, rel=1e-9), (cal, T)


def test_pipeline_stages_weigh_their_own_layers():
    """The most loaded GPU is the largest stage's weights less its own offload. DeepSeek-V3 at
    PP 2: 61 layers split 31 / 30 (vLLM), stage 0 with the 3 dense layers and the embedding,
    stage 1 with the LM head and final norm; the stages partition the model (each keeps a
    rotary cache)."""
    from servesim.costmodels.memory import stage_weight_bytes, weight_bytes_per_rank

    ds = load_model_spec(ModelConfig(name="deepseek-v3"))
    fp8 = WeightFormat("fp8", 1.0 + 4 / (128 * 128), "fp8")
    s0, s1 = stage_weight_bytes(ds, fp8, 8, 2)
    (whole,) = stage_weight_bytes(ds, fp8, 8, 1)
    rope = ds.max_position_embeddings * ds.qk_rope_head_dim * 2
    assert s0 + s1 - rope == pytest.approx(whole, abs=1)
    assert weight_bytes_per_rank(ds, fp8, 8, 2) == int(max(s0, s1))
    off = uva_offload(ds, fp8, 8, 2, 40)
    keep = weight_bytes_per_rank(ds, fp8, 8, 2, off)
    assert keep == int(max(s0 - off.per_stage[0], s1 - off.per_stage[1])) > 0


def test_cpu_offload_gb_is_validated():
    for bad in ("-1", "inf", "nan", "abc"):
        with pytest.raises(ConfigError, match="cpu_offload_gb"):
            make_cfg(*L8B, f"cpu_offload_gb={bad}")
    assert "cpu_offload_gb" not in make_cfg(*L8B).dump_tree()  # unset: dumps and hashes as before


def test_router_stays_bf16_in_a_quantized_model():
    """vLLM keeps the MoE router (``gate``) unquantized: DeepSeek-V3's (7168 × 256, + a 256
    bias for noaux_tc routing) weighs 2 bytes a weight in an fp8 checkpoint, replicated over TP;
    a whole stage (default pp = 1) is the model."""
    from servesim.costmodels.memory import _layer_linears, _linear_bytes, stage_weight_bytes

    ds = load_model_spec(ModelConfig(name="deepseek-v3"))
    fp8 = WeightFormat("fp8", 1.0 + 4 / (128 * 128), "fp8")
    gate = next(x for x in _layer_linears(ds)[2] if x.op == "router")
    assert _linear_bytes(gate, fp8, 8) == 7168 * 256 * 2 + 256 * 2
    assert stage_weight_bytes(ds, fp8, 8) == stage_weight_bytes(ds, fp8, 8, 1)


def test_pipeline_stages_share_the_smallest_block_count():
    """vLLM ``get_kv_cache_configs``: each stage's KV memory (the utilization budget less its
    own weights, its own activation peak, non-torch memory) over its own layers' KV bytes per
    block; every stage gets the smallest count. The profile run's sampler pass runs on the
    last stage only, and the second stage holds the received hidden states + residual
    (8,192 × 7,168 bf16 each). DeepSeek-V3 TP 8 PP 2 on H200: stage 1 (30 MoE layers, the
    head, the sampler pass and the received activations) limits, not stage 0 (31 layers, the
    3 dense ones and the embedding), which would without them."""
    from servesim.costmodels.memory import forward_activation_bytes, stage_weight_bytes

    cfg = make_cfg("model.name=deepseek-v3", "hardware.name=h200-sxm",
                   "parallel.tensor_parallel_size=8", "parallel.pipeline_parallel_size=2",
                   "model.max_model_len=32768", "model.quantization=fp8")
    p = plan_memory(cfg)
    ds = load_model_spec(ModelConfig(name="deepseek-v3"))
    fp8 = WeightFormat("fp8", 1.0 + 4 / (128 * 128), "fp8")
    s0, s1 = stage_weight_bytes(ds, fp8, 8, 2)
    assert p.weights_bytes == int(s1) > s0  # the heavier stage is reported
    base = p.requested_bytes - p.non_torch_bytes - p.comm_bytes
    if p.cudagraph_in_kv_budget:
        base -= p.cudagraph_bytes
    fwd = forward_activation_bytes(ds, 8192, 8)
    act0, act1 = fwd, 2 * 8192 * 7168 * 2 + max(fwd, 1024 * 129280 * 14)
    assert p.activation_peak_bytes == act1 > act0  # (the most loaded stage, as the weights)
    per_layer_block = p.block_size * 576 * 2  # MLA: 576 bf16 elements a token and layer
    blocks = [(base - int(s0) - act0) // (31 * per_layer_block),
              (base - int(s1) - act1) // (30 * per_layer_block)]
    assert p.num_gpu_blocks == min(blocks) == blocks[1]
    assert p.kv_bytes_per_token == 30 * 576 * 2
    assert (base - int(s0) - act1) // (31 * per_layer_block) < blocks[1]  # (one act for all)
