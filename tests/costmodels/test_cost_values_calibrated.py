"""Calibrated cost model by value: measured GEMM (bf16, fp8, grouped MoE), fused-MoE,
all-reduce and prefill-attention tables replace the roofline seconds at measured points (with
the op's FLOPs, bytes, bound, efficiency and provenance pinned); and the engine defaults
vLLM derives (scheduler limits by GPU memory, batch limits, the token budget as a capture size,
build_cost_model passing the resolved config). Shared numbers are in ``cmvalues.py``.
"""

from __future__ import annotations

import pytest
from cmutil import decode, make_cfg, prefill
from cmvalues import A100, H100, PER_REQ, PER_STEP, PER_TOK, check, gemm, model, ops
from servesim.costmodels import build_cost_model

# ---------------------------------------------------------------------------------------------
# calibrated GEMMs: measured seconds at measured points, the grouped-GEMM efficiency for MoE


def _calibrated(model_name, hw_name, rows, *overrides, tp=1, **families):
    """A cost model whose calibration holds only the given GEMM rows (peaks 100 TFLOP/s bf16,
    200 fp8, 1000 GB/s)."""
    from pathlib import Path

    from servesim.costmodels.calibration import Calibration
    from servesim.costmodels.quant import resolve_weight_format
    from servesim.costmodels.specs import load_hardware_spec, load_model_spec
    from servesim.costmodels.step import StepCostModel

    cfg = make_cfg(f"model.name={model_name}", f"hardware.name={hw_name}",
                   f"parallel.tensor_parallel_size={tp}", *overrides)
    spec, hw = load_model_spec(cfg.model), load_hardware_spec(cfg.hardware)
    doc = {"version": 2, "gpu": hw_name, "gemm": rows, **families,
           "peaks": {"bf16_tflops": 100.0, "fp8_tflops": 200.0, "mem_bw_gbps": 1000.0,
                     "link_bw_gbps": 100.0}}
    return StepCostModel(spec, hw, tp=tp, calibration=Calibration(Path("t.yaml"), doc, None),
                         weight_format=resolve_weight_format(cfg.model, spec, hw),
                         cudagraph_sizes=[1, 2, 4, 8])


def test_calibrated_dense_gemms_take_the_measured_time():
    """Dense linears at a measured (m, n, k): seconds = layers × the measured time (fixed
    costs included), efficiency = the roofline at 100% / that time."""
    rows = [{"dtype": "bfloat16", "n": n, "k": k, "m": [1, 8, 64], "seconds": [a, b, c]}
            for (n, k), (a, b, c) in {(6144, 4096): (1e-5, 2e-5, 9e-5),
                                      (4096, 4096): (7e-6, 1.1e-5, 6e-5),
                                      (28672, 4096): (4e-5, 5e-5, 3e-4),
                                      (4096, 14336): (2e-5, 3e-5, 1.5e-4)}.items()]
    m = _calibrated("llama-3.1-8b", "a100-sxm4-80gb", rows)
    o = ops(m, decode(8, 100))
    for name, t in (("qkv_proj", 2e-5), ("o_proj", 1.1e-5), ("gate_up_proj", 5e-5),
                    ("down_proj", 3e-5)):
        assert o[name].seconds == pytest.approx(32 * t, rel=1e-12), name
        assert o[name].provenance == "calibration:t.yaml"
        roof = max(o[name].flops / 32 / A100["peak"], o[name].bytes / 32 / A100["bw"])
        assert o[name].efficiency == pytest.approx(roof / t, rel=1e-12)
        assert o[name].bound == ("compute" if o[name].flops / A100["peak"] >
                                 o[name].bytes / A100["bw"] else "memory")
    # the LM head (128256 × 4096, not in the table) falls back to the roofline
    assert o["lm_head"].provenance.startswith("roofline:nearest")


def test_calibrated_fp8_gemms_use_the_fp8_table():
    rows = [{"dtype": dt, "n": 28672, "k": 4096, "m": [1, 8], "seconds": [t, 2 * t]}
            for dt, t in (("bfloat16", 4e-5), ("fp8", 1e-5))]
    m = _calibrated("llama-3.1-8b", "h100-sxm", rows, "model.quantization=fp8")
    assert ops(m, decode(8, 100))["gate_up_proj"].seconds == pytest.approx(32 * 2e-5,
                                                                          rel=1e-12)
    b = _calibrated("llama-3.1-8b", "h100-sxm", rows)
    assert ops(b, decode(8, 100))["gate_up_proj"].seconds == pytest.approx(32 * 8e-5,
                                                                          rel=1e-12)


def test_calibrated_moe_experts_use_the_efficiency_at_rows_per_expert():
    """Mixtral TP 2, 8 tokens decode: rows = 8·top_k = 16 (token, expert) pairs over
    E·(1 − (1 − k/E)^8) active experts, m = rows / active per expert; the table's measured
    efficiency there, eff = min(1, roofline_table(m) / t), scales the op's own roofline."""
    E, k = 8, 2
    act = E * (1 - (1 - k / E) ** 8)
    m_eff = 16 / act
    shapes = {(14336, 4096): 3e-5, (4096, 7168): 2e-5}
    rows = [{"dtype": "bfloat16", "n": n, "k": kk, "m": [m_eff], "seconds": [t]}
            for (n, kk), t in shapes.items()]
    m = _calibrated("mixtral-8x7b", "h100-sxm", rows, tp=2)
    want = 0.0
    for (n, kk), t in shapes.items():
        flops = 2.0 * 16 * n * kk
        nbytes = act * n * kk * 2 + 16 * (n + kk) * 2
        roof = max(flops / H100["peak"], nbytes / H100["bw"])
        table_roof = max(2 * m_eff * n * kk / 100e12,
                         (n * kk * 2 + m_eff * kk * 2 + m_eff * n * 2) / 1000e9)
        want += roof / min(1.0, table_roof / t)
    o = ops(m, decode(8, 100))["experts"]
    assert o.seconds == pytest.approx(32 * want, rel=1e-9)
    assert o.provenance == "calibration:t.yaml"


def test_calibrated_all_reduce_fields():
    """A measured all-reduce: seconds and bytes per call × calls, bound "link", efficiency =
    the ring roofline 2(p − 1)/p · B / link bw (spec sheet) over the measured time."""
    B = 8 * 4096 * 2
    ar = [{"mode": "graph", "dtype": "bfloat16", "tp": 2, "bytes": [B, 10 * B],
           "seconds": [7e-6, 2e-5]}]
    m = _calibrated("llama-3.1-8b", "h100-sxm", [], tp=2, allreduce=ar)
    o = ops(m, decode(8, 100))["all_reduce"]
    assert (o.count, o.seconds, o.bytes, o.flops, o.bound) == (65, pytest.approx(65 * 7e-6),
                                                                65 * B, 0.0, "link")
    assert o.efficiency == pytest.approx((2 * 1 / 2 * B / 450e9) / 7e-6, rel=1e-12)
    assert o.provenance == "calibration:t.yaml"


def test_calibrated_moe_op_fields():
    """The measured fused-MoE layer time replaces only the routed experts' seconds: counts,
    FLOPs, bytes and bound stay the roofline op's; efficiency = roofline at 100% / seconds."""
    moe = [{"dtype": "bfloat16", "distribution": "balanced", "hidden": 4096, "inter": 14336,
            "topk": 2, "experts": 8, "tp": 2, "ep": 1, "tokens": [1, 8, 64],
            "seconds": [1e-4, 1.5e-4, 2e-4]}]
    plain = model("model.name=mixtral-8x7b", "hardware.name=h100-sxm",
                  "parallel.tensor_parallel_size=2")
    m = _calibrated("mixtral-8x7b", "h100-sxm", [], tp=2, moe=moe)
    a, b = ops(plain, decode(8, 100))["experts"], ops(m, decode(8, 100))["experts"]
    assert (b.count, b.flops, b.bytes, b.bound) == (a.count, a.flops, a.bytes, a.bound)
    assert b.seconds == pytest.approx(32 * 1.5e-4, rel=1e-12)
    assert b.efficiency == pytest.approx(
        max(a.flops / H100["peak"], a.bytes / H100["bw"]) / b.seconds, rel=1e-12)
    assert b.provenance == "calibration:t.yaml"
    c = ops(m, decode(1, 100))["experts"]  # the next token count is looked up anew
    assert c.seconds == pytest.approx(32 * 1e-4, rel=1e-12)


def test_calibrated_prefill_attention_with_a_sliding_window():
    """Mistral-7B (window 4096), measured chunk times at cached contexts 0 and 2992: a chunk
    of c tokens after p cached ones uses the table at min(p rounded down to 16, w) and, when
    c > w, the measured time scaled by windowed pairs / full causal pairs; + 2 µs per layer
    for reshape_and_cache (the measured kernel includes its own fixed cost)."""
    w = 4096
    rows = [{"kv_dtype": "bfloat16", "head_dim": 128, "num_kv_heads": 8, "num_heads": 32,
             "batch": 1, "context": ctx, "chunk": [1000, 5000, 6000],
             "seconds": [s * 1e-5, s * 4e-5, s * 5e-5]} for ctx, s in ((0, 1.0), (2992, 2.0))]
    m = _calibrated("mistral-7b-v0.1", "a100-sxm4-80gb", [], prefill_attention=rows)

    def wp(n):
        return n * (n + 1) / 2 if n <= w else w * (w + 1) / 2 + (n - w) * w

    p, c = 3000, 5000
    p16 = (p >> 4) << 4
    assert p16 == 2992
    t = 2 * 4e-5 * (wp(p16 + c) - wp(p16)) / (c * p16 + c * (c + 1) / 2)
    a = ops(m, prefill(c, p))["attn"]
    assert a.seconds == pytest.approx(32 * (t + 2e-6), rel=1e-9)
    assert a.provenance == "calibration:t.yaml"
    # a chunk inside the window: the measured time as is
    b = ops(m, prefill(1000, 3000))["attn"]
    assert b.seconds == pytest.approx(32 * (2e-5 + 2e-6), rel=1e-9)


# ---------------------------------------------------------------------------------------------
# engine defaults: scheduler and batch limits, capture sizes, build_cost_model


def test_scheduler_defaults_by_memory_and_kind():
    from servesim.costmodels.engine_defaults import scheduler_defaults
    from servesim.costmodels.specs import HardwareSpec

    def hw(name, gib):
        return HardwareSpec(name=name, bf16_tflops=1.0, memory_gib=gib, mem_bw_gbps=1.0)

    assert scheduler_defaults(hw("h100-sxm", 79.11)) == (1024, 8192)
    assert scheduler_defaults(hw("x", 70.0)) == (1024, 8192)
    assert scheduler_defaults(hw("x", 69.9)) == (256, 2048)
    assert scheduler_defaults(hw("a100-sxm4-80gb", 79.15)) == (256, 2048)
    assert scheduler_defaults(hw("l40s", 44.39)) == (256, 2048)


def test_build_cost_model_passes_the_resolved_config():
    from servesim.costmodels.step import HostOverhead

    cfg = make_cfg("model.name=llama-3.1-8b", "hardware.name=h100-sxm",
                   "hardware.calibration=none", "scheduler.max_num_seqs=48",
                   "scheduler.max_num_batched_tokens=1000", "scheduler.async_scheduling=false")
    m = build_cost_model(cfg)
    assert (m.max_num_seqs, m.max_num_batched_tokens) == (48, 1000)
    assert m.capture_sizes[-1] == 96  # min(2·48, 512) capped by 1000 tokens
    host = HostOverhead(per_step_s=1e-3, per_request_s=0.0, per_token_s=0.0)
    h = build_cost_model(cfg, host=host)
    b = decode(8, 100)
    assert h.step_time(b).host_seconds == 1e-3
    assert h.step_seconds(b) - m.step_seconds(b) == pytest.approx(
        1e-3 - (PER_STEP + 8 * PER_REQ + 8 * PER_TOK), rel=1e-9)
    unresolved = make_cfg("model.name=llama-3.1-8b", "hardware.name=h100-sxm",
                          "hardware.calibration=none", resolve=False)
    u = build_cost_model(unresolved)
    assert (u.max_num_seqs, u.max_num_batched_tokens) == (1024, 8192)


def test_batch_limits_fill_unset_values_as_vllm():
    """``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``: hardware defaults
    (A100: 256 seqs, 2048 tokens); without chunked prefill an unset budget is at least
    max_model_len; an unset budget is at most max_num_seqs · max_model_len; an unset
    max_num_seqs is at most the budget. Values given are kept."""
    from servesim.costmodels.engine_defaults import batch_limits
    from servesim.costmodels.specs import HardwareSpec

    a100 = HardwareSpec(name="a100-sxm4-80gb", bf16_tflops=1.0, memory_gib=79.15,
                        mem_bw_gbps=1.0)
    assert batch_limits(a100, None, None, 4096) == (256, 2048)
    assert batch_limits(a100, None, None, 8192, enable_chunked_prefill=False) == (256, 8192)
    assert batch_limits(a100, 4, None, 100, enable_chunked_prefill=False) == (4, 400)
    assert batch_limits(a100, None, None, 4) == (256, 1024)  # 256 · 4
    assert batch_limits(a100, None, 100, 4096) == (100, 100)
    assert batch_limits(a100, 300, 100, 4096) == (300, 100)  # given: kept


def test_the_token_budget_is_a_capture_size():
    """vLLM appends max_num_batched_tokens to the capture sizes when it is ≤ the largest
    (``_set_cudagraph_sizes``): with a 300-token budget a 290-token mixed batch runs the
    300-token PIECEWISE graph (not eager), 250 tokens the 256 one."""
    m = model("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
              "scheduler.max_num_batched_tokens=300")
    assert m.capture_sizes == [1, 2, 4] + list(range(8, 256, 8)) + [256, 272, 288, 300]
    for T, padded in ((290, 300), (300, 300), (250, 256), (9, 16)):
        st = m.step_time(prefill(T))
        assert (st.cudagraph, st.padded_batch) == ("PIECEWISE", padded), T
        check(ops(m, prefill(T))["qkv_proj"], *gemm(padded, 6144, 4096, A100, 32))
