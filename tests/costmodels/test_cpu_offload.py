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
    """Each offloaded layer's GEMM takes max(its own time, its weight bytes / 32 GB/s); the
    rest is unchanged: a one-token decode step grows by Σ layers × (bytes/32e9 − own time)."""
    m0 = build_cost_model(make_cfg(*L8B))
    m1 = build_cost_model(make_cfg(*L8B, "cpu_offload_gb=1"))
    for batch in (decode(1, 1000), prefill(2048)):
        ops0 = {o.name: o for o in m0.step_time(batch).breakdown}
        ops1 = {o.name: o for o in m1.step_time(batch).breakdown}
        want = 0.0
        for name, nbytes, layers in (("qkv_proj", QKV, 3), ("o_proj", O, 3),
                                     ("gate_up_proj", GU, 3), ("down_proj", DOWN, 2)):
            own = ops0[name].seconds / ops0[name].count
            got = ops1[name].seconds - ops0[name].seconds
            assert got == pytest.approx(layers * max(0.0, nbytes / 32e9 - own), rel=1e-9)
            want += got
        assert m1.step_seconds(batch) - m0.step_seconds(batch) == pytest.approx(want,
                                                                               rel=1e-6)
    assert ops1["gate_up_proj"].bound == "host-link"  # 7.3 ms per layer even for 2048 tokens


def test_cpu_offload_gb_is_validated():
    for bad in ("-1", "inf", "nan", "abc"):
        with pytest.raises(ConfigError, match="cpu_offload_gb"):
            make_cfg(*L8B, f"cpu_offload_gb={bad}")
    assert "cpu_offload_gb" not in make_cfg(*L8B).dump_tree()  # unset: dumps and hashes as before
