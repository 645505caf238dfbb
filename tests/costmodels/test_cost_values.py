"""Cost and memory model by value: every op's FLOPs, bytes and seconds, and num_gpu_blocks,
recomputed here from the models' config.json numbers and the GPUs' spec sheets with the
formulas documented in ``costmodels/step.py`` and ``costmodels/memory.py`` (never by calling
the code under test for an expected value).

Roofline with the documented default efficiencies (``hardware.calibration: none``):

    op seconds = max(flops / (peak · eff_c), bytes / (bw · eff_m)) + kernels · 2 µs

GEMM per layer: flops 2·T·n·k, bytes n·k·w + T·(n + k)·2 (bf16 activations; w = 2 bf16,
1 fp8); elementwise ops are memory-bound at 70% of HBM; forward = max(Σ GPU ops, CPU launch
time); host = 126 µs + 4 µs/request + 0.02 µs/token; step = max(forward, host) + 20 µs
with async scheduling (vLLM's default: the host work of the next batch overlaps this one's
GPU work), forward + host without.
"""

from __future__ import annotations

import math

import pytest
from cmutil import decode, make_cfg, prefill
from servesim.costmodels import BatchShape, build_cost_model, plan_memory

GIB = 2**30
KFIX = 2e-6  # kernel_fixed_s
# default efficiencies (compute, memory)
GEMM = (0.75, 0.80)
GROUPED = (0.60, 0.75)
ATT_PRE = (0.55, 0.70)
ATT_DEC = (0.50, 0.70)
EW = 0.70
# host priors
PER_STEP, PER_REQ, PER_TOK = 126e-6, 4e-6, 2e-8
LAUNCH, GRAPH_LAUNCH = 5e-6, 10e-6
ASYNC_RESIDUAL = 20e-6  # the part of an async step the overlap cannot hide


def total(fwd, host, async_scheduling=True):
    """A step's seconds from its forward (GPU or launch bound) and host seconds."""
    return max(fwd, host) + ASYNC_RESIDUAL if async_scheduling else fwd + host

A100 = {"peak": 312e12, "bw": 2039e9, "link_bw": 300e9, "lat": 3e-6, "mem": 79.15}
H100 = {"peak": 989.4e12, "fp8": 1978.9e12, "bw": 3350e9, "link_bw": 450e9, "lat": 3e-6,
        "mem": 79.11}
L40S = {"peak": 362.05e12, "bw": 864e9, "link_bw": 32e9, "lat": 10e-6}

# Llama-3.1-8B config.json
L8 = {"h": 4096, "L": 32, "nh": 32, "nkv": 8, "hd": 128, "I": 14336, "V": 128256}
# Llama-3.1-70B
L70 = {"h": 8192, "L": 80, "nh": 64, "nkv": 8, "hd": 128, "I": 28672, "V": 128256}
# Mixtral-8x7B: 8 experts, top-2, expert intermediate 14336, vocab 32000
MIX = {"h": 4096, "L": 32, "nh": 32, "nkv": 8, "hd": 128, "I": 14336, "V": 32000, "E": 8,
       "k": 2}


def model(*overrides):
    return build_cost_model(make_cfg("hardware.calibration=none", *overrides))


def ops(m, batch):
    return {o.name: o for o in m.step_time(batch).breakdown}


def roof(flops, nbytes, peak, bw, eff):
    return max(flops / (peak * eff[0]) if flops else 0.0, nbytes / (bw * eff[1]))


def gemm(T, n, k, hw, layers, wbytes=2, peak=None, kernels=1):
    """(flops, bytes, seconds) of a dense linear over its layers."""
    f = 2.0 * T * n * k
    b = n * k * wbytes + T * (n + k) * 2
    s = roof(f, b, peak or hw["peak"], hw["bw"], GEMM) + kernels * KFIX
    return f * layers, b * layers, s * layers


def elementwise(nbytes, count, hw, kernels=1):
    return nbytes * count, (nbytes / (hw["bw"] * EW) + kernels * KFIX) * count


def check(op, flops, nbytes, seconds, count=None):
    assert op.flops == pytest.approx(flops, rel=1e-12), op.name
    assert op.bytes == pytest.approx(nbytes, rel=1e-12), op.name
    assert op.seconds == pytest.approx(seconds, rel=1e-12), op.name
    if count is not None:
        assert op.count == count, op.name


def dense_llama(m, T, hw, cfg, tp=1):
    """Expected per-op (flops, bytes, seconds) of the token-count-dependent ops."""
    h, L, hd = cfg["h"], cfg["L"], cfg["hd"]
    nh, kvh = cfg["nh"] // tp, max(1, cfg["nkv"] // tp)
    i_r = -(-cfg["I"] // tp)
    want = {
        "embed_tokens": (0.0, *elementwise(2 * T * h * 2, 1, hw)),
        "input_layernorm": (0.0, *elementwise(4 * T * h * 2, 2 * L + 1, hw)),
        "qkv_proj": gemm(T, (nh + 2 * kvh) * hd, h, hw, L),
        "rotary_emb": (0.0, *elementwise(2 * T * (nh + kvh) * hd * 2, L, hw)),
        "o_proj": gemm(T, h, nh * hd, hw, L),
        "gate_up_proj": gemm(T, 2 * i_r, h, hw, L),
        "act_fn": (0.0, *elementwise(3 * T * i_r * 2, L, hw)),
        "down_proj": gemm(T, h, i_r, hw, L),
    }
    return want


def head(s, hw, cfg, tp=1):
    V, h = cfg["V"], cfg["h"]
    v_r = -(-V // tp)
    lm = gemm(s, v_r, h, hw, 1)
    sampler = (0.0, *elementwise(4 * s * V * 4, 1, hw, kernels=8))
    return lm, sampler


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
    requested = int(total * 0.9)
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
    available = requested - weights - act - non_torch - comm
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
# memory: the remaining terms by value


def test_llama8b_a100_plan_every_term():
    """A100 defaults (256 seqs, 2048 tokens): weights, activation = max(forward of 2048
    tokens, sampler 256 × vocab × 14 B), non-torch 0.15 GiB, no NCCL at TP 1; CUDA graphs
    (51 capture sizes × 2 for FULL_AND_PIECEWISE × 4 MiB + activations of the largest, 512
    tokens) live in the headroom."""
    p = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb"))
    total = int(79.15 * GIB)
    assert (p.total_bytes, p.requested_bytes) == (total, int(total * 0.9))
    assert p.weights_bytes == weights_llama(L8, 1)
    per_tok = max(2 * 4096 + 6144 + 4096, 3 * 4096 + 3 * 14336)  # MLP block is larger
    fwd = 2048 * per_tok * 2
    assert p.activation_peak_bytes == max(fwd, 256 * 128256 * 14) == 256 * 128256 * 14
    assert (p.non_torch_bytes, p.comm_bytes) == (int(0.15 * GIB), 0)
    assert p.cudagraph_bytes == 51 * 2 * 4 * 2**20 + 512 * per_tok * 2
    assert not p.cudagraph_in_kv_budget
    avail = int(total * 0.9) - p.weights_bytes - p.activation_peak_bytes - int(0.15 * GIB)
    assert p.available_kv_bytes == avail
    assert p.num_gpu_blocks == p.num_gpu_blocks_computed == avail // (16 * 131072)
    d = p.as_dict()
    assert d["kv_cache_tokens"] == p.num_gpu_blocks * 16
    assert d["weights_gib"] == p.weights_bytes / GIB and d["total_gib"] == total / GIB
    assert d["available_kv_gib"] == avail / GIB
    assert d["max_concurrency"] == p.num_gpu_blocks / (131072 // 16)


def test_cudagraph_pool_in_the_kv_budget_by_value():
    from servesim.costmodels.memory import MemoryCoefficients, plan_memory_for
    from servesim.costmodels.specs import load_hardware_spec, load_model_spec

    cfg = make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                   "compilation.cudagraph_mode=PIECEWISE")
    spec, hw = load_model_spec(cfg.model), load_hardware_spec(cfg.hardware)
    a = plan_memory_for(cfg, spec, hw)
    b = plan_memory_for(cfg, spec, hw, MemoryCoefficients(cudagraph_in_kv_budget=True))
    per_tok = 3 * 4096 + 3 * 14336
    graphs = 51 * 4 * 2**20 + 512 * per_tok * 2  # one graph per size in PIECEWISE mode
    assert a.cudagraph_bytes == b.cudagraph_bytes == graphs
    assert b.available_kv_bytes == a.available_kv_bytes - graphs
    assert b.num_gpu_blocks == b.available_kv_bytes // (16 * 131072)
    none = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                                "compilation.cudagraph_mode=NONE"))
    assert none.cudagraph_bytes == 0


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
# the breakdown contract: op order, bound, efficiency, provenance, counts


def test_breakdown_fields_by_value_llama70b_tp4():
    """Every op of a decode step: vLLM order; GEMMs memory-bound at 80% of HBM with the
    roofline default provenance; elementwise ops memory-bound at 70%; the all-reduce from the
    spec sheet (one-shot of 4·8192·2 bytes: the 3 µs latency dominates)."""
    m = model("model.name=llama-3.1-70b", "hardware.name=h100-sxm",
              "parallel.tensor_parallel_size=4")
    st = m.step_time(decode(4, 1000))
    assert [o.name for o in st.breakdown] == [
        "embed_tokens", "input_layernorm", "qkv_proj", "rotary_emb", "attn", "o_proj",
        "gate_up_proj", "act_fn", "down_proj", "all_reduce", "lm_head", "sampler",
        "kernel_launch", "host"]
    o = {x.name: x for x in st.breakdown}
    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"):
        assert (o[name].bound, o[name].efficiency, o[name].provenance) == (
            "memory", 0.80, "roofline:default"), name
    assert o["lm_head"].count == 1 and o["qkv_proj"].count == 80
    for name in ("embed_tokens", "input_layernorm", "rotary_emb", "act_fn", "sampler"):
        assert (o[name].bound, o[name].efficiency, o[name].flops) == ("memory", 0.70, 0.0)
    assert (o["input_layernorm"].count, o["rotary_emb"].count, o["act_fn"].count) == (
        161, 80, 80)
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
    assert names[:12] == ["embed_tokens", "input_layernorm", "qkv_a_proj", "q_b_proj",
                          "kv_b_proj", "rotary_emb", "attn", "o_proj", "gate_up_proj",
                          "act_fn", "down_proj", "router"]
    assert names[12:15] == ["experts", "shared_experts", "shared_experts.act_fn"]
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
    assert m.step_time(decode(512, 10)).cudagraph == dec  # 512: the largest capture size
    assert m.step_time(decode(513, 10)).cudagraph == "NONE"


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
        f"gpu_memory_utilization (0.90) = {p.requested_bytes / g:.2f}GiB; model weights take "
        f"{p.weights_bytes / g:.2f}GiB; non_torch_memory takes "
        f"{(p.non_torch_bytes + p.comm_bytes) / g:.2f}GiB; PyTorch activation peak memory "
        f"takes {p.activation_peak_bytes / g:.2f}GiB; the rest of the memory reserved for KV "
        f"Cache is {p.available_kv_bytes / g:.2f}GiB.")
    assert lines[-1] == (f"CUDA graph pool ~{p.cudagraph_bytes / g:.2f} GiB (from the "
                         "(1 - gpu_memory_utilization) headroom)")
    assert lines[-2] == f"# GPU blocks: {p.num_gpu_blocks}, # CPU blocks: 0"
    d = p.as_dict()
    assert d["notes"] == [] and d["model"] == "llama-3.1-70b" and d["hardware"] == "h100-sxm"
    assert (d["tensor_parallel_size"], d["pipeline_parallel_size"]) == (4, 1)
    assert d["cudagraph_in_kv_budget"] is False


def test_sliding_window_request_tokens_exactly():
    p = plan_memory(make_cfg("model.name=mistral-7b-v0.1", "hardware.name=a100-sxm4-80gb",
                             "scheduler.max_num_batched_tokens=2050"))
    assert p.blocks_per_request == -(-(4096 - 1 + 2050) // 16) + 1 == 386


def test_graph_pool_follows_the_capture_sizes():
    p = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             "compilation.max_cudagraph_capture_size=64"))
    sizes = [1, 2, 4] + list(range(8, 65, 8))
    per_tok = 3 * 4096 + 3 * 14336
    assert p.cudagraph_bytes == len(sizes) * 2 * 4 * 2**20 + 64 * per_tok * 2
    q = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=a100-sxm4-80gb",
                             "compilation.cudagraph_capture_sizes=[1,3,100]"))
    assert q.cudagraph_bytes == 3 * 2 * 4 * 2**20 + 100 * per_tok * 2


def test_max_model_len_error_names_the_estimate():
    """The estimate in vLLM's message: available // block bytes · block size tokens."""
    from servesim.simulator.errors import CapacityError

    ok = plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=l4",
                              "model.max_model_len=16384"))
    est = (ok.available_kv_bytes // ok.block_bytes) * 16
    with pytest.raises(CapacityError, match=f"estimated maximum model length is {est}\\."):
        plan_memory(make_cfg("model.name=llama-3.1-8b", "hardware.name=l4"))
    assert ok.model == "llama-3.1-8b" and ok.hardware == "l4"


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


def test_scheduler_defaults_by_memory_and_kind():
    from servesim.costmodels.specs import HardwareSpec
    from servesim.costmodels.step import scheduler_defaults

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


def test_batch_limits_fill_unset_values_as_vllm():
    """``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args``: hardware defaults
    (A100: 256 seqs, 2048 tokens); without chunked prefill an unset budget is at least
    max_model_len; an unset budget is at most max_num_seqs · max_model_len; an unset
    max_num_seqs is at most the budget. Values given are kept."""
    from servesim.costmodels.specs import HardwareSpec
    from servesim.costmodels.step import batch_limits

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
