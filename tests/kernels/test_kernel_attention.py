"""Paged decode and chunked-prefill attention vs the torch reference (Triton interpreter)."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[kernels]')")
pytest.importorskip("triton", reason="triton is not importable; kernel tests need it (CPU "
                    "interpreter via TRITON_INTERPRET=1)")

from servesim.kernels.paged_attention import (
    choose_num_splits,
    paged_decode_attention,
)
from servesim.kernels.prefill_attention import (
    chunked_prefill_attention,
    prefill_block_q,
    tile_map,
)
from servesim.kernels.reference import (
    chunked_prefill_attention_ref,
    gather_kv,
    paged_decode_attention_ref,
)

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}
PAGE = 16


def _paged_cache(seq_lens, num_kv_heads, head_dim, dtype, seed=0, spare_blocks=3):
    """Random K/V caches and a shuffled (non-contiguous) block table covering ``seq_lens``."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // PAGE) for n in seq_lens]
    max_blocks = max(per_seq) + 1
    num_blocks = sum(per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, PAGE, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    return k, v, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_matches_reference(dtype, num_heads, num_kv_heads, num_splits):
    seq_lens = [1, 17, 150, 64, 33]  # partial last blocks, one exact multiple, a single token
    head_dim = 32
    k, v, table = _paged_cache(seq_lens, num_kv_heads, head_dim, dtype)
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_decode_attention(q, k, v, table, lens, num_splits=num_splits)
    ref = paged_decode_attention_ref(q, k, v, table, lens)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_split_kv_many_partitions_and_empty_ones():
    """Mixed lengths: the short sequences see empty partitions (weight 0 in the merge)."""
    seq_lens = [300, 5, 129]
    k, v, table = _paged_cache(seq_lens, 2, 16, torch.float32, seed=1)
    q = torch.randn(3, 4, 16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ref = paged_decode_attention_ref(q, k, v, table, lens)
    for splits in (2, 5):
        out = paged_decode_attention(q, k, v, table, lens, num_splits=splits, max_seq_len=300)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_decode_strided_query_odd_head_dim_and_zero_length():
    """q as a view into a fused qkv buffer; head_dim 24 (padded to 32); a 0-length sequence."""
    seq_lens = [0, 40]
    k, v, table = _paged_cache(seq_lens, 1, 24, torch.float32, seed=2)
    qkv = torch.randn(2, 6, 24)
    q = qkv[:, :4]  # non-contiguous over heads
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_decode_attention(q, k, v, table, lens, num_splits=2)
    ref = paged_decode_attention_ref(q, k, v, table, lens)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert torch.all(out[0] == 0)


def test_decode_fp8_kv_cache():
    seq_lens = [70, 9]
    k, v, table = _paged_cache(seq_lens, 2, 16, torch.float32, seed=3)
    k8, v8 = (k / 2).to(torch.float8_e4m3fn), (v / 4).to(torch.float8_e4m3fn)
    q = torch.randn(2, 8, 16).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = paged_decode_attention(q, k8, v8, table, lens, k_scale=2.0, v_scale=4.0, num_splits=1)
    ref = paged_decode_attention_ref(q, k8, v8, table, lens, k_scale=2.0, v_scale=4.0)
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=5e-2)


def test_choose_num_splits():
    assert choose_num_splits(64, 8, 4096, sm_count=132) == 1  # 512 programs fill the GPU
    assert choose_num_splits(16, 8, 4096, sm_count=132) == 3
    assert choose_num_splits(1, 8, 32768, sm_count=132) == 33
    assert choose_num_splits(1, 1, 200, sm_count=132) == 1  # too short to split


def _chunk_batch(q_lens, contexts, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    seq_lens = [a + b for a, b in zip(q_lens, contexts, strict=True)]
    k, v, table = _paged_cache(seq_lens, num_kv_heads, head_dim, dtype, seed=seed)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    q = torch.randn(int(cu[-1]), num_heads, head_dim).to(dtype)
    return q, k, v, table, cu, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("with_context", [False, True])
def test_chunked_prefill_matches_reference(dtype, num_heads, num_kv_heads, with_context):
    q_lens = [5, 1, 37, 16]
    contexts = [0, 40, 23, 100] if with_context else [0, 0, 0, 0]
    q, k, v, table, cu, lens = _chunk_batch(q_lens, contexts, num_heads, num_kv_heads, 32, dtype)
    out = chunked_prefill_attention(q, k, v, table, cu, lens, block_m=32)
    ref = chunked_prefill_attention_ref(q, k, v, table, cu, lens)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_chunked_prefill_decode_rows_equal_decode_kernel():
    """A chunk of length 1 is a decode token: both kernels agree."""
    q_lens, contexts = [1, 1, 1], [9, 63, 130]
    q, k, v, table, cu, lens = _chunk_batch(q_lens, contexts, 8, 2, 16, torch.float32, seed=4)
    a = chunked_prefill_attention(q, k, v, table, cu, lens, block_m=16)
    b = paged_decode_attention(q, k, v, table, lens, num_splits=2)
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_chunked_prefill_default_tile_and_empty_chunk():
    q_lens, contexts = [20, 0, 3], [7, 12, 0]
    q, k, v, table, cu, lens = _chunk_batch(q_lens, contexts, 2, 1, 16, torch.float32, seed=5)
    out = chunked_prefill_attention(q, k, v, table, cu, lens)  # BLOCK_M = 128
    ref = chunked_prefill_attention_ref(q, k, v, table, cu, lens)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_tile_map():
    cu = torch.tensor([0, 5, 5, 38], dtype=torch.int32)  # chunks of 5, 0, 33 tokens
    seq, idx = tile_map(cu, 38, 16)
    valid = seq >= 0
    assert seq[valid].tolist() == [0, 2, 2, 2]
    assert idx[valid].tolist() == [0, 0, 1, 2]
    assert prefill_block_q(32, 8) == 32 and prefill_block_q(8, 8, 16) == 16


def test_gather_kv_follows_block_table():
    cache = torch.arange(4 * PAGE, dtype=torch.float32).reshape(4, PAGE, 1, 1)
    out = gather_kv(cache, torch.tensor([2, 0]), 20)
    assert out.flatten().tolist() == list(range(32, 48)) + [0, 1, 2, 3]
