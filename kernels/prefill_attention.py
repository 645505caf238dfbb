"""Chunked-prefill (varlen) attention over a paged KV cache in Triton — vLLM V1's mixed batch.

Inputs:

- ``q``             ``[total_q, num_heads, head_dim]``: the batch's query chunks, concatenated
- ``cu_seqlens_q``  ``[num_seqs + 1]`` int32: chunk ``i`` owns rows ``cu[i]:cu[i+1]``
- ``seq_lens``      ``[num_seqs]`` int32: context + chunk length (the chunk's own K/V are
  already in the cache, written through ``slot_mapping`` before attention as V1 does)
- ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``,
  ``block_tables`` ``[num_seqs, max_blocks]``
- output ``[total_q, num_heads, head_dim]``

Row ``j`` of chunk ``i`` sits at absolute position ``context_i + j`` and attends to cache
positions ``0 .. context_i + j``: the whole cached prefix plus the chunk causally. A decode
token is a chunk of length 1, so a mixed batch is one launch.

Design (compute-bound; target: most of the tensor-core peak at chunk >= 512):

- One program per (query tile, KV head). A query tile packs ``BLOCK_Q`` tokens x the
  ``group = num_heads // num_kv_heads`` query heads of one KV head into ``BLOCK_M = 128`` MMA
  rows (vLLM's unified-attention packing), so each K/V tile read from the cache serves
  ``BLOCK_M`` rows: arithmetic intensity ~``BLOCK_M`` FLOP/byte, well above the ridge.
- KV tiles of ``BLOCK_N = 64`` tokens gathered through the block table; ``num_warps = 8``,
  ``num_stages = 3`` (128x64 fp32 scores + 128x128 fp32 acc fit in registers at 8 warps).
- Causality is a loop bound: a tile stops at ``context + last row of the tile``, so tiles above
  the diagonal are never loaded (~half the work of bidirectional attention for the chunk part);
  only the diagonal tiles apply the mask.
- Query tiles are mapped to sequences on the device (cumsum + searchsorted, no host sync); the
  grid is the upper bound ``total_q // BLOCK_Q + num_seqs`` and spare programs exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from servesim.kernels.paged_attention import load_paged_kv_tile
from servesim.kernels.util import interpreting, next_pow2

BLOCK_M = 128  # MMA rows per program (tokens x heads of one KV head)
BLOCK_N = 64  # KV tokens per tile
NUM_WARPS = 8
NUM_STAGES = 3
LOG2E = 1.4426950408889634


@triton.jit
def _chunked_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    tile_seq_ptr, tile_idx_ptr, out_ptr,
    qk_scale, group,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    """Grid ``(num_tiles_upper, num_kv_heads)``; ``qk_scale`` = softmax scale * log2(e)."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    if seq < 0:
        return
    qblk = tl.load(tile_idx_ptr + tile)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    r = tl.arange(0, BLOCK_M)
    tok = qblk * BLOCK_Q + r // GROUP_PAD  # chunk-local token index
    g = r % GROUP_PAD
    rmask = (tok < q_len) & (g < group)
    head = kvh * group + g
    q_pos = context + tok  # absolute position
    d = tl.arange(0, HEAD_DIM_PAD)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
                + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # causal loop bound: last valid row of this tile
    kv_end = tl.minimum(seq_len, context + tl.minimum((qblk + 1) * BLOCK_Q, q_len))
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq * stride_bts
    for t0 in range(0, kv_end, BLOCK_N):
        kpos = t0 + offs_n
        kmask = kpos < kv_end
        kt, v = load_paged_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, kpos, kmask, kvh, d,
                                   dmask, stride_kb, stride_kt, stride_kh, stride_vb,
                                   stride_vt, stride_vh, PAGE)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt) * qk_scale
        s = tl.where(kmask[None, :] & (kpos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # rows with nothing visible yet (padding rows) keep m = -inf: avoid inf - inf
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
             + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


def tile_map(cu_seqlens_q: torch.Tensor, total_q: int, block_q: int):
    """Query-tile -> (sequence, tile index within the chunk), on the device, no host sync.

    Returns two int32 tensors of length ``total_q // block_q + num_seqs`` (an upper bound on
    ``sum_i ceil(n_i / block_q)``); unused entries have sequence ``-1``.
    """
    num_seqs = cu_seqlens_q.numel() - 1
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    n_tiles = (q_lens + block_q - 1) // block_q
    ends = torch.cumsum(n_tiles, 0)
    upper = total_q // block_q + num_seqs
    idx = torch.arange(upper, device=cu_seqlens_q.device)
    seq = torch.searchsorted(ends, idx, right=True)
    valid = seq < num_seqs
    seq_c = seq.clamp(max=max(num_seqs - 1, 0))
    tile_in_seq = idx - (ends[seq_c] - n_tiles[seq_c])
    seq = torch.where(valid, seq, torch.full_like(seq, -1))
    return seq.to(torch.int32), tile_in_seq.to(torch.int32)


def chunked_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    block_m: int = BLOCK_M,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Varlen chunked-prefill attention over paged KV; returns ``[total_q, num_heads, head_dim]``.

    ``block_m``: MMA rows per program (tokens x query heads per KV head), >= 16.
    ``tiles``: precomputed :func:`tile_map` (for benchmarks; computed here otherwise).
    """
    total_q, num_heads, head_dim = q.shape
    _, page, num_kv_heads, hd_k = k_cache.shape
    if hd_k != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} vs k_cache {tuple(k_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    group = num_heads // num_kv_heads
    group_pad = next_pow2(group)
    block_q = prefill_block_q(num_heads, num_kv_heads, block_m)
    scale = head_dim ** -0.5 if scale is None else scale
    tile_seq, tile_idx = tiles if tiles is not None else tile_map(cu_seqlens_q, total_q, block_q)
    out = torch.empty_like(q)
    if total_q == 0:
        return out
    _chunked_prefill_kernel[(tile_seq.numel(), num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, tile_seq, tile_idx, out,
        scale * LOG2E, group,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, next_pow2(head_dim)),
        GROUP_PAD=group_pad, BLOCK_Q=block_q, PAGE=page, BLOCK_N=BLOCK_N,
        UPCAST=interpreting(), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out


def prefill_block_q(num_heads: int, num_kv_heads: int, block_m: int = BLOCK_M) -> int:
    """Query tokens per tile used by :func:`chunked_prefill_attention` (for :func:`tile_map`)."""
    group_pad = next_pow2(num_heads // num_kv_heads)
    return max(16 // group_pad, max(1, next_pow2(block_m) // group_pad))
