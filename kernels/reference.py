"""Plain torch references for the Triton kernels (fp32 math, slow, obviously correct).

Shapes follow the kernels: ``q`` per token ``[*, num_heads, head_dim]``; paged caches
``[num_blocks, block_size, num_kv_heads, head_dim]``; block tables ``[num_seqs, max_blocks]``.
"""

from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Contiguous ``[seq_len, num_kv_heads, head_dim]`` of one sequence from a paged cache."""
    page = cache.shape[1]
    n_blocks = -(-seq_len // page)
    blocks = cache[block_table[:n_blocks].long()]  # [n_blocks, page, kvh, d]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            q_pos: torch.Tensor) -> torch.Tensor:
    """q ``[n, H, D]`` at absolute positions ``q_pos`` attends causally to k/v ``[L, KVH, D]``."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None].cpu()
    s = s.masked_fill(~mask.to(s.device)[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hnl,lhd->nhd", p, v)


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None,
                               k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Reference decode: ``q [num_seqs, H, D]`` -> ``[num_seqs, H, D]`` in ``q.dtype``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros_like(q, dtype=torch.float32)
    for s, L in enumerate(seq_lens.tolist()):
        if L == 0:
            continue
        k = gather_kv(k_cache, block_tables[s], L).float() * k_scale
        v = gather_kv(v_cache, block_tables[s], L).float() * v_scale
        out[s] = _attend(q[s:s + 1], k, v, scale, torch.tensor([L - 1]))[0]
    return out.to(q.dtype)


def chunked_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *,
                                  scale=None) -> torch.Tensor:
    """Reference varlen chunked prefill over paged KV.

    ``q [total_q, H, D]``; sequence ``i`` owns rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``
    (its chunk of ``n_i`` tokens). ``seq_lens[i]`` = context + chunk: the chunk's own K/V are
    already in the cache (V1 writes them via slot_mapping before attention), at positions
    ``context .. seq_len-1``; row ``j`` of the chunk attends to positions ``<= context + j``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros_like(q, dtype=torch.float32)
    cu = cu_seqlens_q.tolist()
    for i, L in enumerate(seq_lens.tolist()):
        a, b = cu[i], cu[i + 1]
        if b == a:
            continue
        ctx = L - (b - a)
        k = gather_kv(k_cache, block_tables[i], L)
        v = gather_kv(v_cache, block_tables[i], L)
        out[a:b] = _attend(q[a:b], k, v, scale, ctx + torch.arange(b - a))
    return out.to(q.dtype)


def matmul_ref(a: torch.Tensor, b: torch.Tensor, *, alpha: float = 1.0,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``alpha * a[M,K] @ b[K,N]`` in fp32, cast to ``out_dtype`` (default ``a.dtype``)."""
    out_dtype = out_dtype or a.dtype
    return (alpha * (a.float() @ b.float())).to(out_dtype)
