"""Triton GEMM vs torch (Triton interpreter; explicit configs since autotuning needs a GPU)."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[kernels]')")
pytest.importorskip("triton", reason="triton is not importable; kernel tests need it (CPU "
                    "interpreter via TRITON_INTERPRET=1)")

from servesim.kernels.gemm import (
    SKINNY_CONFIGS,
    TILED_CONFIGS,
    _prune_skinny,
    heuristic_config,
    matmul,
    matmul_fp8,
)
from servesim.kernels.reference import matmul_ref

CASES = [
    # (M, N, K, config): skinny, split-K with a ragged K, grouped-M swizzle over ragged edges
    (1, 40, 70, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2}),
    (3, 64, 96, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 4}),
    (37, 50, 64, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}),
    (70, 33, 48, {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2}),
]


def _close(out, ref, dtype):
    scale = ref.float().abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,N,K,config", CASES)
def test_matmul_matches_reference(dtype, M, N, K, config):
    g = torch.Generator().manual_seed(M * N)
    a = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)  # nn.Linear weight; b = w.t() is strided
    out = matmul(a, w.t(), config=config, alpha=0.5)
    assert out.dtype == dtype and out.shape == (M, N)
    _close(out, matmul_ref(a, w.t(), alpha=0.5), dtype)


@pytest.mark.parametrize("M", [2, 100])
def test_matmul_default_config_under_interpreter(M):
    a = torch.randn(M, 256)
    b = torch.randn(256, 48)
    _close(matmul(a, b), a @ b, torch.float32)
    assert heuristic_config(M, 48, 256)["BLOCK_M"] == (16 if M <= 64 else 128)


def test_matmul_fp8_scaled():
    a = torch.randn(20, 64)
    b = torch.randn(64, 40)
    a8, b8 = (a / 2).to(torch.float8_e4m3fn), (b / 3).to(torch.float8_e4m3fn)
    out = matmul_fp8(a8, b8, 2.0, 3.0,
                     config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2})
    assert out.dtype == torch.bfloat16
    _close(out, matmul_ref(a8, b8, alpha=6.0, out_dtype=torch.bfloat16), torch.bfloat16)


def test_autotune_config_lists_and_pruning():
    assert any(c.kwargs["SPLIT_K"] > 1 for c in SKINNY_CONFIGS)
    assert {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in TILED_CONFIGS} >= {
        (128, 128), (128, 256)}
    kept = _prune_skinny(SKINNY_CONFIGS, {"M": 1, "K": 512})
    assert all(c.kwargs["BLOCK_M"] == 16 for c in kept)
    assert all(c.kwargs["SPLIT_K"] * c.kwargs["BLOCK_K"] * 2 <= 512 for c in kept)
