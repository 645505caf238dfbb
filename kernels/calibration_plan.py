"""The calibration plan: which kernel shapes ``simulate calibrate`` times, and the work (FLOPs,
bytes) each shape does.

Shapes come from the model catalog (``configs/models/*.yaml``, HF ``config.json`` fields) at
tensor parallel 1/2/4/8 (quick: 1 and 8): one rank's GEMMs (unique ``(n, k)``, every M),
decode and prefill attention per head layout, fused MoE per expert shape, memcpy, and
all-reduce message sizes when the machine has >= 2 GPUs. Needs only PyYAML.

Units: bytes, FLOPs, tokens; ``peaks`` in TFLOP/s (1e12) and GB/s (1e9 B/s).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from servesim.simulator.errors import ServesimError

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"

TPS = (1, 2, 4, 8)
M_FULL = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
M_QUICK = (1, 4, 16, 64, 256, 1024, 4096, 16384)
LM_HEAD_MAX_M = 1024  # the LM head runs on sampled rows only (<= max_num_seqs)
MAX_KV_BYTES = 16 * 2**30  # per decode/prefill shape (K + V), fits any 40 GB+ GPU with vendor copy
MOE_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 8192)

# Built-in fallbacks used only when configs/ lacks the files.
FALLBACK_MODELS = {
    "llama-3.1-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256},
    "llama-3.1-70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256},
}
FALLBACK_PEAKS = {  # dense spec-sheet values (TFLOP/s, GB/s)
    "h100-sxm": {"bf16_tflops": 989.4, "fp8_tflops": 1978.9, "mem_bw_gbps": 3350.0},
    "h200-sxm": {"bf16_tflops": 989.4, "fp8_tflops": 1978.9, "mem_bw_gbps": 4800.0},
    "a100-sxm4-80gb": {"bf16_tflops": 312.0, "fp8_tflops": None, "mem_bw_gbps": 2039.0},
}


@dataclass(frozen=True)
class GemmShape:
    m: int
    n: int
    k: int
    dtype: str
    ops: str  # comma-joined op kinds sharing this (n, k): qkv, o, gate_up, down, lm_head, ...


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    context: int  # mean context length (tokens)
    context_max: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    kv_dtype: str
    lengths: tuple[int, ...] = ()  # per-sequence lengths when mixed; () = all `context`


@dataclass(frozen=True)
class PrefillShape:
    batch: int
    chunk: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str


@dataclass(frozen=True)
class MoeShape:
    """One fused routed-expert layer at tensor parallel ``tp`` (inter/tp per rank, all
    experts local): ``tokens`` routed to ``topk`` of ``experts``."""
    tokens: int
    hidden: int
    inter: int
    topk: int
    experts: int
    tp: int
    dtype: str = "bfloat16"


@dataclass
class Plan:
    gpu: str
    mode: str  # full | quick
    peaks: dict
    models: list[str]
    gemm: list[GemmShape] = field(default_factory=list)
    decode: list[DecodeShape] = field(default_factory=list)
    prefill: list[PrefillShape] = field(default_factory=list)
    memcpy: list[int] = field(default_factory=list)
    moe: list[MoeShape] = field(default_factory=list)
    allreduce: list[tuple[int, int]] = field(default_factory=list)  # (tp, bytes)
    notes: list[str] = field(default_factory=list)


def load_models(models_dir: Path = CONFIGS_DIR / "models") -> tuple[dict[str, dict], str | None]:
    """``{name: config dict}`` from ``models_dir/*.yaml``; falls back to Llama-3.1-8B/70B."""
    files = sorted(models_dir.glob("*.yaml")) if models_dir.is_dir() else []
    models = {}
    for f in files:
        try:
            cfg = yaml.safe_load(f.read_text())
        except yaml.YAMLError as e:
            raise ServesimError(f"{f}: not valid YAML ({e.__class__.__name__})") from None
        if isinstance(cfg, dict) and "hidden_size" in cfg:
            models[f.stem] = cfg
    if models:
        return models, None
    return dict(FALLBACK_MODELS), (f"no model configs in {models_dir}; using built-in shapes "
                                   "for llama-3.1-8b and llama-3.1-70b")


def load_peaks(gpu: str, hardware_dir: Path = CONFIGS_DIR / "hardware") -> dict:
    """Spec peaks ``{bf16_tflops, fp8_tflops, mem_bw_gbps}`` for a hardware catalog name."""
    f = hardware_dir / f"{gpu}.yaml"
    if f.is_file():
        hw = yaml.safe_load(f.read_text()) or {}
        peaks = {k: hw.get(k) for k in ("bf16_tflops", "fp8_tflops", "mem_bw_gbps")}
        if peaks["bf16_tflops"] and peaks["mem_bw_gbps"]:
            return peaks
        raise ServesimError(f"{f}: expected bf16_tflops and mem_bw_gbps (spec peaks)")
    if gpu in FALLBACK_PEAKS:
        return dict(FALLBACK_PEAKS[gpu])
    known = sorted(p.stem for p in hardware_dir.glob("*.yaml")) if hardware_dir.is_dir() else []
    raise ServesimError(f"--gpu {gpu}: no {f}; expected a hardware catalog name "
                        f"({', '.join(known or sorted(FALLBACK_PEAKS))})")


def _head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def model_gemms(cfg: dict, tp: int) -> list[tuple[str, int, int]]:
    """``(op, n, k)`` of one rank's GEMMs (``y[M,n] = x[M,k] @ W^T``) at tensor parallel ``tp``.

    Column-parallel (qkv, gate_up, lm_head, MLA q_b/kv_b) split n; row-parallel (o, down) split
    k; KV heads are replicated when ``num_kv_heads < tp``. Ops that do not divide are skipped.
    """
    h = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    out: list[tuple[str, int, int]] = []
    if heads % tp:
        return out
    hr = heads // tp
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3)
        nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        vd = cfg.get("v_head_dim", nope)
        qr = cfg.get("q_lora_rank")
        if qr:
            out += [("q_a", qr, h), ("q_b", hr * (nope + rope), qr)]
        else:
            out.append(("q", hr * (nope + rope), h))
        out += [("kv_a", cfg["kv_lora_rank"] + rope, h),
                ("kv_b", hr * (nope + vd), cfg["kv_lora_rank"]), ("o", h, hr * vd)]
    else:
        d = _head_dim(cfg)
        kv = max(1, cfg.get("num_key_value_heads", heads) // tp)
        out += [("qkv", (hr + 2 * kv) * d, h), ("o", h, hr * d)]
    moe = cfg.get("moe_intermediate_size") or (
        cfg.get("intermediate_size") if cfg.get("num_local_experts") else None)
    dense = cfg.get("intermediate_size") if (not moe or cfg.get("first_k_dense_replace")) else None
    for prefix, inter in (("", dense), ("expert_", moe)):
        if inter and inter % tp == 0:
            out += [(prefix + "gate_up", 2 * inter // tp, h), (prefix + "down", h, inter // tp)]
    out.append(("lm_head", math.ceil(cfg["vocab_size"] / tp), h))
    return out


def model_attention(cfg: dict, tp: int) -> tuple[int, int, int] | None:
    """``(num_heads, num_kv_heads, head_dim)`` per rank, or None (MLA, or heads don't divide)."""
    heads = cfg["num_attention_heads"]
    if cfg.get("kv_lora_rank") or heads % tp:
        return None
    kv = cfg.get("num_key_value_heads", heads)
    return heads // tp, max(1, kv // tp), _head_dim(cfg)


def _kv_bytes(tokens: int, kv_heads: int, head_dim: int, elem: int = 2) -> int:
    return 2 * tokens * kv_heads * head_dim * elem


def build_plan(gpu: str, quick: bool = False, *, models_dir: Path | None = None,
               hardware_dir: Path | None = None, fp8: bool | None = None,
               num_gpus: int = 1) -> Plan:
    """All shapes to time. ``fp8`` adds fp8 GEMM / fp8-KV rows in full mode (the GPU run
    decides by compute capability; None = the catalog lists an fp8 peak). All-reduce rows
    need ``num_gpus`` >= 2 (TP sizes 2/4/8 up to the GPU count)."""
    peaks = load_peaks(gpu, hardware_dir or CONFIGS_DIR / "hardware")
    if fp8 is None:
        fp8 = bool(peaks.get("fp8_tflops"))
    models, note = load_models(models_dir or CONFIGS_DIR / "models")
    plan = Plan(gpu=gpu, mode="quick" if quick else "full", peaks=peaks, models=sorted(models))
    if note:
        plan.notes.append(note)
    if any(c.get("kv_lora_rank") for c in models.values()):
        plan.notes.append("MLA attention (deepseek) is not calibrated: its latent-KV layout "
                          "needs an MLA kernel; its GEMMs are calibrated like every model's")
    tps = (1, 8) if quick else TPS
    ms = M_QUICK if quick else M_FULL

    # GEMM: unique (n, k) over models x TP, every M
    nk: dict[tuple[int, int], set[str]] = {}
    for cfg in models.values():
        for tp in tps:
            for op, n, k in model_gemms(cfg, tp):
                nk.setdefault((n, k), set()).add(op)
    for (n, k), ops in sorted(nk.items()):
        only_lm = ops == {"lm_head"}
        for m in ms:
            if only_lm and m > LM_HEAD_MAX_M:
                continue
            plan.gemm.append(GemmShape(m, n, k, "bfloat16", ",".join(sorted(ops))))
    if fp8 and not quick:
        for (n, k), ops in sorted(nk.items()):
            if any(op != "lm_head" for op in ops):
                plan.gemm += [GemmShape(m, n, k, "float8_e4m3fn", ",".join(sorted(ops)))
                              for m in (1, 16, 64, 256, 1024, 4096, 16384)]

    # attention head configurations per rank
    heads = sorted({a for cfg in models.values() for tp in tps
                    if (a := model_attention(cfg, tp)) is not None})
    batches = (1, 16, 64, 256) if quick else (1, 4, 16, 32, 64, 128, 256)
    contexts = (1024, 4096, 16384) if quick else (512, 1024, 2048, 4096, 8192, 16384, 32768,
                                                  131072)
    for h, kv, d in heads:
        for b in batches:
            for c in contexts:
                if b * c <= 2**20 and _kv_bytes(b * c, kv, d) <= MAX_KV_BYTES:
                    plan.decode.append(DecodeShape(b, c, c, h, kv, d, "bfloat16", "bfloat16"))
        for b, cmax in ((16, 4096), (64, 16384)) if quick else (
                (16, 4096), (16, 32768), (64, 4096), (64, 16384), (256, 4096)):
            lengths = mixed_lengths(b, cmax)
            if _kv_bytes(sum(lengths), kv, d) <= MAX_KV_BYTES:
                plan.decode.append(DecodeShape(b, round(sum(lengths) / b), cmax, h, kv, d,
                                               "bfloat16", "bfloat16", tuple(lengths)))
        if fp8 and not quick:
            plan.decode += [DecodeShape(b, c, c, h, kv, d, "bfloat16", "float8_e4m3fn")
                            for b in (16, 64) for c in (4096, 16384)]
    chunks = (256, 2048, 8192) if quick else (16, 64, 256, 512, 1024, 2048, 4096, 8192)
    ctxs = (0, 4096) if quick else (0, 1024, 4096, 16384)
    for h, kv, d in heads:
        for ch in chunks:
            for c in ctxs:
                plan.prefill.append(PrefillShape(1, ch, c, h, kv, d, "bfloat16"))
        if not quick:  # a few multi-sequence chunk batches
            plan.prefill += [PrefillShape(4, 512, 2048, h, kv, d, "bfloat16"),
                             PrefillShape(8, 128, 4096, h, kv, d, "bfloat16")]
    plan.memcpy = [2**26, 2**30] if quick else [2**20, 2**24, 2**26, 2**28, 2**30, 2**32]

    # MoE: the catalog's expert shapes per TP shard, bf16 (one GPU times any TP shard)
    tokens = (1, 16, 256, 4096) if quick else MOE_TOKENS
    for cfg in models.values():
        shape = model_moe(cfg)
        if shape is None:
            continue
        h, inter, topk, experts = shape
        for tp in tps:
            if inter % tp == 0:
                plan.moe += [MoeShape(t, h, inter, topk, experts, tp) for t in tokens]
    plan.moe = sorted(set(plan.moe), key=lambda m: (m.hidden, m.inter, m.experts, m.tp,
                                                    m.tokens))
    # all-reduce: bf16 message sizes per TP size the machine has
    tps_ar = [tp for tp in (2, 4, 8) if tp <= num_gpus]
    sizes = [2**k for k in range(10, 29, 4 if quick else 2)]
    plan.allreduce = [(tp, b) for tp in tps_ar for b in sizes]
    if not tps_ar:
        plan.notes.append(f"all-reduce needs >= 2 GPUs (this machine: {num_gpus}); the "
                          "imported or spec-sheet all-reduce stays in use")
    return plan


def model_moe(cfg: dict) -> tuple[int, int, int, int] | None:
    """``(hidden, expert inter, topk, experts)`` of a MoE model config, else None."""
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get(
        "num_experts")
    if not experts:
        return None
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return cfg["hidden_size"], int(inter), int(cfg.get("num_experts_per_tok", 2)), int(experts)


def mixed_lengths(batch: int, context_max: int, seed: int = 0) -> list[int]:
    """Deterministic mixed context lengths in ``[1, context_max]`` (max included, mean ~half)."""
    rng = random.Random(seed * 1_000_003 + batch * 7919 + context_max)
    return [rng.randint(1, context_max) for _ in range(batch - 1)] + [context_max]


# --------------------------------------------------------------------------- flops / bytes

ELEM = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}


def gemm_flops_bytes(m: int, n: int, k: int, dtype: str) -> tuple[int, int]:
    """``flops = 2mnk``; ``bytes = (mk + kn)·elem_in + mn·elem_out`` (fp8 writes bf16)."""
    e = ELEM[dtype]
    out = 2 if e == 1 else e
    return 2 * m * n * k, (m * k + k * n) * e + m * n * out


def decode_flops_bytes(s: DecodeShape) -> tuple[int, int]:
    """``flops = 4·H·D·sum(ctx)`` (QK and PV); ``bytes`` = K+V read + q and o."""
    tokens = sum(s.lengths) if s.lengths else s.batch * s.context
    flops = 4 * s.num_heads * s.head_dim * tokens
    kv = _kv_bytes(tokens, s.num_kv_heads, s.head_dim, ELEM[s.kv_dtype])
    return flops, kv + 2 * s.batch * s.num_heads * s.head_dim * ELEM[s.dtype]


def moe_flops_bytes(s: MoeShape) -> tuple[float, float]:
    """``flops = 2·3·tokens·topk·hidden·inter/tp`` (w13 and w2); ``bytes`` = weights of the
    experts hit, E·(1 − (1 − topk/E)^tokens), plus activations in and out."""
    i_r = s.inter // s.tp
    hit = s.experts * (1 - (1 - s.topk / s.experts) ** s.tokens)
    e = ELEM[s.dtype]
    return (6.0 * s.tokens * s.topk * s.hidden * i_r,
            hit * 3 * s.hidden * i_r * e + 2 * s.tokens * s.hidden * e)


def prefill_flops_bytes(s: PrefillShape) -> tuple[int, int]:
    """Causal chunk over a cached prefix, per sequence:
    ``flops = 4·H·D·(chunk·context + chunk·(chunk+1)/2)``;
    ``bytes`` = K+V of ``context + chunk`` tokens read once + q and o (compulsory traffic)."""
    pairs = s.chunk * s.context + s.chunk * (s.chunk + 1) // 2
    flops = s.batch * 4 * s.num_heads * s.head_dim * pairs
    e = ELEM[s.dtype]
    kv = _kv_bytes(s.context + s.chunk, s.num_kv_heads, s.head_dim, e)
    return flops, s.batch * (kv + 2 * s.chunk * s.num_heads * s.head_dim * e)

