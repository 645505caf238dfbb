"""`simulate calibrate`'s vendor paths when vLLM is installed: vLLM's own
``flash_attn_varlen_func`` called as its FlashAttention backend calls it, checked against the
Triton kernel's output before it is timed, and taken as the row's time (what vLLM runs).

vLLM is not installed here: a stand-in with vLLM 0.22.1's exact signature
(``vllm/vllm_flash_attn/flash_attn_interface.py``) computes attention from its arguments with
the fp32 references, so a call that passes the wrong layout, lengths, block table or causal
alignment gives a different output and is caught. The harness runs on the CPU (Triton
interpreter, wall clock; times are meaningless)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from servesim.kernels import bench as B
from servesim.kernels import calibrate as C
from servesim.kernels.reference import chunked_prefill_attention_ref

SETTINGS = C.BenchSettings(0.0, 0.0, 1, 1)
CALLS: list[dict] = []


def flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None,
                           seqused_k=None, q_v=None, dropout_p=0.0, softmax_scale=None,
                           causal=False, window_size=None, softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None,
                           return_softmax_lse=False, out=None, scheduler_metadata=None,
                           q_descale=None, k_descale=None, v_descale=None, num_splits=0,
                           fa_version=2, s_aux=None, cp_world_size=1, cp_rank=0,
                           cp_tot_seqused_k=None, *, _top_left=False, _drop=0):
    """vLLM's paged varlen FlashAttention, by definition: sequence i's queries
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` attend to the first ``seqused_k[i]`` keys of its
    blocks, causal aligned bottom-right. Wrong kernels for the tests: ``_top_left`` (FA1's
    alignment) and ``_drop`` (the first ``_drop`` keys of every sequence left out)."""
    CALLS.append({"max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k,
                  "causal": causal, "fa_version": fa_version})
    assert causal and block_table is not None and seqused_k is not None
    lens = seqused_k
    if _top_left:  # as if each sequence's keys ended with its queries
        lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    out = chunked_prefill_attention_ref(q, k, v, block_table, cu_seqlens_q, lens)
    if _drop:  # attention over keys _drop.. only: the same as shifting each block table
        b = _drop // k.shape[1]
        out = chunked_prefill_attention_ref(q, k, v, block_table[:, b:], cu_seqlens_q,
                                            lens - _drop)
    return out


@pytest.fixture
def vllm(monkeypatch):
    torch.manual_seed(0)  # (the harness draws its inputs from torch's global generator)
    monkeypatch.setattr(B, "DEVICE", "cpu")
    monkeypatch.setattr(B, "vllm_flash_attn", lambda: (flash_attn_varlen_func, 3))
    CALLS.clear()


def test_decode_times_vllms_kernel_on_mixed_lengths_too(vllm):
    """Uniform and mixed decode batches (SDPA's stand-in takes only uniform ones): one checked
    call, then the timed ones; the row's time is vLLM's even where Triton was faster."""
    for shape in (C.DecodeShape(3, 40, 40, 4, 2, 16, "bfloat16", "bfloat16"),
                  C.DecodeShape(3, 30, 57, 4, 1, 16, "bfloat16", "bfloat16", (7, 26, 57))):
        CALLS.clear()
        r = B.time_decode(shape, 16, SETTINGS)
        assert r["vendor_impl"] == "vllm flash_attn_varlen_func (FA3, paged)"
        assert r["vllm_rel_err"] < 0.03 and r["vendor_s"] > 0
        assert CALLS[0] == {"max_seqlen_q": 1, "max_seqlen_k": max(shape.lengths or [40]),
                            "causal": True, "fa_version": 3}
        assert len(CALLS) >= 2  # the check, then the timed calls
        faster_triton = dict(r, triton_s=r["vendor_s"] / 2)
        assert C._timed(faster_triton) == {"seconds": r["vendor_s"],
                                           "kernel": r["vendor_impl"]}


def test_prefill_after_cached_tokens_checks_the_causal_alignment(vllm, monkeypatch):
    """A chunk of 20 after 10 cached tokens: vLLM's bottom-right alignment matches the Triton
    kernel; a kernel aligned top-left does not, so the row records why and falls back to SDPA
    on contiguous K/V (the faster of it and Triton)."""
    shape = C.PrefillShape(2, 20, 10, 4, 2, 16, "bfloat16")
    r = B.time_prefill(shape, 16, SETTINGS)
    assert r["vendor_impl"] == "vllm flash_attn_varlen_func (FA3, paged)"
    assert CALLS[0]["max_seqlen_q"] == 20 and CALLS[0]["max_seqlen_k"] == 30
    assert r["vllm_rel_err"] < 0.03

    def top_left(*a, **kw):
        return flash_attn_varlen_func(*a, **kw, _top_left=True)
    monkeypatch.setattr(B, "vllm_flash_attn", lambda: (top_left, 3))
    r = B.time_prefill(shape, 16, SETTINGS)
    assert r["vllm_error"].startswith("prefill: output differs from the Triton kernel's by ")
    assert float(r["vllm_error"].split(" by ")[1].split()[0]) > 0.5
    assert r["vendor_impl"].startswith("sdpa(contiguous kv, causal lower-right")
    assert C._timed(r)["seconds"] == min(r["triton_s"], r["vendor_s"])


def test_a_kernel_missing_one_block_of_a_long_context_is_caught(vllm, monkeypatch):
    """Decode over 1,024 tokens with the first 16-token block left out moves an output by
    about half its row's RMS, though by little in absolute terms:
    outputs shrink with context, so the check is relative; the correct kernel stays within
    bf16 rounding (0.019)."""
    shape = C.DecodeShape(4, 1024, 1024, 4, 2, 16, "bfloat16", "bfloat16")
    r = B.time_decode(shape, 16, SETTINGS)
    assert r["vllm_rel_err"] < B.VLLM_MAX_REL_ERR / 3

    def drop(*a, **kw):
        return flash_attn_varlen_func(*a, **kw, _drop=16)
    monkeypatch.setattr(B, "vllm_flash_attn", lambda: (drop, 3))
    r = B.time_decode(shape, 16, SETTINGS)
    err = float(r["vllm_error"].split(" by ")[1].split()[0])
    assert err > 3 * B.VLLM_MAX_REL_ERR  # (0.49 with this seed)
    assert r["vendor_impl"] == "sdpa(contiguous kv, enable_gqa)"


def test_inputs_vllm_does_not_take_keep_the_stand_ins(vllm):
    """fp32 (vLLM's FlashAttention takes fp16/bf16) and an fp8 cache (its scales are not set
    up here): no vLLM call, the SDPA / Triton stand-ins as before."""
    r = B.time_prefill(C.PrefillShape(1, 8, 0, 4, 2, 16, "float32"), 16, SETTINGS)
    assert not CALLS and r["vendor_impl"].startswith("sdpa(") and "vllm_error" not in r
    r = B.time_decode(C.DecodeShape(2, 40, 40, 4, 2, 16, "bfloat16", "float8_e4m3fn"), 16,
                      SETTINGS)
    assert not CALLS and r["vendor_s"] is None and C._timed(r)["kernel"] == "triton"


def test_the_probe_takes_vllms_pick_and_leaves_blackwell_to_flashinfer(monkeypatch):
    """``vllm_flash_attn`` imports vLLM's ``fa_utils`` (a stand-in module here) and takes the
    FA version vLLM picks; none when vLLM picks none, fails to import, or on compute capability
    10.x, where vLLM's default backend is FlashInfer; none off CUDA."""
    import sys
    import types

    version = {"v": 3}

    def get_flash_attn_version():
        if version["v"] == "raise":
            raise RuntimeError("no CUDA platform")
        return version["v"]
    fa = types.ModuleType("vllm.v1.attention.backends.fa_utils")
    fa.flash_attn_varlen_func, fa.get_flash_attn_version = (flash_attn_varlen_func,
                                                            get_flash_attn_version)
    names = ["vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"]
    for n in names:
        monkeypatch.setitem(sys.modules, n, types.ModuleType(n))
    monkeypatch.setitem(sys.modules, fa.__name__, fa)
    cap = {"c": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap["c"])
    monkeypatch.setattr(B, "DEVICE", "cuda")

    def probe():
        B.vllm_flash_attn.cache_clear()
        return B.vllm_flash_attn()
    try:
        assert probe() == (flash_attn_varlen_func, 3)
        cap["c"] = (8, 0)
        version["v"] = 2
        assert probe() == (flash_attn_varlen_func, 2)
        cap["c"] = (10, 0)  # B200: vLLM runs FlashInfer
        assert probe() is None
        cap["c"] = (12, 0)  # RTX Pro 6000 (Blackwell, sm_120): FlashAttention first
        assert probe() == (flash_attn_varlen_func, 2)
        version["v"] = None
        assert probe() is None
        version["v"] = "raise"
        assert probe() is None
        monkeypatch.delitem(sys.modules, fa.__name__)
        monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails
        version["v"] = 3
        assert probe() is None
        monkeypatch.setattr(B, "DEVICE", "cpu")
        assert probe() is None
    finally:
        B.vllm_flash_attn.cache_clear()


def test_moe_times_vllms_fused_experts_once_it_matches_the_reference(monkeypatch):
    """With vLLM importable, ``time_moe`` checks ``fused_experts(x, w13, w2, weights, ids)``
    (vLLM 0.22.1's positional order) against the torch reference before timing it; one that
    swaps the gate and up halves of ``w13`` is recorded as ``vllm_error`` and the reference
    is timed; without vLLM, the reference with no error."""
    import sys
    import types

    monkeypatch.setattr(B, "DEVICE", "cpu")
    torch.manual_seed(0)
    calls = []

    def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False,
                      activation=None, apply_router_weight_on_input=False,
                      global_num_experts=-1, expert_map=None, quant_config=None):
        calls.append(topk_ids.dtype)
        return B._torch_moe(hidden_states, w1, w2, topk_ids.long(), topk_weights)

    def swapped(hidden_states, w1, w2, topk_weights, topk_ids):
        i = w1.shape[1] // 2
        return B._torch_moe(hidden_states, torch.cat([w1[:, i:], w1[:, :i]], 1), w2,
                            topk_ids.long(), topk_weights)
    mod = types.ModuleType("vllm.model_executor.layers.fused_moe")
    for n in ("vllm", "vllm.model_executor", "vllm.model_executor.layers"):
        monkeypatch.setitem(sys.modules, n, types.ModuleType(n))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    shape = C.MoeShape(3, 16, 32, 2, 4, 2)
    mod.fused_experts = fused_experts
    r = B.time_moe(shape, SETTINGS)
    assert r["kernel"] == "vllm fused_experts" and r["vllm_rel_err"] == 0.0
    assert calls and calls[0] == torch.int32
    mod.fused_experts = swapped
    r = B.time_moe(shape, SETTINGS)
    assert r["kernel"] == "torch reference (per-expert GEMMs)" and r["seconds"] > 0
    assert r["vllm_error"].startswith("moe: output differs from the torch reference's by ")
    # (0.28 here, where weights of 0.02 keep silu near linear; far more at real sizes)
    assert float(r["vllm_error"].split(" by ")[1].split()[0]) > 2 * B.VLLM_MAX_REL_ERR
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.delitem(sys.modules, mod.__name__)
    r = B.time_moe(shape, SETTINGS)
    assert r["kernel"].startswith("torch reference") and "vllm_error" not in r
