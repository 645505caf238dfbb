"""Paged-attention decode (one query token per sequence) in Triton, with split-KV.

Layout (vLLM's, separate K and V caches):

- ``q``            ``[num_seqs, num_heads, head_dim]``
- ``k_cache``      ``[num_blocks, block_size, num_kv_heads, head_dim]`` (same for ``v_cache``)
- ``block_tables`` ``[num_seqs, max_blocks]`` int32, physical block ids
- ``seq_lens``     ``[num_seqs]`` int32, tokens of context per sequence (the new token included)
- output           ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``

Token ``t`` of a sequence lives at ``k_cache[block_tables[s, t // block_size], t % block_size]``.

Design (targets: >= 70 % of HBM bandwidth at batch >= 16 and context >= 4k on H100/H200):

- One program per (sequence, KV head, KV partition). It loads each K/V tile once and serves
  all ``num_heads // num_kv_heads`` query heads of that KV head (GQA), so KV bytes are read
  exactly once. The query-head group is padded to 16 rows so ``q @ k^T`` and ``p @ v`` are
  ``tl.dot`` calls on tensor cores (16 is the smallest MMA M); the padding costs FLOPs, not
  bytes, and decode is bandwidth-bound.
- KV tiles of ``BLOCK_N = 64`` tokens (4 pages of 16; 64 x 128 x 2 B = 16 KiB per K tile)
  gathered through the block table; ``num_warps = 4`` and ``num_stages = 3`` let the compiler
  pipeline the next tile's gather (cp.async) behind the current tile's math.
- Split-KV (flash-decoding): when ``num_seqs * num_kv_heads`` programs cannot fill the GPU
  (fewer than ~2 per SM), the context is cut into partitions of >= 256 tokens, each program
  writes its partial state (running max ``m``, sum of exponentials ``l``, unnormalised
  ``acc``) in fp32, and a second kernel merges them exactly:
  ``out = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s`` with ``M = max_s m_s``.
  Short contexts with enough sequences skip the split: the partial round trip costs more than
  it saves (vLLM's paged_attention v1/v2 choice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from servesim.kernels.util import cdiv, interpreting, next_pow2

BLOCK_N = 64  # KV tokens per tile
MIN_PARTITION = 256  # smallest split-KV partition (tokens)
NUM_WARPS = 4
NUM_STAGES = 3
LOG2E = 1.4426950408889634


@triton.jit
def load_paged_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, pos, pmask, kvh, d, dmask,
                       stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                       PAGE: tl.constexpr):
    """Gather K (transposed, [HEAD_DIM_PAD, BLOCK_N]) and V ([BLOCK_N, HEAD_DIM_PAD]) for token
    positions ``pos`` of one sequence through its block table row (vLLM's paged layout:
    physical row = block_table[pos // PAGE], slot pos % PAGE). Shared by decode and prefill."""
    page = tl.load(bt_row + pos // PAGE, mask=pmask, other=0).to(tl.int64)
    slot = pos % PAGE
    kt = tl.load(k_cache_ptr + page[None, :] * stride_kb + slot[None, :] * stride_kt
                 + kvh * stride_kh + d[:, None],
                 mask=dmask[:, None] & pmask[None, :], other=0.0)
    v = tl.load(v_cache_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vt
                + kvh * stride_vh + d[None, :],
                mask=pmask[:, None] & dmask[None, :], other=0.0)
    return kt, v


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    qk_scale, k_scale, v_scale,
    num_kv_heads, group, partition_size, num_splits,
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts,
    stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Grid ``(num_seqs, num_kv_heads, num_splits)``. ``qk_scale`` = softmax scale * log2(e)."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition_size
    end = tl.minimum(start + partition_size, seq_len)

    g = tl.arange(0, GROUP_PAD)
    heads = kvh * group + g
    hmask = g < group
    d = tl.arange(0, HEAD_DIM_PAD)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq * stride_bts
    for t0 in range(start, end, BLOCK_N):
        tok = t0 + offs_n
        tmask = tok < end
        kt, v = load_paged_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, tok, tmask, kvh, d, dmask,
                                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                   stride_vh, PAGE)
        if KV_FP8:
            kt = (kt.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt) * qk_scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if SPLIT:
        row = (seq * num_kv_heads * group + heads) * num_splits + split
        tl.store(part_m_ptr + row, m_i, mask=hmask)
        tl.store(part_l_ptr + row, l_i, mask=hmask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=hmask[:, None] & dmask[None, :])
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])


@triton.jit
def _split_kv_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr,
    num_heads, num_splits, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Grid ``(num_seqs, num_heads)``: exact merge of the split-KV partial states."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_PAD)
    smask = sp < num_splits
    d = tl.arange(0, HEAD_DIM_PAD)
    dmask = d < HEAD_DIM
    row = (seq * num_heads + h) * num_splits + sp
    m = tl.load(part_m_ptr + row, mask=smask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + row, mask=smask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :],
                  mask=smask[:, None] & dmask[None, :], other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)  # empty partitions weigh 0
    denom = tl.sum(w * l_s, 0)
    num = tl.sum(w[:, None] * acc, 0)
    out = num / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + seq * stride_os + h * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=dmask)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int,
                      sm_count: int = 132) -> int:
    """Split-KV partitions per sequence (1 = no split).

    Aim for >= 2 programs per SM; never cut partitions below ``MIN_PARTITION`` tokens.
    Examples (H100, 132 SMs): batch 16 x 8 KV heads at 4k -> 3 splits; batch 1 x 8 KV heads
    at 32k -> 33 splits (~1k tokens each); batch 64 x 8 at 4k -> 1 (512 programs already).
    """
    programs = max(1, num_seqs * num_kv_heads)
    want = cdiv(2 * sm_count, programs)
    cap = max(1, max_seq_len // MIN_PARTITION)
    return max(1, min(want, cap))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode attention over a paged KV cache; returns ``[num_seqs, num_heads, head_dim]``.

    ``num_splits``: None picks :func:`choose_num_splits`; 1 disables split-KV.
    ``max_seq_len``: pass it to avoid a device->host sync on ``seq_lens.max()``.
    fp8 (``torch.float8_e4m3fn``) caches are dequantised with ``k_scale``/``v_scale``.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, page, num_kv_heads, hd_k = k_cache.shape
    if hd_k != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} vs k_cache {tuple(k_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if num_seqs else 0
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, _sm_count(q.device))
    num_splits = max(1, min(num_splits, cdiv(max(max_seq_len, 1), BLOCK_N)))
    partition = cdiv(cdiv(max(max_seq_len, 1), num_splits), BLOCK_N) * BLOCK_N
    num_splits = cdiv(max(max_seq_len, 1), partition)
    split = num_splits > 1

    out = torch.empty_like(q)
    if split:
        part_m = torch.empty(num_seqs * num_heads * num_splits, device=q.device,
                             dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_seqs * num_heads * num_splits * head_dim, device=q.device,
                               dtype=torch.float32)
    else:
        part_m = part_l = part_acc = out  # unused
    kv_fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    hd_pad = max(16, next_pow2(head_dim))
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, part_m, part_l, part_acc,
        scale * LOG2E, k_scale, v_scale,
        num_kv_heads, group, partition, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=hd_pad, GROUP_PAD=max(16, next_pow2(group)),
        PAGE=page, BLOCK_N=BLOCK_N, SPLIT=split, UPCAST=interpreting(), KV_FP8=kv_fp8,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if split:
        _split_kv_reduce_kernel[(num_seqs, num_heads)](
            part_m, part_l, part_acc, out,
            num_heads, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=hd_pad, SPLITS_PAD=max(2, next_pow2(num_splits)),
            num_warps=4,
        )
    return out
