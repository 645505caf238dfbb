"""``simulate calibrate``: microbenchmark plan, GPU runner, calibration-file writer and report.

The plan (shapes to time) is derived from the model catalog (``configs/models/*.yaml``, HF
``config.json`` fields) at TP 1/2/4/8; building it, estimating its duration, writing and
reporting calibration files need only PyYAML. Timing (``run_calibration``) imports torch and
Triton and needs a CUDA GPU. The file schema is DEVELOPERS.md "Calibration file"; rows carry
a few extra keys (``ops``, ``vendor_impl``, ``kv_dtype``, ``traffic_bytes``), never fewer.

Units: seconds, bytes, FLOPs; ``peaks`` in TFLOP/s (1e12) and GB/s (1e9 B/s).
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from servesim.simulator.errors import ServesimError

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
NO_GPU_MESSAGE = ("simulate calibrate needs a CUDA GPU (torch.cuda.is_available() is False); "
                  "use --dry-run to see the plan")

TPS = (1, 2, 4, 8)
M_FULL = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
M_QUICK = (1, 4, 16, 64, 256, 1024, 4096, 16384)
LM_HEAD_MAX_M = 1024  # the LM head runs on sampled rows only (<= max_num_seqs)
BLOCK_SIZE = 16  # vLLM's default KV block size
MAX_KV_BYTES = 16 * 2**30  # per decode/prefill shape (K + V), fits any 40 GB+ GPU with vendor copy

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


# --------------------------------------------------------------------------- plan


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
                          "needs an MLA kernel; its GEMMs are")
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


MOE_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 8192)


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
    import random

    rng = random.Random(seed * 1_000_003 + batch * 7919 + context_max)
    lengths = [rng.randint(1, context_max) for _ in range(batch - 1)] + [context_max]
    return lengths


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


# --------------------------------------------------------------------------- estimate

# Assumptions of the duration estimate (not measurements): kernels run at these fractions of
# the spec peaks; a cold Triton cache compiles each kernel variant in COMPILE_S.
EST_EFF_FLOPS, EST_EFF_BW = 0.6, 0.7
EST_LAUNCH_S = 10e-6
EST_SETUP_S = 3e-3  # per shape: Python, events, small allocations
EST_INIT_BW = 0.3  # random initialisation of inputs at this fraction of peak bandwidth
COMPILE_S = 1.5
FLUSH_BYTES = 256 * 2**20


@dataclass(frozen=True)
class BenchSettings:
    """Benchmark loop: warm-up by time, then ``clamp(rep_s / t, min_reps, max_reps)`` timed
    repeats, each after an L2 flush (a 256 MiB memset) and timed with CUDA events."""
    warmup_s: float
    rep_s: float
    min_reps: int
    max_reps: int


BENCH_FULL = BenchSettings(warmup_s=0.005, rep_s=0.025, min_reps=5, max_reps=100)
BENCH_QUICK = BenchSettings(warmup_s=0.002, rep_s=0.010, min_reps=3, max_reps=30)
BENCH_TUNE = BenchSettings(warmup_s=0.0, rep_s=0.002, min_reps=3, max_reps=10)


def _kernel_s(flops: int, nbytes: int, peaks: dict, fp8: bool = False) -> float:
    tf = (peaks.get("fp8_tflops") if fp8 else None) or peaks["bf16_tflops"]
    return max(flops / (tf * 1e12 * EST_EFF_FLOPS),
               nbytes / (peaks["mem_bw_gbps"] * 1e9 * EST_EFF_BW)) + EST_LAUNCH_S


def bench_wall_s(t: float, bw_gbps: float, s: BenchSettings) -> float:
    """Wall seconds of one :func:`bench` call on a kernel of ``t`` seconds."""
    flush = FLUSH_BYTES / (bw_gbps * 1e9) + EST_LAUNCH_S
    n_warm = min(50, max(1, math.ceil(s.warmup_s / t))) if s.warmup_s else 0
    n_rep = min(s.max_reps, max(s.min_reps, math.ceil(s.rep_s / t)))
    return (2 + n_warm) * t + n_rep * (t + flush) + 1e-3


def estimate_plan(plan: Plan) -> dict[str, dict]:
    """Per family: ``{shapes, measure_s, tune_s, compile_s, total_s}`` (an estimate)."""
    p, bw = plan.peaks, plan.peaks["mem_bw_gbps"]
    s = BENCH_QUICK if plan.mode == "quick" else BENCH_FULL
    from servesim.kernels.gemm_configs import N_SKINNY, N_TILED  # no torch import

    est: dict[str, dict] = {}
    # GEMM: Triton (autotuned per power-of-two M bucket and (n, k, dtype)) + vendor
    measure = tune = 0.0
    keys: set = set()
    weights: set = set()
    for g in plan.gemm:
        fl, by = gemm_flops_bytes(g.m, g.n, g.k, g.dtype)
        t = _kernel_s(fl, by, p, g.dtype.startswith("float8"))
        vendor = g.dtype == "bfloat16" or g.m % 16 == 0
        measure += bench_wall_s(t, bw, s) * (2 if vendor else 1) + EST_SETUP_S
        if (g.n, g.k, g.dtype) not in weights:
            weights.add((g.n, g.k, g.dtype))
            measure += 4 * g.n * g.k / (bw * 1e9 * EST_INIT_BW)
        key = (min(1 << max(0, g.m - 1).bit_length(), 8192), g.n, g.k, g.dtype)
        if key not in keys:
            keys.add(key)
            n_cfg = N_SKINNY if g.m <= 64 else N_TILED
            tune += n_cfg * bench_wall_s(t * 1.5, bw, BENCH_TUNE)
    m_variants = 3  # Triton specialises M == 1, M % 16 != 0, M % 16 == 0
    dtypes = {g.dtype for g in plan.gemm}
    compile_s = COMPILE_S * (N_SKINNY * m_variants + N_TILED) * len(dtypes)
    est["gemm"] = _family(len(plan.gemm), measure, tune, compile_s)

    measure = 0.0
    for d in plan.decode:
        fl, by = decode_flops_bytes(d)
        t = _kernel_s(fl, by, p)
        measure += bench_wall_s(t, bw, s) * (1 if d.lengths else 2) + EST_SETUP_S
        measure += 2 * by / (bw * 1e9 * EST_INIT_BW)  # paged + contiguous copies
    variants = {(d.head_dim, d.kv_dtype) for d in plan.decode}
    est["decode_attention"] = _family(len(plan.decode), measure, 0.0,
                                      COMPILE_S * (len(variants) * 2 + 6))
    measure = 0.0
    for f in plan.prefill:
        fl, by = prefill_flops_bytes(f)
        t = _kernel_s(fl, by, p)
        measure += bench_wall_s(t, bw, s) * 2 + EST_SETUP_S + 2 * by / (bw * 1e9 * EST_INIT_BW)
    variants = {(f.head_dim, f.num_heads // f.num_kv_heads) for f in plan.prefill}
    est["prefill_attention"] = _family(len(plan.prefill), measure, 0.0, COMPILE_S * len(variants))
    measure = sum(bench_wall_s(2 * b / (bw * 1e9 * EST_EFF_BW), bw, s) for b in plan.memcpy)
    est["memcpy"] = _family(len(plan.memcpy), measure, 0.0, 0.0)
    measure = 0.0
    for m in plan.moe:
        fl, by = moe_flops_bytes(m)
        # the torch reference runs one GEMM pair per expert hit: ~3 launches each
        t = _kernel_s(fl, by, p) + 3 * min(m.experts, m.tokens * m.topk) * EST_LAUNCH_S
        measure += bench_wall_s(t, bw, s) + EST_SETUP_S + by / (bw * 1e9 * EST_INIT_BW)
    est["moe"] = _family(len(plan.moe), measure, 0.0, 0.0)
    link = 50.0  # GB/s, a conservative NVLink/PCIe all-reduce bus bandwidth
    measure = sum(2 * (bench_wall_s(20e-6 + b / (link * 1e9), bw, s) + EST_SETUP_S)
                  for _, b in plan.allreduce)  # graph and eager
    est["allreduce"] = _family(len(plan.allreduce), measure, 0.0,
                               5.0 * len({tp for tp, _ in plan.allreduce}))  # process start
    return est


def _family(n, measure, tune, compile_s):
    return {"shapes": n, "measure_s": measure, "tune_s": tune, "compile_s": compile_s,
            "total_s": measure + tune + compile_s}


def format_plan(plan: Plan, est: dict[str, dict]) -> str:
    """Human-readable plan: shape counts and estimated durations per kernel family."""
    lines = [(f"calibration plan for {plan.gpu} ({plan.mode}); peaks: "
              f"bf16 {plan.peaks['bf16_tflops']} TFLOP/s, fp8 {plan.peaks.get('fp8_tflops')} "
              f"TFLOP/s, HBM {plan.peaks['mem_bw_gbps']} GB/s"),
             f"models: {', '.join(plan.models)}"]
    lines += [f"note: {n}" for n in plan.notes]
    lines.append(f"{'family':<20}{'shapes':>8}{'measure':>10}{'tune':>9}{'compile':>10}"
                 f"{'total':>9}")
    tot = 0.0
    for fam, e in est.items():
        tot += e["total_s"]
        lines.append(f"{fam:<20}{e['shapes']:>8}{e['measure_s']:>9.0f}s{e['tune_s']:>8.0f}s"
                     f"{e['compile_s']:>9.0f}s{e['total_s']:>8.0f}s")
    lines.append(f"{'total':<20}{sum(e['shapes'] for e in est.values()):>8}{'':>28}"
                 f"{tot:>8.0f}s  (~{tot / 60:.1f} min)")
    lines.append(f"estimate assumes kernels at {EST_EFF_FLOPS:.0%} of peak FLOP/s or "
                 f"{EST_EFF_BW:.0%} of peak bandwidth, a cold Triton cache ({COMPILE_S} s per "
                 "kernel variant) and the L2-flushed benchmark loop; fp8 GEMM / fp8-KV rows "
                 "(full mode) run only on GPUs with compute capability >= 8.9")
    return "\n".join(lines)


# --------------------------------------------------------------------------- file I/O

ROW_KEYS = {
    "memcpy": ("bytes", "seconds"),
    "gemm": ("m", "n", "k", "dtype", "flops", "bytes", "triton_s", "vendor_s"),
    "decode_attention": ("batch", "context", "context_max", "num_heads", "num_kv_heads",
                         "head_dim", "block_size", "dtype", "flops", "bytes", "triton_s",
                         "vendor_s"),
    "prefill_attention": ("batch", "chunk", "context", "num_heads", "num_kv_heads", "head_dim",
                          "dtype", "flops", "bytes", "triton_s", "vendor_s"),
}
FINGERPRINT_KEYS = ("device_name", "sm_count", "driver", "cuda", "torch", "triton", "date",
                    "servesim_version", "mode")


def validate_calibration(doc, where: str) -> dict:
    """Check a calibration document against the DEVELOPERS.md schema; one-line errors."""
    if not isinstance(doc, dict):
        raise ServesimError(f"{where}: expected a mapping at the top level")
    if doc.get("version") == 2:
        return _validate_v2(doc, where)
    if doc.get("version") != 1:
        raise ServesimError(f"{where}: version: expected 1 or 2, got {doc.get('version')!r}")
    for key in ("gpu", "fingerprint", "peaks"):
        if key not in doc:
            raise ServesimError(f"{where}: missing top-level key '{key}'")
    missing = [k for k in FINGERPRINT_KEYS if k not in (doc["fingerprint"] or {})]
    if missing:
        raise ServesimError(f"{where}: fingerprint: missing {', '.join(missing)}")
    for k in ("bf16_tflops", "mem_bw_gbps"):
        if not isinstance((doc["peaks"] or {}).get(k), (int, float)):
            raise ServesimError(f"{where}: peaks.{k}: expected a number")
    for section, keys in ROW_KEYS.items():
        rows = doc.get(section)
        if rows is None:
            raise ServesimError(f"{where}: missing section '{section}' (a list, may be empty)")
        if not isinstance(rows, list):
            raise ServesimError(f"{where}: {section}: expected a list of rows")
        for i, row in enumerate(rows):
            absent = [k for k in keys if k not in (row or {})]
            if absent:
                raise ServesimError(f"{where}: {section}[{i}]: missing {', '.join(absent)}")
            for k in ("triton_s", "vendor_s", "seconds"):
                v = row.get(k)
                if v is not None and not (isinstance(v, (int, float)) and v > 0):
                    raise ServesimError(f"{where}: {section}[{i}].{k}: expected seconds > 0 "
                                        f"or null, got {v!r}")
    return doc


def _validate_v2(doc: dict, where: str) -> dict:
    """Version 2 (curves per row, all families optional): the cost model's reader parses every
    row, so what validates here loads there."""
    from servesim.costmodels.calibration import FAMILIES, Calibration

    for key in ("gpu", "peaks"):
        if key not in doc:
            raise ServesimError(f"{where}: missing top-level key '{key}'")
    for k in ("bf16_tflops", "mem_bw_gbps"):
        if not isinstance((doc["peaks"] or {}).get(k), (int, float)):
            raise ServesimError(f"{where}: peaks.{k}: expected a number")
    if not any(doc.get(f) for f in FAMILIES):
        raise ServesimError(f"{where}: no rows in any of {', '.join(FAMILIES)}")
    Calibration(Path(where), doc, None)
    return doc


def read_calibration(path: Path) -> dict:
    """A calibration file (YAML or JSON), validated."""
    from servesim.costmodels.calibration import read_doc

    path = Path(path)
    if not path.is_file():
        raise ServesimError(f"{path}: no such calibration file")
    return validate_calibration(read_doc(path, cached=False), str(path))


class _Dumper(yaml.SafeDumper):
    pass


def _flat(v) -> bool:
    return not isinstance(v, (dict, list)) or (isinstance(v, list) and all(
        not isinstance(x, (dict, list)) for x in v))


def _represent_dict(dumper, data):
    flow = all(_flat(v) for v in data.values()) and len(data) > 1
    return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=flow)


def _represent_list(dumper, data):
    flow = bool(data) and all(not isinstance(x, (dict, list)) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(dict, _represent_dict)
_Dumper.add_representer(list, _represent_list)


def dump_calibration(doc: dict, fmt: str = "yaml") -> str:
    """YAML (or JSON) text: sections in schema order, one row per line."""
    if fmt != "json":
        return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100000,
                         allow_unicode=False)
    import json

    def one(v) -> str:
        return json.dumps(v, separators=(", ", ": "))

    lines = ["{"]
    for i, (k, v) in enumerate(doc.items()):
        end = "," if i < len(doc) - 1 else ""
        if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            rows = [f"    {one(r)}," for r in v]
            rows[-1] = rows[-1][:-1]
            lines += [f"  {json.dumps(k)}: [", *rows, f"  ]{end}"]
        elif isinstance(v, dict) and any(isinstance(x, dict) for x in v.values()):
            rows = [f"    {json.dumps(kk)}: {one(vv)}," for kk, vv in v.items()]
            rows[-1] = rows[-1][:-1]
            lines += [f"  {json.dumps(k)}: {{", *rows, f"  }}{end}"]
        else:
            lines.append(f"  {json.dumps(k)}: {one(v)}{end}")
    return "\n".join(lines + ["}", ""])


def write_calibration(doc: dict, path: Path) -> Path:
    """Validate and write atomically (temp file + rename)."""
    path = Path(path)
    validate_calibration(doc, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(dump_calibration(doc, "json" if path.suffix == ".json" else "yaml"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; a data file is world-readable
    os.replace(tmp, path)
    return path


def new_document(gpu: str, fingerprint: dict, peaks: dict) -> dict:
    """An empty measured calibration document (schema version 2: rows are points, each with
    ``seconds`` = the faster of ``triton_s`` and ``vendor_s`` and the ``kernel`` it was)."""
    return {"version": 2, "gpu": gpu, "fingerprint": fingerprint, "peaks": peaks,
            "source": {"kind": "measured", "tool": "simulate calibrate"},
            "memcpy": [], "gemm": [], "decode_attention": [], "prefill_attention": [],
            "allreduce": [], "moe": []}


def _timed(r: dict) -> dict:
    """``seconds`` and ``kernel`` of a Triton/vendor measurement (the faster one)."""
    cand = [(r.get("vendor_s"), r.get("vendor_impl") or "vendor"), (r.get("triton_s"),
                                                                       "triton")]
    cand = [(t, k) for t, k in cand if t]
    t, k = min(cand)
    return {"seconds": t, "kernel": k}


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


# --------------------------------------------------------------------------- report


def _stats(xs: list[float]) -> str:
    if not xs:
        return "no rows"
    xs = sorted(xs)
    med = xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])
    geo = math.exp(sum(math.log(x) for x in xs) / len(xs))
    return f"n={len(xs):<4} median {med:6.2f}  geomean {geo:6.2f}  min {xs[0]:6.2f}  " \
           f"max {xs[-1]:6.2f}"


def report_lines(doc: dict) -> list[str]:
    """Kernel quality: Triton/vendor GEMM time by M class, decode bandwidth and prefill FLOP/s
    as % of the spec peaks."""
    if (doc.get("source") or {}).get("kind") == "aiconfigurator":
        raise ServesimError("calibrate report: kernel quality compares servesim's Triton kernels "
                            "with the vendor path, which only `simulate calibrate` measures; "
                            "this file is imported: use `simulate calibrate check FILE`")
    fp, peaks = doc.get("fingerprint") or {}, doc["peaks"]
    out = [(f"calibration for {doc['gpu']}: {fp.get('device_name')} "
            f"({fp.get('sm_count')} SMs), {fp.get('mode')} run {fp.get('date')}; "
            f"torch {fp.get('torch')}, triton {fp.get('triton')}, CUDA {fp.get('cuda')}, "
            f"driver {fp.get('driver')}")]
    if doc.get("synthetic"):
        out.append("WARNING: synthetic numbers (test fixture), not measurements")
    bw = peaks["mem_bw_gbps"] * 1e9
    if doc["memcpy"]:
        best = max(2 * r["bytes"] / r["seconds"] for r in doc["memcpy"])
        out.append(f"memcpy: best device-to-device {best / 1e9:,.0f} GB/s (read + write) = "
                   f"{100 * best / bw:.0f}% of {peaks['mem_bw_gbps']} GB/s")
    out.append("GEMM Triton time / vendor time (< 1 = Triton faster; target <= 1.25 at M >= 256)")
    for dtype in sorted({r["dtype"] for r in doc["gemm"]}):
        rows = [r for r in doc["gemm"] if r["dtype"] == dtype and r["triton_s"] and r["vendor_s"]]
        for label, pred in (("M <= 16", lambda m: m <= 16),
                            ("16 < M < 256", lambda m: 16 < m < 256),
                            ("M >= 256", lambda m: m >= 256)):
            xs = [r["triton_s"] / r["vendor_s"] for r in rows if pred(r["m"])]
            out.append(f"  {dtype:<14}{label:<14}{_stats(xs)}")
    out.append(f"decode attention achieved bandwidth, % of {peaks['mem_bw_gbps']} GB/s "
               "(target >= 70 at batch >= 16, context >= 4k)")
    for impl in ("triton_s", "vendor_s"):
        rows = [r for r in doc["decode_attention"] if r.get(impl)]
        for label, pred in (("batch>=16 ctx>=4k", lambda r: r["batch"] >= 16 and
                             r["context_max"] >= 4096),
                            ("other", lambda r: not (r["batch"] >= 16 and
                                                     r["context_max"] >= 4096))):
            xs = [100 * r["bytes"] / r[impl] / bw for r in rows if pred(r)]
            out.append(f"  {impl[:-2]:<8}{label:<20}{_stats(xs)}")
    out.append("prefill attention achieved TFLOP/s, % of spec "
               f"(bf16 {peaks['bf16_tflops']} TFLOP/s)")
    for impl in ("triton_s", "vendor_s"):
        rows = [r for r in doc["prefill_attention"] if r.get(impl)]
        for label, pred in (("chunk < 512", lambda r: r["chunk"] < 512),
                            ("chunk >= 512", lambda r: r["chunk"] >= 512)):
            xs = [100 * r["flops"] / r[impl] / (peaks["bf16_tflops"] * 1e12)
                  for r in rows if pred(r)]
            out.append(f"  {impl[:-2]:<8}{label:<20}{_stats(xs)}")
    return out


# --------------------------------------------------------------------------- GPU run


def fingerprint(mode: str) -> dict:
    """Device and software versions (needs torch; call on the GPU machine)."""
    import subprocess
    from importlib import metadata

    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=False, timeout=20,
        ).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = None
    try:
        version = metadata.version("servesim")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    return {"device_name": props.name, "sm_count": props.multi_processor_count,
            "driver": driver, "cuda": torch.version.cuda, "torch": torch.__version__,
            "triton": triton.__version__, "date": utc_now(), "servesim_version": version,
            "mode": mode, "compute_capability": f"{props.major}.{props.minor}"}


def require_gpu() -> None:
    """Raise the one-line error when torch or a CUDA GPU is missing."""
    try:
        import torch
    except ImportError:
        raise ServesimError("simulate calibrate needs torch and triton (pip install -e "
                            "'.[kernels]'); use --dry-run to see the plan") from None
    if not torch.cuda.is_available():
        raise ServesimError(NO_GPU_MESSAGE)


def run_calibration(gpu: str, output: Path, quick: bool = False, *, progress=None,
                    log=print) -> Path:
    """Time every shape of the plan on the current GPU and write the calibration file."""
    require_gpu()
    import torch
    from servesim.kernels.gemm import fp8_supported

    fp8 = fp8_supported()
    plan = build_plan(gpu, quick, fp8=fp8, num_gpus=torch.cuda.device_count())
    for n in plan.notes:
        log(f"note: {n}")
    fpr = fingerprint(plan.mode)
    log(f"calibrating {gpu} on {fpr['device_name']} ({plan.mode}): {len(plan.gemm)} GEMM, "
        f"{len(plan.decode)} decode, {len(plan.prefill)} prefill, {len(plan.moe)} MoE, "
        f"{len(plan.allreduce)} all-reduce shapes")
    doc = new_document(gpu, fpr, plan.peaks)
    measure_plan(plan, doc, BENCH_QUICK if quick else BENCH_FULL, progress=progress)
    if doc.get("skipped"):
        log(f"skipped {len(doc['skipped'])} shapes (listed under 'skipped' in the file)")
    return write_calibration(doc, output)


def measure_plan(plan: Plan, doc: dict, settings: BenchSettings, *, progress=None) -> dict:
    """Time every shape of ``plan`` and append rows to ``doc`` (failed shapes -> 'skipped')."""
    from servesim.kernels import bench as B

    total = len(plan.memcpy) + len(plan.gemm) + len(plan.decode) + len(plan.prefill) + len(
        plan.moe) + len(plan.allreduce)
    skipped: list[str] = []
    advance = progress(total) if progress else (lambda: None)

    def guarded(what, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 -- OOM, compile failure: record the shape, go on
            skipped.append(f"{what}: {e.__class__.__name__}: {str(e).splitlines()[0][:120]}")
            B.release()
            return None
        finally:
            advance()

    for nbytes in plan.memcpy:
        s = guarded(f"memcpy {nbytes}", lambda nbytes=nbytes: B.time_memcpy(nbytes, settings))
        if s:
            doc["memcpy"].append({"bytes": nbytes, "seconds": s, "traffic_bytes": 2 * nbytes})
    for g in plan.gemm:
        r = guarded(f"gemm {g}", lambda g=g: B.time_gemm(g.m, g.n, g.k, g.dtype, settings))
        if r:
            fl, by = gemm_flops_bytes(g.m, g.n, g.k, g.dtype)
            doc["gemm"].append({"m": g.m, "n": g.n, "k": g.k, "dtype": g.dtype, "flops": fl,
                                "bytes": by, **r, **_timed(r), "ops": g.ops})
    for d in plan.decode:
        r = guarded(f"decode {d}", lambda d=d: B.time_decode(d, BLOCK_SIZE, settings))
        if r:
            fl, by = decode_flops_bytes(d)
            row = {"batch": d.batch, "context": d.context, "context_max": d.context_max,
                   "num_heads": d.num_heads, "num_kv_heads": d.num_kv_heads,
                   "head_dim": d.head_dim, "block_size": BLOCK_SIZE, "dtype": d.dtype,
                   "flops": fl, "bytes": by, **r, **_timed(r)}
            if d.kv_dtype != d.dtype:
                row["kv_dtype"] = d.kv_dtype
            doc["decode_attention"].append(row)
    for f in plan.prefill:
        r = guarded(f"prefill {f}", lambda f=f: B.time_prefill(f, BLOCK_SIZE, settings))
        if r:
            fl, by = prefill_flops_bytes(f)
            doc["prefill_attention"].append({
                "batch": f.batch, "chunk": f.chunk, "context": f.context,
                "num_heads": f.num_heads, "num_kv_heads": f.num_kv_heads,
                "head_dim": f.head_dim, "dtype": f.dtype, "flops": fl, "bytes": by, **r,
                **_timed(r)})
    for m in plan.moe:
        r = guarded(f"moe {m}", lambda m=m: B.time_moe(m, settings))
        if r:
            fl, by = moe_flops_bytes(m)
            doc["moe"].append({"dtype": m.dtype, "distribution": "balanced", "hidden": m.hidden,
                               "inter": m.inter, "topk": m.topk, "experts": m.experts,
                               "tp": m.tp, "ep": 1, "tokens": m.tokens, "flops": fl,
                               "bytes": by, "seconds": r["seconds"], "kernel": r["kernel"]})
    by_tp: dict[int, list[int]] = {}
    for tp, nbytes in plan.allreduce:
        by_tp.setdefault(tp, []).append(nbytes)
    for tp, sizes in sorted(by_tp.items()):
        rows = guarded(f"allreduce tp={tp}", lambda tp=tp, sizes=sizes: B.time_allreduce(
            tp, sizes, settings))
        for _ in sizes[1:]:
            advance()
        for mode, nbytes, sec in rows or []:
            doc["allreduce"].append({"mode": mode, "dtype": "bfloat16", "tp": tp,
                                     "bytes": nbytes, "seconds": sec,
                                     "kernel": f"torch.distributed nccl ({mode})"})
    if skipped:
        doc["skipped"] = skipped
    return doc


# --------------------------------------------------------------------------- fit check


def check_file(path: Path) -> dict:
    """``costmodels.calibration.check`` of a calibration file (validated first), as
    ``{file, gpu, source, families: {family: {...}}}``."""
    from servesim.costmodels.calibration import Calibration, check
    from servesim.costmodels.config import HardwareConfig
    from servesim.costmodels.specs import hardware_names, load_hardware_spec

    doc = read_calibration(path)
    gpu = str(doc.get("gpu", ""))
    spec = load_hardware_spec(HardwareConfig(name=gpu)) if gpu in hardware_names() else None
    cal = Calibration(Path(path), doc, spec)
    return {"file": str(path), "gpu": gpu, "source": doc.get("source") or {},
            "synthetic": bool(doc.get("synthetic")), "families": check(cal)}


def check_lines(path: Path, res: dict) -> list[str]:
    """The check as a table: per family, curves, points, median/P90 |error| at the measured
    points and leave-one-out (each point predicted from its curve's other points)."""
    src = res["source"]
    if src.get("kind") == "aiconfigurator":
        what = (f"{src.get('package')} {src.get('package_version')}, {src.get('device')}, "
                "measured by NVIDIA (Apache-2.0)")
    else:
        what = "SYNTHETIC test fixture, not a measurement" if res.get("synthetic") else \
            "measured with simulate calibrate"
    head = (f"{'family':<19}{'source':<36}{'curves':>7}{'points':>8}   "
            f"{'|err| at rows med/P90':<23}{'leave-one-out med/P90':<22}")
    out = [f"calibration check: {path} (gpu {res['gpu']}; {what})", head]

    def pct(x):
        return "  n/a" if math.isnan(x) else f"{100 * x:5.2f}%"

    for fam, r in res["families"].items():
        out.append(f"{fam:<19}{str(r['source'])[:35]:<36}{r['curves']:>7}{r['points']:>8}   "
                   f"{pct(r['median_abs_err'])} / {pct(r['p90_abs_err']):<12}"
                   f"{pct(r['loo_median_abs_err'])} / {pct(r['loo_p90_abs_err'])}")
    out.append("at rows: the cost model's lookup at each measured point (interpolation is exact "
               "there); leave-one-out: each point predicted from its neighbours along the curve "
               "(ends: roofline x the neighbour's efficiency), i.e. the error between points")
    return out
