"""Roofline seconds of the calibrated op families: how a measured efficiency carries over to a
shape (or a dtype) that was not measured.

Peaks come from the calibration file, else the hardware spec. Per family (seconds):

- GEMM: ``max(2mnk / peak, (n·k·w + m·k·a + m·n·2) / bw)`` (w, a: weight/activation bytes).
- decode: ``max(4·H·D·b·ctx / peak, (2·b·ctx·Hkv·D·kv + 2·b·H·D·2) / bw)``.
- prefill: ``max(4·H·D·b·pairs / peak, b·(2·(ctx + chunk)·Hkv·D·kv + 2·chunk·H·D·2) / bw)``,
  pairs = ``chunk·ctx + chunk(chunk+1)/2``.
- all-reduce: ``2(tp − 1)/tp · bytes / link_bw``.
- MoE: ``max(6·T·topk·h·i/tp / peak, E_act·3·h·i/tp·w / bw)``, E_act = E(1 − (1 − topk/E)^T).

Units: peaks in FLOP/s and bytes/s (files give TFLOP/s and GB/s), sizes in bytes.
"""

from __future__ import annotations

from servesim.costmodels.specs import HardwareSpec
from servesim.simulator.errors import ConfigError

ACT = 2  # activation bytes (bf16/fp16)

# GEMM table dtypes: (weight bytes, activation bytes, tensor rate used)
GEMM_DTYPES = {"bfloat16": (2.0, 2.0, "bf16"), "fp8": (1.0, 1.0, "fp8"),
               "fp8_block": (1.0, 1.0, "fp8"), "int8": (1.0, 1.0, "int8")}
_DTYPE_ALIASES = {"float16": "bfloat16", "bf16": "bfloat16", "fp16": "bfloat16",
                  "float8_e4m3fn": "fp8", "float8_e4m3": "fp8", "float8": "fp8",
                  "fp8_e4m3": "fp8"}
KV_BYTES = {"bfloat16": 2, "fp8": 1}


def norm_dtype(dt) -> str:
    """Canonical dtype label (``float16``/``bf16`` → ``bfloat16``, ``float8_e4m3fn`` → ``fp8``)."""
    s = str(dt or "bfloat16")
    return _DTYPE_ALIASES.get(s, s)


def gemm_format(dtype: str) -> tuple[float, float, str]:
    """(weight bytes, activation bytes, tensor rate) of a GEMM table dtype (else bf16's)."""
    return GEMM_DTYPES.get(dtype, (2.0, 2.0, "bf16"))


def causal_pairs(chunk: float, context: float) -> float:
    """Causal (query, key) pairs of a ``chunk`` after ``context`` cached tokens."""
    return chunk * context + chunk * (chunk + 1) / 2


class Peaks:
    """Roofline rates (FLOP/s, bytes/s) of the calibrated GPU."""

    def __init__(self, spec: HardwareSpec | None, doc_peaks: dict, where: str):
        def pick(key: str, fallback):
            v = (doc_peaks or {}).get(key)
            if v is None:
                v = fallback
            return float(v) if v else None

        bf16 = pick("bf16_tflops", spec.bf16_tflops if spec else None)
        bw = pick("mem_bw_gbps", spec.mem_bw_gbps if spec else None)
        if not bf16 or not bw:
            raise ConfigError(f"{where}: peaks.bf16_tflops and peaks.mem_bw_gbps are required")
        self.bf16 = bf16 * 1e12
        self.fp8 = (pick("fp8_tflops", spec.fp8_tflops if spec else None) or bf16) * 1e12
        self.int8 = (pick("int8_tops", spec.int8_tops if spec else None) or bf16) * 1e12
        self.bw = bw * 1e9
        self.link = (pick("link_bw_gbps", spec.link_bw_gbps if spec else None) or 32.0) * 1e9

    def rate(self, compute: str) -> float:
        return {"fp8": self.fp8, "int8": self.int8}.get(compute, self.bf16)


def gemm_roof(p: Peaks, m: float, n: float, k: float, wb: float, ab: float,
              compute: str) -> float:
    """Roofline seconds of ``y[m,n] = x[m,k] · W[n,k]ᵀ`` (bf16 output)."""
    return max(2.0 * m * n * k / p.rate(compute), (n * k * wb + m * k * ab + m * n * ACT) / p.bw)


def decode_roof(p: Peaks, head_dim, kv_heads, heads, batch, context, kvb: float) -> float:
    return max(4.0 * heads * head_dim * batch * context / p.bf16,
               (2.0 * batch * context * kv_heads * head_dim * kvb
                + 2.0 * batch * heads * head_dim * ACT) / p.bw)


def prefill_roof(p: Peaks, head_dim, kv_heads, heads, batch, context, chunk, kvb: float) -> float:
    return max(4.0 * heads * head_dim * batch * causal_pairs(chunk, context) / p.bf16,
               batch * (2.0 * (context + chunk) * kv_heads * head_dim * kvb
                        + 2.0 * chunk * heads * head_dim * ACT) / p.bw)


def moe_roof(p: Peaks, hidden, inter, topk, experts, tp, ep, tpe: float, wb: float,
             compute: str) -> float:
    """``tpe``: tokens per expert (= tokens·topk/experts)."""
    tokens = tpe * experts / topk
    local = experts / ep
    act = local * (1.0 - (1.0 - topk / experts) ** tokens) if tokens > 0 else 0.0
    i_r = inter / tp
    flops = 2.0 * 3.0 * tokens * topk / ep * hidden * i_r
    nbytes = act * 3.0 * hidden * i_r * wb + 2.0 * tokens * hidden * ACT
    return max(flops / p.rate(compute), nbytes / p.bw)


def allreduce_roof(p: Peaks, tp: float, nbytes: float) -> float:
    return 2.0 * (tp - 1) / tp * nbytes / p.link if tp > 1 else 0.0

