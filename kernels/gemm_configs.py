"""GEMM autotuning configs as plain tuples (importable without triton, e.g. by the planner).

Each entry: ``(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)``; ``GROUP_M = 8``.
Rationale in :mod:`servesim.kernels.gemm`.
"""

SKINNY = (  # M <= 64: weight streaming; small BLOCK_M, wide N or split-K to fill the SMs
    (16, 64, 256, 1, 4, 4), (16, 128, 128, 1, 4, 4), (16, 256, 128, 1, 8, 3),
    (16, 64, 256, 2, 4, 4), (16, 64, 256, 4, 4, 4), (16, 128, 128, 4, 4, 4),
    (16, 64, 128, 8, 4, 4),
    (32, 64, 128, 1, 4, 4), (32, 128, 128, 2, 4, 4), (32, 64, 128, 4, 4, 4),
    (64, 64, 128, 1, 4, 4), (64, 128, 64, 1, 4, 4), (64, 128, 128, 2, 4, 3),
)
TILED = (  # M > 64: tensor-core bound; big tiles, grouped-M swizzle; smaller tiles for waves
    (128, 256, 64, 1, 8, 3), (256, 128, 64, 1, 8, 3), (128, 128, 64, 1, 8, 4),
    (128, 128, 64, 1, 4, 4), (128, 128, 128, 1, 8, 3), (128, 64, 64, 1, 4, 4),
    (64, 128, 64, 1, 4, 4), (64, 256, 64, 1, 8, 3), (64, 64, 64, 1, 4, 4),
)
N_SKINNY, N_TILED = len(SKINNY), len(TILED)
