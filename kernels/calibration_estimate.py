"""Benchmark-loop settings and how long a calibration plan will take (``--dry-run``).

The estimate is arithmetic on the plan (no GPU, no torch): each shape's kernel time from its
FLOPs and bytes at assumed fractions of the spec peaks, the benchmark loop's repeats and L2
flushes around it, Triton autotuning per GEMM bucket and a cold compile per kernel variant.

Units: seconds; bandwidths in GB/s, rates in TFLOP/s as in ``Plan.peaks``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from servesim.kernels.calibration_plan import (
    Plan,
    decode_flops_bytes,
    gemm_flops_bytes,
    moe_flops_bytes,
    prefill_flops_bytes,
)

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

