"""CUDA-event microbenchmarks of the Triton kernels and the vendor path (GPU only).

``bench`` is a bounded version of ``triton.testing.do_bench``: warm-up by time, then
``clamp(rep_s / t, min_reps, max_reps)`` repeats, each preceded by an L2 flush (a 256 MiB
memset, larger than any current L2) and timed with its own pair of CUDA events; it returns
the median in seconds. Bounding the repeats keeps tiny kernels from spending seconds on
flushes (do_bench would run thousands of flushed repeats of a 5 us kernel).

Attention's vendor path is vLLM's own FlashAttention kernel (``flash_attn_varlen_func`` over
the paged cache, the FA version vLLM picks: 3 on Hopper, 2 on Ampere) when vLLM is installed,
what vLLM's FlashAttention backend runs; else SDPA on contiguous K/V.
"""

from __future__ import annotations

import functools
import math
import statistics
import time

import torch
from servesim.kernels.calibration_estimate import BENCH_TUNE, FLUSH_BYTES, BenchSettings
from servesim.kernels.calibration_plan import DecodeShape, PrefillShape

DEVICE = "cuda"  # tests set "cpu" to run the harness under the Triton interpreter
_flush_buf: torch.Tensor | None = None


def _flush() -> None:
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=DEVICE)
    _flush_buf.zero_()


def release() -> None:
    """Free cached blocks (after an OOM)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def bench_times(fn, s: BenchSettings, flush: bool = True) -> list[float]:
    """Per-repeat seconds of ``fn()`` (see module docstring)."""
    if DEVICE != "cuda":
        return _cpu_times(fn, s)
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    fn()
    fn()
    e1.record()
    torch.cuda.synchronize()
    t = max(e0.elapsed_time(e1) / 2e3, 1e-6)
    if s.warmup_s:
        for _ in range(min(50, max(1, math.ceil(s.warmup_s / t)))):
            fn()
    n = min(s.max_reps, max(s.min_reps, math.ceil(s.rep_s / t)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for a, b in zip(starts, ends, strict=True):
        if flush:
            _flush()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in zip(starts, ends, strict=True)]


def _cpu_times(fn, s: BenchSettings) -> list[float]:
    """Wall-clock fallback (CPU tests of the harness; not calibration data)."""
    fn()
    out = []
    for _ in range(s.min_reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench(fn, s: BenchSettings, flush: bool = True) -> float:
    """Median seconds of ``fn()``."""
    return statistics.median(bench_times(fn, s, flush))


def tune_bench(fn, quantiles=None):
    """``do_bench`` replacement for ``triton.autotune``: milliseconds, short and bounded."""
    ts = sorted(x * 1e3 for x in bench_times(fn, BENCH_TUNE))
    if quantiles is None:
        return statistics.median(ts)
    return [ts[min(len(ts) - 1, int(q * len(ts)))] for q in quantiles]


_DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
       "float8_e4m3fn": torch.float8_e4m3fn}


def time_memcpy(nbytes: int, s: BenchSettings) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src), s)


_weights: dict = {}


def _weight(n: int, k: int, dt: torch.dtype) -> torch.Tensor:
    """Random ``[n, k]`` weight, reused across the M sweep of one (n, k, dtype)."""
    key = (n, k, dt)
    if key not in _weights:
        _weights.clear()
        _weights[key] = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16).to(dt)
    return _weights[key]


def time_gemm(m: int, n: int, k: int, dtype: str, s: BenchSettings) -> dict:
    """``{triton_s, vendor_s, vendor_impl}`` for ``x[m,k] @ W[n,k]^T``."""
    from servesim.kernels.gemm import matmul

    dt = _DT[dtype]
    a = torch.randn(m, k, device=DEVICE).to(dt)
    w = _weight(n, k, dt)
    b = w.t()
    if dt == torch.float8_e4m3fn:
        one = torch.ones((), device=DEVICE)
        triton_s = bench(lambda: matmul(a, b, alpha=1.0, out_dtype=torch.bfloat16), s)
        try:
            vendor = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
            vendor()
            vendor_s, impl = bench(vendor, s), "torch._scaled_mm"
        except (RuntimeError, ValueError):  # cuBLASLt fp8 needs dims % 16 == 0
            vendor_s, impl = None, None
    else:
        triton_s = bench(lambda: matmul(a, b), s)
        vendor_s, impl = bench(lambda: torch.matmul(a, b), s), "torch.matmul"
    return {"triton_s": triton_s, "vendor_s": vendor_s, "vendor_impl": impl}


def _paged(lengths: list[int], num_kv_heads: int, head_dim: int, block_size: int,
           dtype: torch.dtype):
    """Random paged K/V caches with a shuffled block table covering ``lengths``."""
    per = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16).to(dtype)
    v = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16).to(dtype)
    perm = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int32)
    table = torch.zeros(len(lengths), max(per), dtype=torch.int32, device=DEVICE)
    used = 0
    for i, nb in enumerate(per):
        table[i, :nb] = perm[used:used + nb]
        used += nb
    return k, v, table


def _sdpa(q, k, v, **kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # never the math backend: it materialises the score matrix (GBs at long context)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.CUDNN_ATTENTION]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)


def _time_sdpa(q, k, v, s: BenchSettings, label: str, **kw):
    """``(seconds, impl)`` of SDPA with native GQA, else with K/V expanded to all heads
    (expansion not timed), else ``(None, None)``."""
    group = q.shape[1] // k.shape[1]
    attempts = [("enable_gqa", k, v, {"enable_gqa": True})] if group > 1 else []
    attempts.append(("", k, v, {}) if group == 1 else
                    ("expanded kv", None, None, {}))
    for tag, kk, vv, extra in attempts:
        try:
            if kk is None:
                kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            fn = lambda kk=kk, vv=vv, extra=extra: _sdpa(q, kk, vv, **kw, **extra)
            fn()
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            return bench(fn, s), f"sdpa({label}{', ' + tag if tag else ''})"
        except (RuntimeError, TypeError, NotImplementedError):
            continue
    return None, None


@functools.cache
def vllm_flash_attn() -> tuple | None:
    """``(flash_attn_varlen_func, fa_version)`` of vLLM's FlashAttention backend (vLLM
    ``fa_utils``: the version it picks for this GPU) when vLLM is installed and that backend is
    its default here, else None. vLLM's CUDA priority list puts FlashInfer first on compute
    capability 10.x (B200/GB200/B300), FlashAttention first elsewhere."""
    if DEVICE != "cuda" or torch.cuda.get_device_capability()[0] == 10:
        return None
    try:
        from vllm.v1.attention.backends.fa_utils import (
            flash_attn_varlen_func,
            get_flash_attn_version,
        )

        version = get_flash_attn_version()
    except Exception:  # noqa: BLE001 -- no vLLM, or one that cannot run here
        return None
    return None if version is None else (flash_attn_varlen_func, version)


# largest |vLLM output - Triton output| accepted, over the RMS of that output row (one token,
# one head): two correct kernels differ by about one bf16 rounding (2^-8 to 2^-7 of an element,
# an element a few times its row's RMS: 0.013-0.024 measured on the CPU); a call that drops
# keys or aligns the causal mask wrongly moves outputs by a good fraction of their size
# (0.37-0.88 for one 16-token block left out of 1,024). Attention outputs shrink with context,
# so an absolute bound would miss errors at long contexts.
VLLM_MAX_REL_ERR = 0.1


def _rel_err(out: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest ``|out − reference|`` over the RMS of its row of the last dimension (attention:
    one token and head; MoE: one token)."""
    ref = reference.float()
    rms = ref.square().mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
    return float(((out.float() - ref).abs() / rms).max())


def _time_vllm(q, k, v, table, lens, cu_q, max_q: int, max_k: int, reference, s: BenchSettings,
               what: str) -> dict:
    """``{vendor_s, vendor_impl, vllm_rel_err}`` of vLLM's ``flash_attn_varlen_func`` as
    its FlashAttention backend calls it (paged K/V, ``seqused_k``, bottom-right causal; without
    the FA3 scheduler metadata vLLM computes ahead, which the kernel then computes itself),
    once its output matches ``reference`` (servesim's Triton output); else ``{vllm_error}``;
    {} without vLLM or for inputs it does not take (fp32; an fp8 cache, whose scales are not
    set up here)."""
    fa = vllm_flash_attn()
    if fa is None or q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype:
        return {}
    fn, version = fa
    call = lambda: fn(q=q, k=k, v=v, max_seqlen_q=max_q, cu_seqlens_q=cu_q,
                      max_seqlen_k=max_k, seqused_k=lens, causal=True, block_table=table,
                      fa_version=version)
    try:
        err = _rel_err(call(), reference)
    except Exception as e:  # noqa: BLE001 -- an API change: the SDPA stand-in instead
        return {"vllm_error": f"{what}: {e.__class__.__name__}: {str(e).splitlines()[0][:120]}"}
    if not err <= VLLM_MAX_REL_ERR:
        return {"vllm_error": f"{what}: output differs from the Triton kernel's by {err:.3g} "
                              "of its row RMS"}
    return {"vendor_s": bench(call, s), "vllm_rel_err": err,
            "vendor_impl": f"vllm flash_attn_varlen_func (FA{version}, paged)"}


def time_decode(d: DecodeShape, block_size: int, s: BenchSettings) -> dict:
    """Paged Triton decode; vendor = vLLM's FlashAttention when installed (any lengths), else
    SDPA on contiguous (pre-gathered) K/V for uniform batches."""
    from servesim.kernels.paged_attention import paged_decode_attention

    dt, kvdt = _DT[d.dtype], _DT[d.kv_dtype]
    lengths = list(d.lengths) or [d.context] * d.batch
    k, v, table = _paged(lengths, d.num_kv_heads, d.head_dim, block_size, kvdt)
    q = torch.randn(d.batch, d.num_heads, d.head_dim, device=DEVICE, dtype=dt)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    maxlen = max(lengths)
    triton = lambda: paged_decode_attention(q, k, v, table, lens, max_seq_len=maxlen)
    triton_s = bench(triton, s)
    cu_q = torch.arange(d.batch + 1, dtype=torch.int32, device=DEVICE)
    got = _time_vllm(q, k, v, table, lens, cu_q, 1, maxlen, triton(), s, "decode")
    if "vendor_s" in got:
        return {"triton_s": triton_s, **got, "num_splits": _splits(d, maxlen)}
    vendor_s = impl = None
    if not d.lengths and kvdt == dt:
        k = v = None  # free the paged caches before the vendor copy
        kc = torch.randn(d.batch, d.num_kv_heads, d.context, d.head_dim, device=DEVICE, dtype=dt)
        vc = torch.randn_like(kc)
        vendor_s, impl = _time_sdpa(q.unsqueeze(2), kc, vc, s, "contiguous kv")
    return {"triton_s": triton_s, "vendor_s": vendor_s, "vendor_impl": impl,
            "num_splits": _splits(d, maxlen), **got}


def _splits(d: DecodeShape, maxlen: int) -> int:
    from servesim.kernels.paged_attention import choose_num_splits

    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 132
    return choose_num_splits(d.batch, d.num_kv_heads, maxlen, sms)


def time_prefill(f: PrefillShape, block_size: int, s: BenchSettings) -> dict:
    """Paged Triton chunked prefill; vendor = vLLM's FlashAttention when installed, else SDPA
    (causal, bottom-right aligned) on contiguous K/V of ``context + chunk`` tokens per
    sequence."""
    from servesim.kernels.prefill_attention import (
        chunked_prefill_attention,
        prefill_block_q,
        tile_map,
    )

    dt = _DT[f.dtype]
    L = f.context + f.chunk
    k, v, table = _paged([L] * f.batch, f.num_kv_heads, f.head_dim, block_size, dt)
    q = torch.randn(f.batch * f.chunk, f.num_heads, f.head_dim, device=DEVICE, dtype=dt)
    cu = torch.arange(0, f.batch + 1, dtype=torch.int32, device=DEVICE) * f.chunk
    lens = torch.full((f.batch,), L, dtype=torch.int32, device=DEVICE)
    tiles = tile_map(cu, q.shape[0], prefill_block_q(f.num_heads, f.num_kv_heads))
    triton = lambda: chunked_prefill_attention(q, k, v, table, cu, lens, tiles=tiles)
    triton_s = bench(triton, s)
    got = _time_vllm(q, k, v, table, lens, cu, f.chunk, L, triton(), s, "prefill")
    if "vendor_s" in got:
        return {"triton_s": triton_s, **got}
    k = v = None  # free the paged caches before the vendor copy
    kc = torch.randn(f.batch, f.num_kv_heads, L, f.head_dim, device=DEVICE, dtype=dt)
    vc = torch.randn_like(kc)
    q4 = q.view(f.batch, f.chunk, f.num_heads, f.head_dim).transpose(1, 2)
    if f.context == 0:
        kw = {"is_causal": True}
    else:
        from torch.nn.attention.bias import causal_lower_right

        kw = {"attn_mask": causal_lower_right(f.chunk, L)}
    vendor_s, impl = _time_sdpa(q4, kc, vc, s, "contiguous kv, causal lower-right", **kw)
    return {"triton_s": triton_s, "vendor_s": vendor_s, "vendor_impl": impl, **got}


# --------------------------------------------------------------------------- MoE


def _torch_moe(x, w13, w2, topk_ids, topk_w):
    """Reference routed-expert layer: per expert hit, gather its tokens,
    ``silu(x·w1ᵀ) * (x·w3ᵀ)`` then ``·w2ᵀ``, scatter-add weighted by the router."""
    out = torch.zeros_like(x)
    flat = topk_ids.flatten()
    order = torch.argsort(flat)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tok = order // topk_ids.shape[1]
    wts = topk_w.flatten()[order]
    start = 0
    inter = w2.shape[2]
    for e, c in enumerate(counts):
        if not c:
            continue
        idx = tok[start:start + c]
        h = x.index_select(0, idx) @ w13[e].t()
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, idx, (h @ w2[e].t()) * wts[start:start + c, None].to(x.dtype))
        start += c
    return out


def time_moe(m, s: BenchSettings) -> dict:
    """``{seconds, kernel}`` of one fused-MoE layer: vLLM's ``fused_experts`` when vLLM is
    installed (what vLLM runs) and its output matches the torch reference above (else
    ``vllm_error``), otherwise that reference. Balanced routing: token t picks experts
    ``(t·topk + j) mod E``, so every expert gets the same load."""
    dt = _DT[m.dtype]
    i_r = m.inter // m.tp
    x = torch.randn(m.tokens, m.hidden, device=DEVICE, dtype=dt)
    w13 = torch.randn(m.experts, 2 * i_r, m.hidden, device=DEVICE, dtype=dt) * 0.02
    w2 = torch.randn(m.experts, m.hidden, i_r, device=DEVICE, dtype=dt) * 0.02
    ids = (torch.arange(m.tokens * m.topk, device=DEVICE) % m.experts).view(m.tokens, m.topk)
    ids = ids.to(torch.int32)
    wts = torch.full((m.tokens, m.topk), 1.0 / m.topk, device=DEVICE, dtype=torch.float32)
    ids64 = ids.long()
    fn = lambda: _torch_moe(x, w13, w2, ids64, wts)
    out: dict = {"kernel": "torch reference (per-expert GEMMs)"}
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
    except Exception:  # noqa: BLE001 -- no vLLM (or one that cannot load here)
        fused_experts = None
    if fused_experts is not None:
        vllm = lambda: fused_experts(x, w13, w2, wts, ids)
        try:
            err = _rel_err(vllm(), fn())
        except Exception as e:  # noqa: BLE001 -- an API change: the reference instead
            out["vllm_error"] = f"moe: {e.__class__.__name__}: {str(e).splitlines()[0][:120]}"
        else:
            if err <= VLLM_MAX_REL_ERR:
                fn, out = vllm, {"kernel": "vllm fused_experts", "vllm_rel_err": err}
            else:
                out["vllm_error"] = (f"moe: output differs from the torch reference's by "
                                     f"{err:.3g} of its row RMS")
    return {"seconds": bench(fn, s), **out}


# --------------------------------------------------------------------------- all-reduce


def _allreduce_worker(rank: int, tp: int, port: int, sizes: list[int], s: BenchSettings,
                      out) -> None:
    """One TP rank: NCCL all-reduce of bf16 buffers, eager and captured in a CUDA graph;
    rank 0 reports the median seconds per size (every rank launches in lockstep)."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp)
    rows = []
    try:
        for nbytes in sizes:
            buf = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
            for _ in range(5):
                dist.all_reduce(buf)
            torch.cuda.synchronize()
            dist.barrier()
            eager = bench(lambda buf=buf: dist.all_reduce(buf), s, flush=False)
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                dist.all_reduce(buf)  # warm the communicator on the capture stream
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=stream):
                    dist.all_reduce(buf)
            torch.cuda.synchronize()
            dist.barrier()
            graph = bench(g.replay, s, flush=False)
            rows += [("eager", nbytes, eager), ("graph", nbytes, graph)]
            del g, buf
        if rank == 0:
            out.put(rows)
    finally:
        dist.destroy_process_group()


def time_allreduce(tp: int, sizes: list[int], s: BenchSettings) -> list[tuple[str, int, float]]:
    """``[(mode, bytes, seconds)]`` of a ``tp``-GPU NCCL all-reduce (torch.distributed, one
    process per GPU) per message size, eager and CUDA-graph."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_allreduce_worker, args=(tp, port, list(sizes), s, q), nprocs=tp,
                       join=True, start_method="spawn")
    return q.get()
