"""GPU checks beside `simulate calibrate` (needs a CUDA GPU; one JSON file of results).

    python benchmarks/gpu_checks.py -o gpu_checks.json [--sections correctness,graph_gemm,step,...]

Sections (each independent; a failure is recorded and the next one runs):

- ``correctness``: the Triton kernels (GEMM bf16/fp8, paged decode, chunked prefill) on this
  GPU against the fp32 references of ``kernels/reference.py`` (max |error| per case). The test
  suite checks them only under ``TRITON_INTERPRET=1`` on the CPU.
- ``graph_gemm``: GEMMs captured back to back in a CUDA graph and replayed (no host launch
  cost, as vLLM replays decode): bf16 ``torch.matmul``, per-tensor fp8 ``torch._scaled_mm``
  and block-scaled fp8 (1x128 activations, 128x128 weights) ``F.scaled_mm``, for Llama-3.1-8B,
  Llama-3.1-70B (TP 4) and DeepSeek-V3 (TP 8) shapes at 1-4096 rows; weight copies rotate
  so that the weights come from HBM (not for the 'tiny' 384 x 2048 shape: its copies fit L2).
- ``step``: a Llama-3.1-8B-shaped decoder (32 layers of bf16 weights, fused RMSNorm, RoPE,
  GQA attention through SDPA on contiguous K/V, SiLU-and-mul, LM head on the last rows) timed
  per step: uniform decode batches replayed from a CUDA graph, and single-sequence prefills
  run eagerly. Plain PyTorch, not vLLM: it checks the cost model's composition of GEMM and
  attention time, not vLLM's fused kernels or its host work.
- ``compiled_step``: the same decoder with its non-attention parts compiled by
  ``torch.compile`` (inductor: RMSNorm fused with the residual add, RoPE, SiLU-and-mul;
  cuBLAS GEMMs) in two pieces per layer around an eager attention call, as vLLM V1 compiles
  its models (piecewise, attention a custom op between the pieces; GQA attention through SDPA
  with ``enable_gqa``). Decode replayed from one CUDA graph, prefill run eagerly (vLLM runs
  chunks over its largest captured size without a graph). A closer stand-in for vLLM's step
  than ``step``: no vLLM host work, SDPA rather than FA3.
- ``sustained``: a compute-bound GEMM (Llama-3.1-8B gate/up at 8,192 rows) and a memory-bound
  one (the same weight at 1 row) timed in short bursts after idling, then back to back for
  several seconds in 100 ms windows, with the SM clock and power ``nvidia-smi`` reports every
  100 ms; then bursts again after idling 20 ms to 2 s. Microbenchmarks (servesim's and
  aiconfigurator's tables) time bursts; a busy server runs sustained.
- ``duty``: the same two GEMMs interleaved, the compute-bound one taking 20-100% of the GPU's
  time in 20 ms cycles for 3 s after idling: each one's per-call time in the last 1.5 s
  against its burst time (how partial compute load throttles).
- ``mix``: :class:`CompiledDecoder` serving-like: one 2,048-token prefill then ``k`` decode
  steps (64 rows, context 1,024, from a CUDA graph), repeated for 3 s per ``k``; each kind's
  step time in the last 1.5 s against its burst time (the power cap on real steps).
- ``varlen_attention``: FlashAttention-2 through ``torch.nn.attention.varlen.varlen_attn`` (the
  varlen kernel family of vLLM's FlashAttention backend; vLLM runs FA3 on Hopper, which torch
  runs only with ``flash_attn_interface`` installed) for one prefill chunk after 0-16k cached
  tokens and for uniform decode batches, beside SDPA's lower-right-causal path under each
  SDPA backend for the same prefill shapes. It tests the cost model's assumption that a chunk
  after cached tokens runs at the no-prefix per-(query, key)-pair rate. Replayed from a CUDA
  graph where capture works (``graphed``), else eager.

Times are CUDA-event medians in seconds; weights are random (timing does not depend on values).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
LLAMA8B = {"hidden": 4096, "inter": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128,
           "layers": 32, "vocab": 128256}


def bracketed(fn, n: int = 1) -> list[tuple]:
    """``n`` calls of ``fn``, each between its own pair of CUDA events (read by
    :func:`elapsed`)."""
    pairs = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        pairs.append((a, b))
    return pairs


def elapsed(pairs: list[tuple]) -> list[float]:
    """Seconds of each :func:`bracketed` call (waits for the last)."""
    pairs[-1][1].synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in pairs]


def capture(fn, warmups: int = 1) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after ``warmups`` calls on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def cuda_median(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` over ``reps`` CUDA-event-timed calls (no L2 flush)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(elapsed(bracketed(fn, reps)))


# -- correctness ---------------------------------------------------------------------------

def correctness() -> list[dict]:
    from servesim.kernels import bench as B
    from servesim.kernels.gemm import fp8_supported, matmul
    from servesim.kernels.paged_attention import paged_decode_attention
    from servesim.kernels.prefill_attention import chunked_prefill_attention
    from servesim.kernels.reference import (
        chunked_prefill_attention_ref,
        matmul_ref,
        paged_decode_attention_ref,
    )

    out = []
    torch.manual_seed(0)
    for m, n, k in [(1, 4096, 4096), (7, 6144, 4096), (100, 1000, 4096), (512, 14336, 4096),
                    (3000, 4096, 14336)]:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        got, ref = matmul(a, b).float(), matmul_ref(a, b).float()
        out.append({"kernel": "gemm bf16", "shape": [m, n, k],
                    "max_abs_err": (got - ref).abs().max().item(),
                    "ref_max_abs": ref.abs().max().item()})
        if fp8_supported():
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            got = matmul(a8, b8, out_dtype=torch.bfloat16).float()
            ref = matmul_ref(a8, b8, out_dtype=torch.float32)
            out.append({"kernel": "gemm fp8", "shape": [m, n, k],
                        "max_abs_err": (got - ref).abs().max().item(),
                        "ref_max_abs": ref.abs().max().item()})
    for lengths, h, kvh in [([1, 17, 300, 4096], 32, 8), ([2048] * 8, 64, 8), ([5, 513], 28, 4)]:
        k, v, table = B._paged(lengths, kvh, 128, 16, torch.bfloat16)
        q = torch.randn(len(lengths), h, 128, device="cuda", dtype=torch.bfloat16)
        lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        got = paged_decode_attention(q, k, v, table, lens, max_seq_len=max(lengths)).float()
        ref = paged_decode_attention_ref(q, k, v, table, lens).float()
        out.append({"kernel": "paged decode", "shape": [lengths, h, kvh],
                    "max_abs_err": (got - ref).abs().max().item(),
                    "ref_max_abs": ref.abs().max().item()})
    for chunks, ctxs, h, kvh in [([64, 200], [0, 100], 32, 8), ([512], [1024], 64, 8)]:
        lengths = [c + x for c, x in zip(chunks, ctxs, strict=True)]
        k, v, table = B._paged(lengths, kvh, 128, 16, torch.bfloat16)
        q = torch.randn(sum(chunks), h, 128, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
        lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        got = chunked_prefill_attention(q, k, v, table, cu, lens).float()
        ref = chunked_prefill_attention_ref(q, k, v, table, cu, lens).float()
        out.append({"kernel": "chunked prefill", "shape": [chunks, ctxs, h, kvh],
                    "max_abs_err": (got - ref).abs().max().item(),
                    "ref_max_abs": ref.abs().max().item()})
    return out


# -- GEMMs replayed from a CUDA graph ---------------------------------------------------------

def graph_per_call(calls, reps: int = 10) -> float:
    """Median seconds per call of ``calls`` (callables) captured back to back in one CUDA graph
    (no host launch cost: vLLM's decode steps replay graphs)."""
    def all_calls():
        for c in calls:
            c()
    g = capture(all_calls)
    t = cuda_median(g.replay, reps=reps) / len(calls)
    del g
    return t


def _blockwise(a8, w8, m: int, n: int, k: int):
    """DeepSeek-style block fp8: activations 1x128, weights 128x128 (PyTorch's own test
    layout for ``F.scaled_mm``, cuBLASLt >= 12.9 on Hopper)."""
    from torch.nn.functional import ScalingType, SwizzleType

    l4 = -(-(k // 128) // 4) * 4
    sa = torch.rand(k // 128, m, device="cuda").t()
    sb = torch.rand(n // 128, l4, device="cuda").t()
    b = w8.t()
    return lambda: F.scaled_mm(a8, b, [sa], [ScalingType.BlockWise1x128],
                               [sb], [ScalingType.BlockWise128x128],
                               [SwizzleType.NO_SWIZZLE], [SwizzleType.NO_SWIZZLE],
                               None, torch.bfloat16)


GRAPH_SHAPES = {  # (n, k): DeepSeek-V3 per GPU at TP 8, Llama-3.1-70B at TP 4, Llama-3.1-8B
    "dsv3 q_a+kv_a": (2112, 7168), "dsv3 q_b tp8": (3072, 1536), "dsv3 o tp8": (7168, 2048),
    "dsv3 dense gate_up tp8": (4608, 7168), "dsv3 dense down tp8": (7168, 2304),
    "70b qkv tp4": (2560, 8192), "70b gate_up tp4": (14336, 8192), "70b down tp4": (8192, 7168),
    "8b qkv": (6144, 4096), "8b down": (4096, 14336), "tiny": (384, 2048),
}


def graph_gemm() -> list[dict]:
    out = []
    one = torch.ones((), device="cuda")
    x = torch.zeros(1, device="cuda")
    out.append({"name": "empty kernel (x.add_(1) on 1 element)",
                "s": graph_per_call([lambda: x.add_(1)] * 200)})
    for name, (n, k) in GRAPH_SHAPES.items():
        copies = max(2, min(32, -(-(256 << 20) // (n * k))))  # fp8 bytes >= 256 MiB together
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        w8s = [w.to(torch.float8_e4m3fn) for w in ws]
        for m in (1, 8, 64, 512, 4096):
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a8 = a.to(torch.float8_e4m3fn)
            row = {"name": name, "m": m, "n": n, "k": k, "copies": copies}
            for v in ("bf16", "fp8_tensor", "fp8_block"):
                try:
                    if v == "bf16":
                        calls = [lambda a=a, w=w: torch.matmul(a, w.t()) for w in ws]
                    elif v == "fp8_tensor":
                        calls = [lambda a8=a8, w=w: torch._scaled_mm(
                            a8, w.t(), one, one, out_dtype=torch.bfloat16) for w in w8s]
                    else:
                        calls = [_blockwise(a8, w, m, n, k) for w in w8s]
                    row[v + "_s"] = graph_per_call(calls)
                except Exception as e:  # noqa: BLE001 -- record, go on
                    row[v + "_error"] = str(e).splitlines()[0][:200]
            out.append(row)
            print(row, flush=True)
        ws = w8s = None
        torch.cuda.empty_cache()
    return out


# -- a Llama-shaped step ---------------------------------------------------------------------

class Decoder:
    """Random-weight Llama decoder: per-layer weights; K/V caches shared by the layers (each
    layer streams its own weights between two attentions, so the cache is not L2-resident)."""

    def __init__(self, m: dict, max_kv_tokens: int):
        h, i, d = m["hidden"], m["inter"], m["head_dim"]
        self.m = m
        qkv = (m["heads"] + 2 * m["kv_heads"]) * d

        def w(n, k):
            return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5

        self.layers = [(w(qkv, h), w(h, m["heads"] * d), w(2 * i, h), w(h, i),
                        torch.ones(h, device="cuda", dtype=torch.bfloat16),
                        torch.ones(h, device="cuda", dtype=torch.bfloat16))
                       for _ in range(m["layers"])]
        self.lm_head = w(m["vocab"], h)
        self.final_norm = torch.ones(h, device="cuda", dtype=torch.bfloat16)
        self.kv = torch.empty(2 * max_kv_tokens * m["kv_heads"] * d, device="cuda",
                              dtype=torch.bfloat16)

    def rope(self, x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, x, batch: int, q_len: int, context: int, logits_rows: int):
        """``x [batch*q_len, hidden]``; each sequence attends to ``context + q_len`` keys."""
        m, d = self.m, self.m["head_dim"]
        H, KVH = m["heads"], m["kv_heads"]
        L = context + q_len
        kv = self.kv[:2 * batch * KVH * L * d].view(2, batch, KVH, L, d)
        T = batch * q_len
        pos = torch.arange(context, L, device="cuda", dtype=torch.float32)
        inv = 1e4 ** (-torch.arange(0, d // 2, device="cuda", dtype=torch.float32) / (d // 2))
        ang = (pos[:, None] * inv[None]).repeat(batch, 1)
        cos, sin = ang.cos().bfloat16()[:, None], ang.sin().bfloat16()[:, None]
        res = torch.zeros_like(x)
        for wqkv, wo, wgu, wd, n1, n2 in self.layers:
            res = res + x
            x = F.rms_norm(res, (m["hidden"],), n1, 1e-5)
            q, k, v = (x @ wqkv.t()).split([H * d, KVH * d, KVH * d], dim=-1)
            q = self.rope(q.view(T, H, d), cos, sin)
            k = self.rope(k.view(T, KVH, d), cos, sin)
            kv[0, :, :, context:] = k.view(batch, q_len, KVH, d).transpose(1, 2)
            kv[1, :, :, context:] = v.view(batch, q_len, KVH, d).transpose(1, 2)
            if q_len == 1:  # GQA decode: the group's query heads as the query rows
                qg = q.view(batch, KVH, H // KVH, d)
                o = F.scaled_dot_product_attention(qg, kv[0], kv[1])
            else:
                q4 = q.view(batch, q_len, H, d).transpose(1, 2)
                k4, v4 = (t.repeat_interleave(H // KVH, dim=1) for t in (kv[0], kv[1]))
                o = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True).transpose(1, 2)
            x = o.reshape(T, H * d) @ wo.t()
            res = res + x
            x = F.rms_norm(res, (m["hidden"],), n2, 1e-5)
            g, u = (x @ wgu.t()).chunk(2, dim=-1)
            x = (F.silu(g) * u) @ wd.t()
        x = F.rms_norm((res + x)[-logits_rows:], (m["hidden"],), self.final_norm, 1e-5)
        return (x @ self.lm_head.t()).argmax(-1)


def step(decode=((1, 1024), (8, 1024), (32, 1024), (64, 1024), (128, 1024), (256, 1024),
                 (64, 4096), (32, 8192)),
         prefill=(128, 512, 1024, 2048, 4096, 8192)) -> list[dict]:
    m = LLAMA8B
    dec = Decoder(m, max_kv_tokens=max(max(b * (c + 1) for b, c in decode), max(prefill)))
    out = []
    for batch, context in decode:
        x = torch.randn(batch, m["hidden"], device="cuda", dtype=torch.bfloat16)
        eager = cuda_median(lambda x=x, b=batch, c=context: dec.forward(x, b, 1, c, b), reps=5)
        g = capture(lambda x=x, b=batch, c=context: dec.forward(x, b, 1, c, b))
        graphed = cuda_median(g.replay, reps=20)
        del g
        out.append({"kind": "decode", "batch": batch, "context": context,
                    "eager_s": eager, "graph_s": graphed})
    for tokens in prefill:
        x = torch.randn(tokens, m["hidden"], device="cuda", dtype=torch.bfloat16)
        t = cuda_median(lambda x=x, tokens=tokens: dec.forward(x, 1, tokens, 0, 1), reps=5)
        out.append({"kind": "prefill", "tokens": tokens, "eager_s": t})
    return out


class CompiledDecoder:
    """:class:`Decoder`'s weights run as vLLM V1 runs a Llama layer: ``pre`` (residual add +
    RMSNorm, QKV GEMM, RoPE) and ``post`` (O GEMM, residual add + RMSNorm, gate/up GEMM,
    SiLU-and-mul, down GEMM) compiled by inductor, attention eager between them."""

    def __init__(self, dec: Decoder, dev: str = "cuda"):
        m = dec.m
        self.dec, self.m, self.dev = dec, m, dev
        H, KVH, d, hid = m["heads"], m["kv_heads"], m["head_dim"], m["hidden"]

        def rope(x, cos, sin):
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

        def pre(x, res, wqkv, n1, cos, sin):
            res = res + x
            h = F.rms_norm(res, (hid,), n1, 1e-5)
            q, k, v = (h @ wqkv.t()).split([H * d, KVH * d, KVH * d], dim=-1)
            T = x.shape[0]
            return (rope(q.view(T, H, d), cos, sin), rope(k.view(T, KVH, d), cos, sin),
                    v.view(T, KVH, d), res)

        def post(o, res, wo, wgu, wd, n2):
            res = res + o.flatten(1) @ wo.t()
            g, u = (F.rms_norm(res, (hid,), n2, 1e-5) @ wgu.t()).chunk(2, dim=-1)
            return (F.silu(g) * u) @ wd.t(), res

        self.pre = torch.compile(pre, dynamic=True)
        self.post = torch.compile(post, dynamic=True)

    def forward(self, x, batch: int, q_len: int, context: int):
        """``x [batch*q_len, hidden]``; a decode batch (q_len 1) attends to ``context + 1``
        cached keys per sequence, a prefill (batch 1) causally to its own ``q_len``."""
        m, dev = self.m, self.dev
        H, KVH, d = m["heads"], m["kv_heads"], m["head_dim"]
        L = context + q_len
        kv = self.dec.kv[:2 * batch * KVH * L * d].view(2, batch, KVH, L, d)
        pos = torch.arange(context, L, device=dev, dtype=torch.float32)
        inv = 1e4 ** (-torch.arange(0, d // 2, device=dev, dtype=torch.float32) / (d // 2))
        ang = (pos[:, None] * inv[None]).repeat(batch, 1)
        cos, sin = ang.cos().bfloat16()[:, None], ang.sin().bfloat16()[:, None]
        res = torch.zeros_like(x)
        for wqkv, wo, wgu, wd, n1, n2 in self.dec.layers:
            q, k, v, res = self.pre(x, res, wqkv, n1, cos, sin)
            kv[0, :, :, context:] = k.view(batch, q_len, KVH, d).transpose(1, 2)
            kv[1, :, :, context:] = v.view(batch, q_len, KVH, d).transpose(1, 2)
            if q_len == 1:  # the group's query heads as the query rows
                o = F.scaled_dot_product_attention(q.view(batch, KVH, H // KVH, d), kv[0], kv[1])
            else:
                o = F.scaled_dot_product_attention(
                    q.view(1, q_len, H, d).transpose(1, 2), kv[0], kv[1], is_causal=True,
                    enable_gqa=True).transpose(1, 2)
            x, res = self.post(o.reshape(batch * q_len, H, d), res, wo, wgu, wd, n2)
        x = F.rms_norm((res + x)[-batch:], (m["hidden"],), self.dec.final_norm, 1e-5)
        return (x @ self.dec.lm_head.t()).argmax(-1)


def compiled_step(decode=((1, 1024), (8, 1024), (32, 1024), (64, 1024), (128, 1024),
                          (256, 1024), (64, 4096), (32, 8192)),
                  prefill=(128, 512, 1024, 2048, 4096, 8192), m: dict = LLAMA8B,
                  dev: str = "cuda") -> list[dict]:
    """Per-step seconds of :class:`CompiledDecoder`: decode replayed from a CUDA graph
    (``graph_s``), prefill eager (``compiled_s``); the first call of each shape compiles."""
    dec = Decoder(m, max_kv_tokens=max(max(b * (c + 1) for b, c in decode), max(prefill)))
    cd = CompiledDecoder(dec, dev)
    out = []
    for tokens in prefill:
        x = torch.randn(tokens, m["hidden"], device=dev, dtype=torch.bfloat16)
        t = cuda_median(lambda x=x, tokens=tokens: cd.forward(x, 1, tokens, 0), reps=5)
        out.append({"kind": "prefill", "tokens": tokens, "compiled_s": t})
    for batch, context in decode:
        x = torch.randn(batch, m["hidden"], device=dev, dtype=torch.bfloat16)
        g = capture(lambda x=x, b=batch, c=context: cd.forward(x, b, 1, c), warmups=2)
        out.append({"kind": "decode", "batch": batch, "context": context,
                    "graph_s": cuda_median(g.replay, reps=20)})
        del g
    return out


def sustained(seconds: float = 6.0, window_s: float = 0.1) -> dict:
    """Per-GEMM seconds in bursts and under sustained load (see the module docstring):
    ``onset_s``: each GEMM's time for the first ~0.4 s after idling 1 s; ``sustained_windows_s``:
    per-GEMM time in ``window_s`` windows over ``seconds`` back to back; ``recovery_s``: a
    burst's per-GEMM time after loading 1 s then idling 5 ms to 2 s."""
    import subprocess

    h, i = LLAMA8B["hidden"], LLAMA8B["inter"]
    w = torch.randn(2 * i, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
    shapes = {"compute (8192 x 28672 x 4096)": torch.randn(8192, h, device="cuda",
                                                          dtype=torch.bfloat16),
              "memory (1 x 28672 x 4096)": torch.randn(1, h, device="cuda",
                                                       dtype=torch.bfloat16)}
    out: dict = {"window_s": window_s}
    query = "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu"
    smi = subprocess.Popen(["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms",
                            "100"], stdout=subprocess.PIPE, text=True)
    t0 = time.time()

    def each(x, n):
        """Per-call seconds of ``n`` back-to-back GEMMs (events between calls)."""
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        ev[0].record()
        for e in ev[1:]:
            x @ w.t()
            e.record()
        ev[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(ev)]

    for name, x in shapes.items():
        each(x, 3)
        one = statistics.median(each(x, 5))
        per = max(1, round(window_s / one))  # GEMMs per window
        time.sleep(1.0)
        row: dict = {"onset_s": each(x, max(5, round(0.4 / one))), "t_start": time.time() - t0}
        wins = []
        end = time.time() + seconds
        while time.time() < end:
            wins.append(statistics.mean(each(x, per)))
        row["sustained_windows_s"] = wins
        row["t_end"] = time.time() - t0
        rec = {}
        for idle in (0.005, 0.01, 0.02, 0.04, 0.07, 0.1, 0.2, 0.5, 2.0):
            each(x, 10 * per)  # 1 s under load
            time.sleep(idle)
            rec[f"{idle:g}"] = each(x, 5)
        row["recovery_s"] = rec
        out[name] = row
    time.sleep(0.3)
    smi.terminate()
    out["nvidia_smi"] = smi.communicate()[0].splitlines()
    out["t0_unix"] = t0
    return out

def duty(duties=(0.2, 0.4, 0.6, 0.8, 1.0), seconds: float = 3.0, cycle_s: float = 0.02) -> dict:
    """Per-call seconds of the compute-bound and memory-bound GEMMs of :func:`sustained`
    interleaved at each compute ``duty`` (fraction of GPU time), in bursts and in the last
    half of ``seconds`` of back-to-back cycles."""
    import subprocess

    h, i = LLAMA8B["hidden"], LLAMA8B["inter"]
    w = torch.randn(2 * i, h, device="cuda", dtype=torch.bfloat16) * h ** -0.5
    xc = torch.randn(8192, h, device="cuda", dtype=torch.bfloat16)
    xm = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)

    def timed(x, n):
        return bracketed(lambda: x @ w.t(), n)

    per_call = elapsed

    for x in (xc, xm):
        per_call(timed(x, 3))
    time.sleep(1.0)
    burst_c = statistics.median(per_call(timed(xc, 5)))
    time.sleep(0.5)
    burst_m = statistics.median(per_call(timed(xm, 50)))
    query = "--query-gpu=timestamp,clocks.sm,power.draw"
    smi = subprocess.Popen(["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms",
                            "100"], stdout=subprocess.PIPE, text=True)
    out: dict = {"burst_compute_s": burst_c, "burst_memory_s": burst_m, "cycle_s": cycle_s,
                 "rows": []}
    for d in duties:
        time.sleep(1.0)
        nc = max(1, round(d * cycle_s / burst_c))
        nm = round((1 - d) * cycle_s / burst_m)
        tc, tm = [], []
        end = time.time() + seconds
        half = time.time() + seconds / 2
        prev = None
        while True:  # 10 cycles queued before the previous 10 are read: no host gaps
            now = time.time()
            cycles = [(timed(xc, nc), timed(xm, nm) if nm else []) for _ in range(10)] \
                if now < end else None
            if prev is not None:
                for ec, em in prev[1]:
                    got_c = per_call(ec)
                    got_m = per_call(em) if em else []
                    if prev[0] >= half:
                        tc += got_c
                        tm += got_m
            if cycles is None:
                break
            prev = (now, cycles)
        row = {"duty": d, "compute_calls": nc, "memory_calls": nm,
               "compute_s": statistics.median(tc),
               "memory_s": statistics.median(tm) if tm else None}
        row["actual_duty"] = nc * row["compute_s"] / (
            nc * row["compute_s"] + nm * (row["memory_s"] or 0))
        out["rows"].append(row)
    smi.terminate()
    out["nvidia_smi"] = smi.communicate()[0].splitlines()
    return out


def mix(ks=(0, 1, 3, 8), prefill_tokens: int = 2048, batch: int = 64, context: int = 1024,
        seconds: float = 3.0) -> dict:
    """Prefill and decode step times of :class:`CompiledDecoder` in bursts (after 1 s idle)
    and interleaved back to back, one prefill then ``k`` decode steps (see the module
    docstring)."""
    m = LLAMA8B
    dec = Decoder(m, max_kv_tokens=max(batch * (context + 1), prefill_tokens))
    cd = CompiledDecoder(dec)
    xp = torch.randn(prefill_tokens, m["hidden"], device="cuda", dtype=torch.bfloat16)
    xd = torch.randn(batch, m["hidden"], device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        cd.forward(xp, 1, prefill_tokens, 0)
    g = capture(lambda: cd.forward(xd, batch, 1, context), warmups=2)
    steps = {"prefill": lambda: cd.forward(xp, 1, prefill_tokens, 0), "decode": g.replay}
    out: dict = {"prefill_tokens": prefill_tokens, "batch": batch, "context": context,
                 "burst_s": {}, "rows": []}
    for name, fn in steps.items():
        ts = []
        for _ in range(3):
            torch.cuda.synchronize()
            time.sleep(0.5)
            ts += elapsed(bracketed(fn))
        out["burst_s"][name] = statistics.median(ts)
    for k in ks:
        torch.cuda.synchronize()
        time.sleep(1.0)
        got: dict = {"prefill": [], "decode": []}
        end = time.time() + seconds
        half = time.time() + seconds / 2
        while time.time() < end:
            keep = time.time() >= half
            pre, dec_ = bracketed(steps["prefill"]), bracketed(steps["decode"], k)
            pre_s, dec_s = elapsed(pre), elapsed(dec_) if k else []
            if keep:
                got["prefill"] += pre_s
                got["decode"] += dec_s
        out["rows"].append({"k": k, **{f"{n}_s": statistics.median(v) if v else None
                                       for n, v in got.items()}})
    del g
    return out


# -- varlen (FlashAttention-2) attention with a cached prefix -----------------------------------

def _causal_pairs(c: int, p: int) -> float:
    """(query, key) pairs of a causal chunk of ``c`` queries after ``p`` cached keys."""
    return c * p + c * (c + 1) / 2


def _timed(fn) -> tuple[float, bool]:
    """(median seconds per call, graphed): replayed from a CUDA graph, else eager."""
    try:
        return graph_per_call([fn]), True
    except Exception:  # noqa: BLE001 -- capture unsupported: time it eagerly
        torch.cuda.synchronize()
        return cuda_median(fn, reps=10), False


def varlen_attention(layouts=((32, 8, 128), (16, 2, 128)),
                     prefill=((256, 0), (2048, 0), (8192, 0), (256, 4096), (2048, 4096),
                              (8192, 4096), (512, 16384), (2048, 16384)),
                     decode=((1, 1024), (8, 1024), (64, 1024), (256, 1024), (64, 4096),
                             (32, 8192))) -> dict:
    """FA2 varlen (bottom-right causal) and SDPA (lower-right causal, per backend) timings; a
    small case checks FA2's causal alignment against an fp32 masked reference."""
    import inspect

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
    dev, bf = "cuda", torch.bfloat16
    doc: dict = {"signature": str(inspect.signature(varlen_attn)), "causal_kwargs": str(causal)}

    def cu(*xs):
        return torch.tensor(xs, device=dev, dtype=torch.int32)

    # alignment: 64 queries after 128 cached keys, against an fp32 bottom-right mask
    h, kvh, d, c, p = 8, 2, 128, 64, 128
    q = torch.randn(c, h, d, device=dev, dtype=bf)
    k, v = (torch.randn(p + c, kvh, d, device=dev, dtype=bf) for _ in range(2))
    got = varlen_attn(q, k, v, cu(0, c), cu(0, p + c), c, p + c, **causal, **gqa).float()
    kr, vr = (x.float().repeat_interleave(h // kvh, dim=1).transpose(0, 1) for x in (k, v))
    mask = torch.ones(c, p + c, device=dev, dtype=torch.bool).tril(diagonal=p)
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1), kr, vr, attn_mask=mask)
    doc["bottom_right_max_abs_err"] = float((got - ref.transpose(0, 1)).abs().max())
    cq, ck = cu(0, c), cu(0, p + c)
    try:  # capture once; where varlen_attn cannot be captured, everything is timed eagerly
        graph_per_call([lambda q=q, k=k, v=v: varlen_attn(q, k, v, cq, ck, c, p + c, **causal,
                                                           **gqa)])
        timed, doc["graph_capture"] = _timed, True
    except Exception as e:  # noqa: BLE001
        torch.cuda.synchronize()
        doc["graph_capture"] = str(e).splitlines()[0][:200]

        def timed(fn):
            return cuda_median(fn, reps=10), False

    rows = []
    for h, kvh, d in layouts:
        for c, p in prefill:
            q = torch.randn(c, h, d, device=dev, dtype=bf)
            k, v = (torch.randn(p + c, kvh, d, device=dev, dtype=bf) for _ in range(2))
            cq, ck = cu(0, c), cu(0, p + c)
            t, graphed = timed(lambda q=q, k=k, v=v, cq=cq, ck=ck, c=c, p=p: varlen_attn(
                q, k, v, cq, ck, c, p + c, **causal, **gqa))
            flops = 4 * h * d * _causal_pairs(c, p)
            row = {"kind": "prefill", "heads": h, "kv_heads": kvh, "head_dim": d, "chunk": c,
                   "context": p, "flops": flops, "fa2_varlen_s": t, "graphed": graphed}
            qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            bias = causal_lower_right(c, p + c)
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION),
                                  ("cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
                try:
                    with sdpa_kernel([backend]):
                        row[f"sdpa_{name}_s"] = timed(
                            lambda qs=qs, ks=ks, vs=vs, bias=bias:
                            F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias,
                                                           enable_gqa=True))[0]
                except Exception as e:  # noqa: BLE001 -- this backend refuses the shape
                    row[f"sdpa_{name}_s"] = None
                    row[f"sdpa_{name}_error"] = str(e).splitlines()[0][:200]
            rows.append(row)
            del q, k, v, qs, ks, vs
        for b, n in decode:
            q = torch.randn(b, h, d, device=dev, dtype=bf)
            k, v = (torch.randn(b * n, kvh, d, device=dev, dtype=bf) for _ in range(2))
            cq = torch.arange(b + 1, device=dev, dtype=torch.int32)
            ck = torch.arange(0, b * n + 1, n, device=dev, dtype=torch.int32)
            t, graphed = timed(lambda q=q, k=k, v=v, cq=cq, ck=ck, n=n: varlen_attn(
                q, k, v, cq, ck, 1, n, **gqa))
            rows.append({"kind": "decode", "heads": h, "kv_heads": kvh, "head_dim": d,
                         "batch": b, "context": n, "kv_bytes": 2 * b * n * kvh * d * 2,
                         "fa2_varlen_s": t, "graphed": graphed})
            del q, k, v
    doc["rows"] = rows
    return doc


SECTIONS = {"correctness": correctness, "graph_gemm": graph_gemm, "step": step,
            "compiled_step": compiled_step, "sustained": sustained, "duty": duty, "mix": mix,
            "varlen_attention": varlen_attention}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    args = ap.parse_args(argv)
    props = torch.cuda.get_device_properties(0)
    doc = {"device": props.name, "sm_count": props.multi_processor_count,
           "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            doc[name] = SECTIONS[name]()
        except Exception:  # noqa: BLE001 -- keep the other sections' results
            doc[name + "_error"] = traceback.format_exc()[-2000:]
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        args.output.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
