"""Step cost model by value: every op's FLOPs, bytes and seconds (dense GQA, MoE, TP
all-reduce, PP, fp8 weights and KV, MLA, sliding windows), CUDA-graph modes and CPU launch
bounds, the breakdown contract (op order, bound, efficiency, provenance, counts) and the
roofline floor, recomputed from the models' config.json numbers and the GPUs' spec sheets with
the formulas documented in ``costmodels/step.py`` (never by calling the code under test for an
expected value). The shared numbers, formulas and helpers are in ``cmvalues.py``; the memory
plan is pinned in ``test_cost_values_memory.py``, calibrated tables and engine defaults in
``test_cost_values_calibrated.py``.
"""

from __future__ import annotations

import pytest
from cmutil import decode, prefill
from cmvalues import (
    A100,
    ATT_DEC,
    ATT_PRE,
    GEMM,
    GRAPH_LAUNCH,
    GROUPED,
    H100,
    KFIX,
    L8,
    L40S,
    LAUNCH,
    MIX,
    PER_REQ,
    PER_STEP,
    PER_TOK,
    check,
    dense_llama,
    gemm,
    head,
    model,
    ops,
    roof,
    total,
)
from servesim.costmodels import BatchShape

# ---------------------------------------------------------------------------------------------
# dense GQA: Llama-3.1-8B on A100, TP = 1


@pytest.fixture  # per test: see tests/MUTATION.md (fixtures and mutmut)
def m8():
    return model("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb")


@pytest.mark.parametrize("nd,ctx", [(8, 1000), (5, 3000)])
def test_llama8b_decode_step_by_value(m8, nd, ctx):
    """A decode-only batch: FULL CUDA graph, padded to the next capture size (5 → 8)."""
    hw, c = A100, L8
    T = 8  # capture sizes 1, 2, 4, 8, ...
    b = decode(nd, ctx)
    got = ops(m8, b)
    gpu = 0.0
    for name, (f, by, s) in dense_llama(m8, T, hw, c).items():
        check(got[name], f, by, s)
        gpu += s
    # decode attention, all layers: 4·nh·hd FLOPs and 2·nkv·hd·2 KV bytes per context token;
    # per row q/o (2·nh·hd·2 B) + its own KV write; + 2 kernels per layer
    L, kv_tok = c["L"], 2 * c["nkv"] * c["hd"] * 2
    csum = nd * ctx
    f_att = L * csum * 4 * c["nh"] * c["hd"]
    b_att = L * (csum * kv_tok + nd * (2 * c["nh"] * c["hd"] * 2 + kv_tok))
    s_att = max(f_att / (hw["peak"] * ATT_DEC[0]), b_att / (hw["bw"] * ATT_DEC[1])) \
        + L * 2 * KFIX
    check(got["attn"], f_att, b_att, s_att)
    gpu += s_att
    lm, sampler = head(nd, hw, c)  # LM head on the sampled rows only (not padded)
    check(got["lm_head"], *lm)
    check(got["sampler"], *sampler)
    gpu += lm[2] + sampler[2]
    launch = GRAPH_LAUNCH + 9 * LAUNCH  # one graph replay + LM head and 8 sampler kernels
    host = PER_STEP + PER_REQ * nd + PER_TOK * nd
    want = total(max(gpu, launch), host)
    assert m8.step_seconds(b) == pytest.approx(want, rel=1e-12)
    st = m8.step_time(b)
    assert (st.cudagraph, st.padded_batch) == ("FULL", 8)
    assert sum(o.seconds for o in st.breakdown) == pytest.approx(want, rel=1e-12)
    assert st.gpu_seconds == pytest.approx(max(gpu, launch), rel=1e-12)
    assert st.host_seconds == pytest.approx(host, rel=1e-12)
    # synchronous scheduling: the host work adds to the forward
    sync = model("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                 "scheduler.async_scheduling=false")
    assert sync.step_seconds(b) == pytest.approx(max(gpu, launch) + host, rel=1e-12)


def test_llama8b_prefill_chunk_by_value(m8):
    """A 512-token chunk after 1024 cached tokens: PIECEWISE graph (512 is a capture size)."""
    hw, c = A100, L8
    C, P = 512, 1024
    b = prefill(C, P)
    got = ops(m8, b)
    gpu = 0.0
    for name, (f, by, s) in dense_llama(m8, C, hw, c).items():
        check(got[name], f, by, s)
        gpu += s
    L, kv_tok = c["L"], 2 * c["nkv"] * c["hd"] * 2
    pairs = C * P + C * (C + 1) / 2  # causal (query, key) pairs
    f_att = L * pairs * 4 * c["nh"] * c["hd"]
    b_att = L * ((P + C) * kv_tok + C * (2 * c["nh"] * c["hd"] * 2 + kv_tok))
    s_att = max(f_att / (hw["peak"] * ATT_PRE[0]), b_att / (hw["bw"] * ATT_PRE[1])) \
        + L * 2 * KFIX
    check(got["attn"], f_att, b_att, s_att)
    assert got["attn"].bound == "compute"
    gpu += s_att
    lm, sampler = head(1, hw, c)
    gpu += lm[2] + sampler[2]
    # piecewise: L + 1 graph pieces, attention (2 kernels per layer) launched eagerly
    launch = (L + 1) * GRAPH_LAUNCH + L * 2 * LAUNCH + 9 * LAUNCH
    want = total(max(gpu, launch), PER_STEP + PER_REQ + PER_TOK * C)
    assert m8.step_seconds(b) == pytest.approx(want, rel=1e-12)
    assert m8.step_time(b).cudagraph == "PIECEWISE"


def test_llama8b_eager_above_largest_graph(m8):
    """600 tokens (> 512, the largest capture size): eager, one CPU launch per kernel:
    per layer 2 norms + rope + 2 attention + 4 GEMMs + act = 10, + embedding + final norm."""
    b = prefill(600)
    st = m8.step_time(b)
    assert (st.cudagraph, st.padded_batch) == ("NONE", 600)
    n_launch = 32 * 10 + 2 + 9
    assert ops(m8, b)["kernel_launch"].count == n_launch
    gpu = sum(o.seconds for o in st.breakdown if o.name not in ("kernel_launch", "host"))
    assert st.seconds == pytest.approx(total(max(gpu, n_launch * LAUNCH), PER_STEP + PER_REQ
                                             + PER_TOK * 600), rel=1e-12)


def test_async_scheduling_by_value():
    m = model("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
              "scheduler.async_scheduling=true")
    b = decode(16, 500)
    st = m.step_time(b)
    host = PER_STEP + 16 * PER_REQ + 16 * PER_TOK
    assert st.host_seconds == pytest.approx(host, rel=1e-12)
    assert st.seconds == pytest.approx(max(st.gpu_seconds, host) + 20e-6, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# MoE: Mixtral-8x7B, top-2 of 8 experts, TP = 2 on H100


@pytest.fixture
def mix():
    return model("model.name=mixtral-8x7b", "hardware.name=h100-sxm",
                 "parallel.tensor_parallel_size=2")


@pytest.mark.parametrize("T", [1, 3, 256])
def test_mixtral_experts_scale_with_top_k(mix, T):
    """Routed experts (w13 then w2, all 32 layers): FLOPs 2·(T·top_k)·n·k — every token runs
    top_k experts; weight bytes of the E·(1 − (1 − k/E)^T) experts hit; grouped-GEMM
    efficiencies; 3 of the 6 fused-MoE kernels per linear."""
    hw, c = H100, MIX
    E, k, L, h = c["E"], c["k"], c["L"], c["h"]
    b0 = decode(T, 100) if T <= 8 else prefill(T)
    Tp = {3: 4}.get(T, T)  # a decode batch of 3 is padded to the capture size 4
    act = E * (1 - (1 - k / E) ** Tp)
    rows = Tp * k
    f = b = s = 0.0
    for n, kk in ((2 * c["I"] // 2, h), (h, c["I"] // 2)):  # w13 column-, w2 row-sharded
        fl = 2.0 * rows * n * kk
        by = act * n * kk * 2 + rows * (n + kk) * 2
        f += fl * L
        b += by * L
        s += (roof(fl, by, hw["peak"], hw["bw"], GROUPED) + 3 * KFIX) * L
    check(ops(mix, b0)["experts"], f, b, s, count=L)
    # the router: a replicated bf16 GEMM h → E with 2 kernels (gate + top-k)
    check(ops(mix, b0)["router"], *gemm(Tp, E, h, hw, L, kernels=2))


def test_mixtral_active_params_and_no_dense_mlp(mix):
    o = ops(mix, decode(1, 10))
    assert "gate_up_proj" not in o and "act_fn" not in o
    # top-2 of 8: one token moves 2 experts' weights (w13 + w2 = 3·h·I per expert, /TP)
    assert o["experts"].bytes == pytest.approx(
        32 * (2 * 3 * 4096 * 14336 * 2 / 2 + 2 * (14336 + 4096 + 4096 + 7168) * 2), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# TP all-reduce: payload and algorithm


def allreduce(T, h, p, hw, nvlink=True):
    """Seconds per call: the cheapest of NCCL ring 2(p−1)·lat + 2(p−1)/p·B/bw and, over
    NVLink for B ≤ 8 MiB, one-shot lat + (p−1)·B/bw and two-shot 2·lat + 2(p−1)/p·B/bw."""
    B = T * h * 2
    lat, bw = hw["lat"], hw["link_bw"]
    algos = {"ring": 2 * (p - 1) * lat + 2 * (p - 1) / p * B / bw}
    if nvlink and B <= 8 * 2**20:
        algos["one-shot"] = lat + (p - 1) * B / bw
        algos["two-shot"] = 2 * lat + 2 * (p - 1) / p * B / bw
    name = min(algos, key=algos.get)
    return B, algos[name], name


@pytest.mark.parametrize("T,algo", [(8, "one-shot"), (512, "two-shot"), (1024, "ring")])
def test_llama70b_tp4_all_reduce(T, algo):
    """2 all-reduces per layer (after o_proj and down_proj) + 1 for the vocab-parallel
    embedding, each of the full hidden state T·h·2 bytes."""
    m = model("model.name=llama-3.1-70b", "hardware.name=h100-sxm",
              "parallel.tensor_parallel_size=4")
    B, t, name = allreduce(T, 8192, 4, H100)
    assert name == algo
    b = decode(T, 100) if T <= 8 else prefill(T)
    o = ops(m, b)["all_reduce"]
    assert o.count == 2 * 80 + 1
    assert o.bytes == 161 * B
    assert o.seconds == pytest.approx(161 * t, rel=1e-12)
    # and the sharded GEMMs: qkv keeps 64/4 query heads and 8/4 KV heads per rank
    check(ops(m, b)["qkv_proj"], *gemm(T, (16 + 2 * 2) * 128, 8192, H100, 80))
    check(ops(m, b)["down_proj"], *gemm(T, 8192, 28672 // 4, H100, 80))


def test_all_reduce_without_nvlink_is_ring():
    m = model("model.name=llama-3.1-8b", "hardware.name=l40s", "parallel.tensor_parallel_size=2")
    B, t, name = allreduce(64, 4096, 2, L40S, nvlink=False)
    assert name == "ring"
    o = ops(m, decode(64, 100))["all_reduce"]
    assert (o.count, o.bytes) == (65, 65 * B)
    assert o.seconds == pytest.approx(65 * t, rel=1e-12)


def test_tp_logits_gather_and_kv_head_replication():
    """TP = 16 > 8 KV heads: each rank keeps one KV head (replicated); the LM head is
    vocab-parallel and its logits are gathered: (tp − 1)·s·V/tp·2 bytes, lat + B/bw."""
    m = model("model.name=llama-3.1-70b", "hardware.name=h100-sxm",
              "parallel.tensor_parallel_size=16")
    o = ops(m, decode(4, 100))
    check(o["qkv_proj"], *gemm(4, (4 + 2 * 1) * 128, 8192, H100, 80))
    v_r = -(-128256 // 16)
    lm = gemm(4, v_r, 8192, H100, 1)
    g_bytes = 15 * 4 * v_r * 2
    assert o["lm_head"].bytes == pytest.approx(lm[1] + g_bytes, rel=1e-12)
    assert o["lm_head"].seconds == pytest.approx(lm[2] + 3e-6 + g_bytes / 450e9, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# PP, fp8 weights, fp8 KV


def test_pipeline_parallel_handoff_and_full_depth():
    """PP = 2: one batch's latency runs every layer (at TP-sharded cost) plus pp − 1 handoffs
    of hidden + residual (2·T·h·2 bytes), lat + B/bw each."""
    m1 = model("model.name=llama-3.1-8b", "hardware.name=h100-sxm")
    m2 = model("model.name=llama-3.1-8b", "hardware.name=h100-sxm",
               "parallel.pipeline_parallel_size=2")
    b = prefill(256)
    o1, o2 = ops(m1, b), ops(m2, b)
    B = 2 * 256 * 4096 * 2
    assert (o2["pp_send_recv"].count, o2["pp_send_recv"].bytes) == (1, B)
    assert o2["pp_send_recv"].seconds == pytest.approx(3e-6 + B / 450e9, rel=1e-12)
    for name in ("qkv_proj", "gate_up_proj", "attn"):
        assert o2[name].seconds == o1[name].seconds and o2[name].count == 32
    assert m2.step_seconds(b) == pytest.approx(m1.step_seconds(b) + 3e-6 + B / 450e9,
                                               rel=1e-12)


def test_fp8_weights_on_h100_by_value():
    """W8A8 fp8: 1 byte per weight, bf16 activations, the fp8 tensor rate; the LM head and
    the KV cache stay bf16."""
    m = model("model.name=llama-3.1-8b", "hardware.name=h100-sxm", "model.quantization=fp8")
    for T, b in ((1, decode(1, 100)), (1024, prefill(1024))):
        o = ops(m, b)
        check(o["gate_up_proj"], *gemm(T, 2 * 14336, 4096, H100, 32, wbytes=1,
                                       peak=H100["fp8"]))
        check(o["down_proj"], *gemm(T, 4096, 14336, H100, 32, wbytes=1, peak=H100["fp8"]))
        check(o["lm_head"], *gemm(1, 128256, 4096, H100, 1))


def test_fp8_kv_cache_by_value():
    m = model("model.name=llama-3.1-8b", "hardware.name=h100-sxm", "cache.cache_dtype=fp8")
    nd, ctx = 32, 2000
    kv_tok = 2 * 8 * 128 * 1  # one byte per element
    b_att = 32 * (nd * ctx * kv_tok + nd * (2 * 32 * 128 * 2 + kv_tok))
    f_att = 32 * nd * ctx * 4 * 32 * 128
    s = max(f_att / (H100["peak"] * ATT_DEC[0]), b_att / (H100["bw"] * ATT_DEC[1])) \
        + 32 * 2 * KFIX
    check(ops(m, decode(nd, ctx))["attn"], f_att, b_att, s)


# ---------------------------------------------------------------------------------------------
# a mixed batch: one step


def test_mixed_batch_shares_one_step(m8):
    """A mixed batch (decode rows + a chunk) is one step: its dense ops run at the summed
    token count, attention at both parts, the host term counts every request."""
    b = BatchShape(num_decode=6, decode_context_sum=6 * 700, decode_context_max=700,
                   prefill_new_tokens=(100,), prefill_context=(0,), num_sampled=7)
    st = m8.step_time(b)
    assert (st.cudagraph, st.padded_batch) == ("PIECEWISE", 112)  # 106 → capture size 112
    o = {x.name: x for x in st.breakdown}
    check(o["qkv_proj"], *gemm(112, 6144, 4096, A100, 32))
    assert st.host_seconds == pytest.approx(PER_STEP + 7 * PER_REQ + 106 * PER_TOK, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# the breakdown contract: op order, bound, efficiency, provenance, counts


def test_breakdown_fields_by_value_llama70b_tp4():
    """Every op of a decode step: vLLM order; GEMMs memory-bound at 80% of HBM with the
    roofline default provenance; elementwise ops memory-bound at 70%; the all-reduce from the
    spec sheet (one-shot of 4·8192·2 bytes: the 3 µs latency dominates). At TP 4 on H100
    vLLM fuses each all-reduce with the RMSNorm after it up to 2 MiB / (8192 · 2 bytes) =
    128 tokens: a 4-row decode has no norm op; a 4,096-token prefill keeps its 161 norms."""
    m = model("model.name=llama-3.1-70b", "hardware.name=h100-sxm",
              "parallel.tensor_parallel_size=4")
    assert m.allreduce_rms_fusion_tokens == 128
    st = m.step_time(decode(4, 1000))
    assert [o.name for o in st.breakdown] == [
        "embed_tokens", "qkv_proj", "rotary_emb", "attn", "o_proj",
        "gate_up_proj", "act_fn", "down_proj", "all_reduce", "lm_head", "sampler",
        "kernel_launch", "host"]
    o = {x.name: x for x in st.breakdown}
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"):
        assert (o[name].bound, o[name].efficiency, o[name].provenance) == (
            "memory", 0.80, "roofline:default"), name
    assert o["lm_head"].count == 1 and o["qkv_proj"].count == 80
    for name in ("embed_tokens", "rotary_emb", "act_fn", "sampler"):
        assert (o[name].bound, o[name].efficiency, o[name].flops) == ("memory", 0.70, 0.0)
    assert (o["rotary_emb"].count, o["act_fn"].count) == (80, 80)
    n = {x.name: x for x in m.step_time(prefill(4096)).breakdown}["input_layernorm"]
    assert (n.count, n.bound, n.efficiency, n.flops) == (161, "memory", 0.70, 0.0)
    ar = o["all_reduce"]
    assert (ar.bound, ar.efficiency, ar.provenance, ar.flops) == ("latency", 1.0,
                                                                  "spec-sheet", 0.0)
    # logits gather at TP 4: (tp − 1)·s·V/tp·2 bytes over the link, latency + bytes / bw
    v_r = 128256 // 4
    lm = gemm(4, v_r, 8192, H100, 1)
    g = 3 * 4 * v_r * 2
    assert o["lm_head"].seconds == pytest.approx(lm[2] + 3e-6 + g / 450e9, rel=1e-12)
    assert o["lm_head"].flops == lm[0] and o["lm_head"].bytes == lm[1] + g
    assert o["attn"].bound == "memory" and o["attn"].count == 80
    assert o["attn"].efficiency == pytest.approx(
        max(o["attn"].flops / H100["peak"], o["attn"].bytes / H100["bw"]) / o["attn"].seconds)
    # prefill: the big GEMMs are compute-bound at 75% of the tensor peak; large all-reduce
    # messages are bandwidth-bound
    p = {x.name: x for x in m.step_time(prefill(4096)).breakdown}
    assert (p["gate_up_proj"].bound, p["gate_up_proj"].efficiency) == ("compute", 0.75)
    assert p["all_reduce"].bound == "link"


def test_deepseek_mla_ops_and_attention_by_value():
    """MLA (absorbed for decode): per context token per layer 2·(lat + rope)·nh + 2·lat·nh
    FLOPs over the (lat + rope)-element latent; prefill per (query, key) pair
    (2·(nope + rope) + 2·v)·nh FLOPs. DeepSeek-V3 at TP 8: nh = 16, lat 512, rope 64,
    nope 128, v 128; KV fp8 from the checkpoint? no: cache auto = 2 bytes."""
    m = model("model.name=deepseek-v3", "hardware.name=h200-sxm",
              "parallel.tensor_parallel_size=8")
    L, nh, lat, rope, nope, v = 61, 16, 512, 64, 128, 128
    st = m.step_time(decode(2, 3000))
    names = [o.name for o in st.breakdown]
    # (the norms run inside the all-reduces: fused up to 0.5 MiB / (7168 · 2 bytes) = 36
    # tokens at TP 8 on Hopper)
    assert m.allreduce_rms_fusion_tokens == 36
    assert names[:11] == ["embed_tokens", "qkv_a_proj", "q_b_proj",
                          "kv_b_proj", "rotary_emb", "attn", "o_proj", "gate_up_proj",
                          "act_fn", "down_proj", "router"]
    assert names[11:14] == ["experts", "shared_experts", "shared_experts.act_fn"]
    o = {x.name: x for x in st.breakdown}
    kv_tok = (lat + rope) * 2
    f = L * 6000 * (2 * (lat + rope) * nh + 2 * lat * nh)
    b = L * (6000 * kv_tok + 2 * ((nh * (lat + rope) + nh * lat) * 2 + kv_tok))
    assert (o["attn"].flops, o["attn"].bytes) == (f, b)
    # rotary on nh query heads + 1 latent key head, rope dims only
    assert o["rotary_emb"].bytes == L * 2 * 2 * (nh + 1) * rope * 2
    # shared expert activation: 3·T·I_shared/tp·2 bytes on the 58 MoE layers (T padded to 2)
    assert o["shared_experts.act_fn"].bytes == 58 * 3 * 2 * (2048 // 8) * 2
    assert o["act_fn"].count == 3  # the first 3 layers are dense
    p = {x.name: x for x in m.step_time(prefill(1000, 500)).breakdown}
    pairs = 1000 * 500 + 1000 * 1001 / 2
    assert p["attn"].flops == L * pairs * (2 * (nope + rope) + 2 * v) * nh
    assert p["attn"].bytes == L * (1500 * kv_tok + 1000 * (nh * (nope + rope + v) * 2 + kv_tok))


def test_deepseek_shared_experts_overlap_the_routed_ones_up_to_256_tokens():
    """vLLM 0.22.1 SharedExperts (MULTI_STREAM_OVERLAPPED, VLLM_SHARED_EXPERTS_STREAM_TOKEN_
    THRESHOLD 256): up to 256 (padded) tokens the shared experts run on an aux CUDA stream
    beside router + routed experts; the pair takes max(t_main + bytes_shared / bw,
    t_shared + bytes_main / bw). Above 256 tokens, on ROCm and for models without shared
    experts: serial."""
    m = model("model.name=deepseek-v3", "hardware.name=h200-sxm",
              "parallel.tensor_parallel_size=8")
    bw = 4800e9  # H200 HBM, spec sheet (B/s)
    assert m.bw == bw
    assert m.shared_experts_stream_tokens == 256
    for batch, overlapped in ((decode(8, 2048), True), (decode(256, 2048), True),
                              (decode(257, 2048), False), (prefill(2048), False)):
        st = m.step_time(batch)
        o = {x.name: x for x in st.breakdown}
        names = [x.name for x in st.breakdown]
        assert ("shared_experts_overlap" in o) == overlapped, batch
        assert sum(x.seconds for x in st.breakdown) == pytest.approx(st.seconds)
        if not overlapped:
            continue
        main = o["router"].seconds + o["experts"].seconds
        b_main = o["router"].bytes + o["experts"].bytes
        sh = o["shared_experts"].seconds + o["shared_experts.act_fn"].seconds
        b_sh = o["shared_experts"].bytes + o["shared_experts.act_fn"].bytes
        assert o["shared_experts_overlap"].seconds == pytest.approx(
            max(main + b_sh / bw, sh + b_main / bw) - main - sh)
        assert o["shared_experts_overlap"].count == 58
        assert names.index("shared_experts_overlap") == names.index("shared_experts.act_fn") + 1
        assert m.op_family("shared_experts_overlap") == "overlap"
    # batch 8: the routed experts (6.0 ms over 58 layers) hide all but the shared bytes
    o = {x.name: x for x in m.step_time(decode(8, 2048)).breakdown}
    assert o["experts"].seconds > o["shared_experts"].seconds + o["shared_experts.act_fn"].seconds
    assert o["shared_experts_overlap"].seconds == pytest.approx(
        o["shared_experts"].bytes / bw + o["shared_experts.act_fn"].bytes / bw
        - o["shared_experts"].seconds - o["shared_experts.act_fn"].seconds)
    rocm = model("model.name=deepseek-v3", "hardware.name=mi300x",
                 "parallel.tensor_parallel_size=8")
    mix = model("model.name=mixtral-8x7b", "hardware.name=h100-sxm",
                "parallel.tensor_parallel_size=2")
    assert rocm.shared_experts_stream_tokens == mix.shared_experts_stream_tokens == 0
    assert "shared_experts_overlap" not in ops(rocm, decode(8, 2048))


def test_sliding_window_attention_by_value():
    """Mistral-7B, window 4096: a decode row reads at most 4096 tokens; a prefill chunk's
    pairs are Σ min(j, w) differences and it reads min(p + c, w + c) cached tokens."""
    m = model("model.name=mistral-7b-v0.1", "hardware.name=a100-sxm4-80gb")
    L, w, kv_tok = 32, 4096, 2 * 8 * 128 * 2
    d = {o.name: o for o in m.step_time(decode(3, 9000)).breakdown}["attn"]
    assert d.flops == L * 3 * w * 4 * 32 * 128
    assert d.bytes == L * (3 * w * kv_tok + 3 * (2 * 32 * 128 * 2 + kv_tok))

    def pairs(n):
        return n * (n + 1) / 2 if n <= w else w * (w + 1) / 2 + (n - w) * w

    c, p = 512, 8000
    a = {o.name: o for o in m.step_time(prefill(c, p)).breakdown}["attn"]
    assert a.flops == L * (pairs(p + c) - pairs(p)) * 4 * 32 * 128 == L * c * w * 4 * 32 * 128
    assert a.bytes == L * ((w + c) * kv_tok + c * (2 * 32 * 128 * 2 + kv_tok))
    small = {o.name: o for o in m.step_time(prefill(100, 1000)).breakdown}["attn"]
    assert small.flops == L * (100 * 1000 + 100 * 101 / 2) * 4 * 32 * 128


@pytest.mark.parametrize("mode,dec,mixed", [
    ("FULL_AND_PIECEWISE", "FULL", "PIECEWISE"), ("PIECEWISE", "PIECEWISE", "PIECEWISE"),
    ("FULL", "FULL", "FULL"), ("FULL_DECODE_ONLY", "FULL", "NONE"), ("NONE", "NONE", "NONE")])
def test_cudagraph_modes(mode, dec, mixed):
    m = model("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
              f"compilation.cudagraph_mode={mode}")
    mix = BatchShape(num_decode=3, decode_context_sum=300, decode_context_max=100,
                     prefill_new_tokens=(20,), prefill_context=(0,), num_sampled=4)
    a, b = m.step_time(decode(3, 100)), m.step_time(mix)
    assert (a.cudagraph, b.cudagraph) == (dec, mixed)
    assert a.padded_batch == (4 if dec != "NONE" else 3)
    assert b.padded_batch == (24 if mixed != "NONE" else 23)
    # FULL decode graphs beside a mixed mode stop at max_num_seqs = 256 tokens (A100): a
    # larger uniform decode batch takes the mixed mode's graph (sizes step by 16 from 256)
    top = 256 if mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY") else 512
    assert m.step_time(decode(top, 10)).cudagraph == dec
    if top == 256:
        st = m.step_time(decode(257, 10))
        assert (st.cudagraph, st.padded_batch) == (mixed, 272 if mixed != "NONE" else 257)
    assert m.step_time(decode(512, 10)).cudagraph == (dec if top == 512 else mixed)
    assert m.step_time(decode(513, 10)).cudagraph == "NONE"  # 512: the largest capture size


def test_full_decode_graphs_stop_at_max_num_seqs():
    """max_num_seqs 100 on H100: capture sizes …, 96, 104, … ; FULL decode graphs only up to
    100 tokens, i.e. up to 96. A decode batch of 97 rows pads to 104: PIECEWISE@104 beside
    FULL_AND_PIECEWISE, eager (unpadded) with FULL_DECODE_ONLY; 96 rows replay FULL@96."""
    for mode, mixed, pad in (("FULL_AND_PIECEWISE", "PIECEWISE", 104),
                             ("FULL_DECODE_ONLY", "NONE", 97)):
        m = model("model.name=llama-3.1-8b", "hardware.name=h100-sxm",
                  "scheduler.max_num_seqs=100", f"compilation.cudagraph_mode={mode}")
        st = m.step_time(decode(97, 1000))
        assert (st.cudagraph, st.padded_batch) == (mixed, pad)
        st = m.step_time(decode(96, 1000))
        assert (st.cudagraph, st.padded_batch) == ("FULL", 96)
        assert m.step_seconds(decode(97, 1000)) == m.step_time(decode(97, 1000)).seconds


def test_launch_bound_steps_by_value():
    """Llama-2-7B (32 layers, MHA) at TP 8 on B200: the GPU work of a small step is shorter
    than launching it, so the step costs the CPU launch time. Eager: per layer 2 norms + rope
    + 2 attention + 4 GEMMs + act = 10 kernels, + embedding + final norm, + 2 all-reduces per
    layer + 1, + LM head and 8 sampler kernels, 5 µs each. PIECEWISE (mixed batch): 33 graph
    pieces at 10 µs + attention's 2 eager kernels per layer + the head."""
    eager = model("model.name=llama-2-7b", "hardware.name=b200",
                  "parallel.tensor_parallel_size=8", "model.enforce_eager=true")
    b = decode(1, 10)
    st = eager.step_time(b)
    n = 32 * 10 + 2 + (2 * 32 + 1) + 9
    o = {x.name: x for x in st.breakdown}
    assert o["kernel_launch"].count == n
    gpu = sum(x.seconds for x in st.breakdown if x.name not in ("kernel_launch", "host"))
    assert gpu < n * LAUNCH
    assert o["kernel_launch"].seconds == pytest.approx(n * LAUNCH - gpu, rel=1e-9)
    host = PER_STEP + PER_REQ + PER_TOK
    assert st.seconds == pytest.approx(total(n * LAUNCH, host), rel=1e-12)
    assert eager.step_seconds(b) == pytest.approx(total(n * LAUNCH, host), rel=1e-12)
    pw = model("model.name=llama-2-7b", "hardware.name=b200", "parallel.tensor_parallel_size=8")
    mix = BatchShape(num_decode=1, decode_context_sum=10, decode_context_max=10,
                     prefill_new_tokens=(7,), prefill_context=(0,), num_sampled=2)
    launch = 33 * GRAPH_LAUNCH + 32 * 2 * LAUNCH + 9 * LAUNCH
    st = pw.step_time(mix)
    o = {x.name: x for x in st.breakdown}
    assert o["kernel_launch"].count == 33 + 64 + 9
    gpu = sum(x.seconds for x in st.breakdown if x.name not in ("kernel_launch", "host"))
    assert o["kernel_launch"].seconds == pytest.approx(max(0.0, launch - gpu), abs=1e-15)
    assert st.seconds == pytest.approx(total(max(gpu, launch), PER_STEP + 2 * PER_REQ
                                             + 8 * PER_TOK), rel=1e-12)
    # a batch that samples nothing launches no LM head or sampler
    chunk = BatchShape(prefill_new_tokens=(7,), prefill_context=(0,), num_sampled=0)
    st = pw.step_time(chunk)
    assert {x.name: x for x in st.breakdown}["kernel_launch"].count == 33 + 64
    assert "lm_head" not in {x.name for x in st.breakdown}
    gpu = sum(x.seconds for x in st.breakdown if x.name not in ("kernel_launch", "host"))
    assert st.seconds == pytest.approx(total(max(gpu, 33 * GRAPH_LAUNCH + 64 * LAUNCH),
                                             PER_STEP + PER_REQ + 7 * PER_TOK), rel=1e-12)


def test_roofline_floor_by_value(m8):
    """Σ over GPU ops of max(flops / peak, bytes / bw) at 100%, spec-sheet ops excluded."""
    b = decode(8, 1000)
    want = sum(max(o.flops / A100["peak"], o.bytes / A100["bw"])
               for o in m8.step_time(b).breakdown if o.bound != "host")
    assert m8.roofline_floor(b) == pytest.approx(want, rel=1e-12)
    assert m8.roofline_floor(b) < m8.step_seconds(b)


def test_qkv_bias_bytes_qwen():
    """Qwen2.5 has q/k/v biases: n bf16 bias elements more per layer."""
    m = model("model.name=qwen2.5-7b", "hardware.name=a100-sxm4-80gb")
    n, k = (28 + 2 * 4) * 128, 3584
    _f, _b, _s = gemm(1, n, k, A100, 28)
    f1 = 2.0 * n * k
    b1 = n * k * 2 + n * 2 + (n + k) * 2
    s1 = roof(f1, b1, A100["peak"], A100["bw"], GEMM) + KFIX
    check(ops(m, decode(1, 10))["qkv_proj"], f1 * 28, b1 * 28, s1 * 28)


# ---------------------------------------------------------------------------------------------
# eager launch counts and the GEMM table formats


def test_eager_launch_counts_for_moe_and_mla():
    """Eager CPU launches per step: per layer 2 norms + rope + 2 attention kernels + one per
    attention GEMM; MLP: dense 2 GEMMs + act, MoE router (2) + fused experts (6) (+ a dense
    shared expert: 2 GEMMs + act); + embedding + final norm; + 2 all-reduces per layer + 1 at
    TP > 1; + LM head and sampler (9)."""
    mx = model("model.name=mixtral-8x7b", "hardware.name=h100-sxm",
               "parallel.tensor_parallel_size=2", "model.enforce_eager=true")
    o = ops(mx, decode(2, 100))
    assert o["kernel_launch"].count == 32 * (5 + 2 + 8) + 2 + 65 + 9
    ds = model("model.name=deepseek-v3", "hardware.name=h200-sxm",
               "parallel.tensor_parallel_size=8", "model.enforce_eager=true")
    o = ops(ds, decode(2, 100))
    assert o["kernel_launch"].count == 61 * (5 + 4) + 3 * 3 + 58 * (8 + 3) + 2 + 123 + 9


def test_gemm_table_formats():
    """Which measured GEMM table a linear uses: bf16 weights → bfloat16; W8A8 fp8 → fp8
    (fp8_block for block-scaled checkpoints), 1-byte activations; int8 → int8; weight-only
    formats keep their name with bf16 activations; unquantized linears (router, LM head)
    always bfloat16."""
    from servesim.costmodels.specs import Linear

    lin = Linear("x", "gate_up_proj", 10, 10, 1)
    head = Linear("h", "lm_head", 10, 10, 1, "replicated", quantized=False)
    cases = {
        ("llama-3.1-8b", "h100-sxm", "none"): ("bfloat16", 2.0, 2, "bf16"),
        ("llama-3.1-8b", "h100-sxm", "fp8"): ("fp8", 1.0, 1.0, "fp8"),
        ("llama-3.1-8b", "h100-sxm", "int8"): ("int8", 1.0, 1.0, "int8"),
        ("llama-3.1-8b", "a100-sxm4-80gb", "fp8"): ("fp8", 1.0, 2, "bf16"),
        ("llama-3.1-8b", "h100-sxm", "int4-awq"): ("int4-awq", 0.5 + 2 / 128, 2, "bf16"),
        ("deepseek-v3", "h200-sxm", "none"): ("fp8_block", 1.0 + 4 / (128 * 128), 1.0, "fp8"),
    }
    for (name, hw, q), want in cases.items():
        m = model(f"model.name={name}", f"hardware.name={hw}", f"model.quantization={q}",
                  *(("parallel.tensor_parallel_size=8",) if name == "deepseek-v3" else ()))
        assert m._gemm_format(lin) == pytest.approx(want), (name, hw, q)
        assert m._gemm_format(head) == ("bfloat16", 2, 2, "bf16")


def test_allreduce_rms_fusion_where_vllm_enables_it():
    """vLLM -O2 ``fuse_allreduce_rms`` (``enable_allreduce_rms_fusion``): TP > 1, compute
    capability 9.0 or 10.x, compiled; up to FI_ALLREDUCE_FUSION_MAX_SIZE_MB[cc][tp] MiB of
    hidden states (hidden 4,096 × 2 bytes per token for Llama-3.1-8B): H100 64/2/0.5 MiB at
    TP 2/4/8 → 8,192 / 256 / 64 tokens; B200 (10.0) TP 4 / 8: 32 / 1 MiB → 4,096 / 128;
    B300 (10.3) TP 4 / 8: 64 / 2 MiB → 8,192 / 256; never on A100, at TP 1, with
    enforce_eager or at -O1. A fused step drops exactly the norms' time (2·32 + 1 = 65
    norms of 4·T·h bytes each); the all-reduce's stays."""
    base = ("model.name=llama-3.1-8b",)
    got = {ov: model(*base, *ov).allreduce_rms_fusion_tokens for ov in (
        ("hardware.name=h100-sxm", "parallel.tensor_parallel_size=2"),
        ("hardware.name=h100-sxm", "parallel.tensor_parallel_size=4"),
        ("hardware.name=h100-sxm", "parallel.tensor_parallel_size=8"),
        ("hardware.name=b200", "parallel.tensor_parallel_size=4"),
        ("hardware.name=b200", "parallel.tensor_parallel_size=8"),
        ("hardware.name=b300", "parallel.tensor_parallel_size=4"),
        ("hardware.name=b300", "parallel.tensor_parallel_size=8"),
        ("hardware.name=a100-sxm4-80gb", "parallel.tensor_parallel_size=2"),
        ("hardware.name=h100-sxm",),
        ("hardware.name=h100-sxm", "parallel.tensor_parallel_size=2",
         "model.enforce_eager=true"),
        ("hardware.name=h100-sxm", "parallel.tensor_parallel_size=2", "optimization_level=1"))}
    assert list(got.values()) == [8192, 256, 64, 4096, 128, 8192, 256, 0, 0, 0, 0]
    fused = model(*base, "hardware.name=h100-sxm", "parallel.tensor_parallel_size=4")
    plain = model(*base, "hardware.name=h100-sxm", "parallel.tensor_parallel_size=4")
    plain.allreduce_rms_fusion_tokens = 0  # (the same model, unfused)
    for batch in (decode(64, 1024), prefill(200)):  # 64 tokens; 200 → padded 200 (≤ 256)
        a, b = ops(fused, batch), ops(plain, batch)
        assert "input_layernorm" not in a and b["input_layernorm"].count == 65
        T = fused.runtime_mode(batch)[1]
        assert b["input_layernorm"].bytes == 65 * 4 * T * 4096 * 2
        assert a["all_reduce"].seconds == b["all_reduce"].seconds
        assert plain.step_seconds(batch) - fused.step_seconds(batch) == pytest.approx(
            b["input_layernorm"].seconds, rel=1e-9)
    big = prefill(2048)  # over 256 tokens: not fused
    assert ops(fused, big)["input_layernorm"].count == 65


def test_ungraphed_batches_take_the_eager_all_reduce_time():
    """Under FULL_DECODE_ONLY a mixed batch runs without a CUDA graph (vLLM's dispatcher:
    no mixed-mode graphs, NONE, unpadded) even within the capture sizes, so its all-reduces
    take the calibration's eager time, not the graph time of a FULL decode of the same size
    (Llama-3.1-8B TP 2 on H100, the shipped calibration's all-reduce table)."""
    from cmutil import make_cfg
    from servesim.costmodels import build_cost_model

    m = build_cost_model(make_cfg("model.name=llama-3.1-8b", "hardware.name=h100-sxm",
                                  "parallel.tensor_parallel_size=2",
                                  "compilation.cudagraph_mode=FULL_DECODE_ONLY"))
    assert m.calibration is not None and m.calibration.has("allreduce")
    mixed = BatchShape(num_decode=4, decode_context_sum=400, decode_context_max=100,
                       prefill_new_tokens=(60,), prefill_context=(0,), num_sampled=5)
    st = m.step_time(mixed)
    assert (st.cudagraph, st.padded_batch) == ("NONE", 64)
    payload = 64 * 4096 * 2
    eager, _ = m.calibration.allreduce(2, payload, False)
    graph, _ = m.calibration.allreduce(2, payload, True)
    assert eager != graph
    ar = {o.name: o for o in st.breakdown}["all_reduce"]
    assert ar.seconds == pytest.approx(65 * eager, rel=1e-12)
    d = m.step_time(decode(64, 100))  # a FULL decode graph of the same 64 tokens
    assert d.cudagraph == "FULL"
    assert {o.name: o for o in d.breakdown}["all_reduce"].seconds == pytest.approx(
        65 * graph, rel=1e-12)
    assert m.step_seconds(mixed) == pytest.approx(st.seconds, rel=1e-12)
