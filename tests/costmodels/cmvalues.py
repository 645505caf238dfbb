"""Shared by the by-value cost-model tests (``test_cost_values*.py``): spec-sheet and
config.json numbers, the documented default efficiencies and host priors, and the helpers that
recompute an op's expected (FLOPs, bytes, seconds) from them.

Roofline with the documented default efficiencies (``hardware.calibration: none``):

    op seconds = max(flops / (peak · eff_c), bytes / (bw · eff_m)) + kernels · 2 µs

GEMM per layer: flops 2·T·n·k, bytes n·k·w + T·(n + k)·2 (bf16 activations; w = 2 bf16,
1 fp8); elementwise ops are memory-bound at 70% of HBM; forward = max(Σ GPU ops, CPU launch
time); host = 126 µs + 4 µs/request + 0.02 µs/token; step = max(forward, host) + 20 µs
with async scheduling (vLLM's default: the host work of the next batch overlaps this one's
GPU work), forward + host without.
"""

from __future__ import annotations

import pytest
from cmutil import make_cfg
from servesim.costmodels import build_cost_model

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
