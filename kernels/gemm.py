"""GEMM ``C[M,N] = alpha * A[M,K] @ B[K,N]`` in Triton: bf16/fp16 (fp8 e4m3 on sm_89+), fp32 acc.

``B`` may be any strided view, e.g. ``W.t()`` of an ``nn.Linear`` weight ``W [N, K]``.

Two autotuned paths, both one kernel body:

- **skinny** (``M <= 64``, decode and small mixed batches): the weight stream dominates
  (``N*K`` bytes vs ``M*N*K`` FLOPs: <= 64 FLOP/byte, below the H100 ridge ~295), so the goal
  is to keep every SM streaming ``B``. Tiles are ``BLOCK_M = 16..64`` (the smallest MMA M,
  chosen to match M), ``BLOCK_N = 64..256``, ``BLOCK_K = 128..256`` with 4 stages of
  prefetch, and **split-K** (2..8) when ``ceil(N / BLOCK_N)`` tiles alone leave SMs idle
  (e.g. N = 4096 with 64-wide tiles = 64 CTAs on 132 SMs). Split-K partials are added with fp32
  atomics into a zeroed fp32 buffer, then cast (an extra ``M*N*6`` bytes, small at M <= 64).
- **tiled** (``M > 64``, prefill): compute-bound; 128x128 / 128x256 / 256x128 tiles with
  ``BLOCK_K = 64``, 3-4 stages (128x256x64 bf16 x 3 stages = 144 KiB of the 228 KiB SMEM),
  8 warps, and a **grouped-M swizzle** (``GROUP_M = 8``) so consecutive CTAs share B columns in
  L2. Smaller 64x128 / 128x64 tiles cover M in 65..256 and ragged N, where wave quantization
  (``ceil(tiles / num_SMs)``) makes big tiles waste a partial wave.

Autotuning is keyed on (M rounded up to a power of two, N, K, dtype) and benchmarks each config
briefly; the target is within 1.25x of ``torch.matmul`` (cuBLAS) for ``M >= 256``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from servesim.kernels import gemm_configs
from servesim.kernels.util import cdiv, interpreting, next_pow2

SKINNY_MAX_M = 64


@triton.jit
def _matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K, M_KEY,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    alpha,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid ``(ceil(M/BLOCK_M) * ceil(N/BLOCK_N), SPLIT_K)``. ``M_KEY`` only keys autotuning."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped-M swizzle: GROUP_M row-tiles walk the same column tiles together (L2 reuse of B)
    width = GROUP_M * num_pid_n
    group_id = pid // width
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        kk = kb * BLOCK_K + rk
        kmask = kk < K
        a = tl.load(a_ptr + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptr + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=kmask[:, None] & nmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    acc = acc * alpha
    c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
    cmask = mmask[:, None] & nmask[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.atomic_add(c_ptrs, acc, mask=cmask)


def _cfg(bm, bn, bk, split_k, warps, stages, group_m=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m,
                          "SPLIT_K": split_k}, num_warps=warps, num_stages=stages)


SKINNY_CONFIGS = [_cfg(*c) for c in gemm_configs.SKINNY]
TILED_CONFIGS = [_cfg(*c) for c in gemm_configs.TILED]


def _prune_skinny(configs, named_args, **kwargs):
    """Keep tiles no taller than needed (BLOCK_M <= max(16, next_pow2(M))) and split-K only
    when every split still gets >= 2 K-tiles (short K loops cannot pipeline)."""
    m, k = named_args["M"], named_args["K"]
    keep = [c for c in configs
            if c.kwargs["BLOCK_M"] <= max(16, next_pow2(m))
            and (c.kwargs["SPLIT_K"] == 1 or k >= 2 * c.kwargs["SPLIT_K"] * c.kwargs["BLOCK_K"])]
    return keep or configs[:1]


def _prune_tiled(configs, named_args, **kwargs):
    """Drop tiles taller than the problem (BLOCK_M > next_pow2(M))."""
    m = named_args["M"]
    keep = [c for c in configs if c.kwargs["BLOCK_M"] <= max(64, next_pow2(m))]
    return keep or configs[:1]


def _tune_bench(fn, quantiles=None):
    """Short, bounded benchmark for autotuning (the calibration then measures the winner)."""
    from servesim.kernels.bench import tune_bench

    return tune_bench(fn, quantiles)


_KEY = ["M_KEY", "N", "K"]
_mm_skinny = triton.autotune(SKINNY_CONFIGS, key=_KEY, reset_to_zero=["c_ptr"],
                             prune_configs_by={"early_config_prune": _prune_skinny},
                             do_bench=_tune_bench)(_matmul_kernel)
_mm_tiled = triton.autotune(TILED_CONFIGS, key=_KEY,
                            prune_configs_by={"early_config_prune": _prune_tiled},
                            do_bench=_tune_bench)(_matmul_kernel)


def _grid(M, N):
    return lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])


def matmul(a: torch.Tensor, b: torch.Tensor, *, alpha: float = 1.0,
           out_dtype: torch.dtype | None = None, config: dict | None = None) -> torch.Tensor:
    """``alpha * a[M,K] @ b[K,N]`` -> ``[M,N]`` in ``out_dtype`` (default a.dtype; fp8 -> bf16).

    ``config``: explicit ``{BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K, num_warps,
    num_stages}`` bypasses autotuning (tests; the CPU interpreter).
    """
    M, K = a.shape
    K2, N = b.shape
    if K != K2:
        raise ValueError(f"inner dimensions differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    fp8 = a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    out_dtype = out_dtype or (torch.bfloat16 if fp8 else a.dtype)
    upcast = interpreting()
    m_key = min(next_pow2(M), 8192)
    if config is None and upcast:  # autotuning needs a GPU to time configs
        config = heuristic_config(M, N, K)
    if config is not None:
        cfg = dict(config)
        warps, stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
        cfg.setdefault("GROUP_M", 8)
        cfg.setdefault("SPLIT_K", 1)
        split = cfg["SPLIT_K"] > 1
        c = (torch.zeros((M, N), device=a.device, dtype=torch.float32) if split
             else torch.empty((M, N), device=a.device, dtype=out_dtype))
        grid = (cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), cfg["SPLIT_K"])
        _matmul_kernel[grid](a, b, c, M, N, K, m_key, a.stride(0), a.stride(1), b.stride(0),
                             b.stride(1), c.stride(0), c.stride(1), alpha, **cfg, UPCAST=upcast,
                             num_warps=warps, num_stages=stages)
        return c.to(out_dtype) if split else c
    if M <= SKINNY_MAX_M:
        c = torch.zeros((M, N), device=a.device, dtype=torch.float32)
        _mm_skinny[_grid(M, N)](a, b, c, M, N, K, m_key, a.stride(0), a.stride(1), b.stride(0),
                                b.stride(1), c.stride(0), c.stride(1), alpha, UPCAST=upcast)
        return c.to(out_dtype)
    c = torch.empty((M, N), device=a.device, dtype=out_dtype)
    _mm_tiled[_grid(M, N)](a, b, c, M, N, K, m_key, a.stride(0), a.stride(1), b.stride(0),
                           b.stride(1), c.stride(0), c.stride(1), alpha, UPCAST=upcast)
    return c


def heuristic_config(M: int, N: int, K: int) -> dict:
    """A reasonable untuned config (used where autotuning cannot time, e.g. the interpreter)."""
    if M <= SKINNY_MAX_M:
        bm = max(16, next_pow2(M))
        split = 4 if K >= 8 * 128 else 1
        return {"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 128 if K >= 128 else 32,
                "SPLIT_K": split, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
            "num_warps": 8, "num_stages": 3}


def fp8_supported() -> bool:
    """fp8 (e4m3) tensor-core GEMM needs compute capability >= 8.9 (Ada, Hopper, Blackwell)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def matmul_fp8(a: torch.Tensor, b: torch.Tensor, scale_a: float, scale_b: float,
               *, out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None):
    """Per-tensor-scaled fp8 GEMM: ``(scale_a * scale_b) * a_fp8 @ b_fp8`` -> ``out_dtype``."""
    if a.is_cuda and not fp8_supported():
        raise RuntimeError("fp8 GEMM needs a GPU with compute capability >= 8.9")
    return matmul(a, b, alpha=scale_a * scale_b, out_dtype=out_dtype, config=config)
