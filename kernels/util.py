"""Small helpers shared by the Triton kernels (no torch/triton import at module level)."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    The interpreter's numpy ``tl.dot`` mishandles bfloat16 operands, so kernels take an
    ``UPCAST`` flag and feed fp32 to ``tl.dot`` there; on a GPU the operands stay 16-bit (fp8)
    so the dot runs on tensor cores.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
