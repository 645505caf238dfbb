"""Roofline step time of one vLLM V1 engine step.

Every GPU operator (vLLM module names, TP-sharded shapes, totals over all layers) costs

    seconds = max(flops / (peak_flops · eff_c), bytes / (mem_bw · eff_m)) + kernels · kernel_fixed_s

with the documented :class:`Efficiencies` defaults (provenance ``roofline:default``), unless a
calibration file measured that op family (``costmodels/calibration.py``): then the op takes the
measured kernel time interpolated in the table's own coordinates (provenance
``calibration:<source>``; measured times include the kernel's fixed cost), or, outside the
measured range, the roofline at the nearest measured efficiency (``roofline:nearest/<source>``):

- GEMMs: per linear module, (m = tokens, n, k) in the weight format's dtype table;
- attention: decode rows as one call of (batch = num_decode, context = mean context), each
  prefill chunk over its cached context; parts that vLLM runs in one kernel call
  (FlashAttention/Triton varlen: all of them; FlashInfer: the prefill chunks) share one
  latency floor;
- TP all-reduce: per call, by message bytes and TP size, CUDA-graph or eager as the step runs;
- MoE: the fused routed-expert layer by tokens (per expert) for the model's exact shape.

Without a table, collectives use the spec-sheet link bandwidth and latency (provenance
``spec-sheet``). The step is then

    gpu_fwd = max(Σ gpu ops, cpu kernel-launch time)         (launches overlap GPU work)
    host    = per_step + per_request · num_reqs + per_token · num_tokens
    step    = gpu_fwd + host                   (synchronous scheduling)
    step    = max(gpu_fwd, host) + residual    (scheduler.async_scheduling)

CUDA graphs (vLLM V1): batches of at most ``max_cudagraph_capture_size`` tokens are padded to the
next capture size and charged the padded GPU cost; decode-only batches replay a FULL graph,
mixed ones run PIECEWISE (graphs between eager attention), larger batches and
``enforce_eager`` run eagerly (one CPU launch per kernel).

Pipeline parallelism: ``step_seconds`` is one batch's latency through all stages (every layer
once, at TP-sharded cost, plus ``pp − 1`` activation handoffs).

Hot path: ``step_seconds`` evaluates from a few sums in O(1); everything that depends only on
the (padded) token count or the sampled-row count is memoized in dicts.

Simplifications (documented, not hidden): decode attention is costed from Σ context (split-KV
heuristics by ``decode_context_max`` are not modelled); with a sliding window the decode KV
read is capped at ``num_decode · window``; FlashAttention's K/V re-reads across query tiles
are assumed to hit L2; MLA prefill's up-projection of the cached latent context is not
charged; MoE experts are TP-sharded (no expert parallelism, uniform routing); data
parallelism does not change a replica's step.

Parts: the per-operator costs (GEMMs, elementwise, collectives, MoE, LM head/sampler, op
scales) are :class:`~servesim.costmodels.operators.OperatorCosts`, the attention terms
:class:`~servesim.costmodels.attention.AttentionCosts` (both bases of :class:`StepCostModel`);
vLLM's start-up defaults (batch limits, CUDA-graph capture sizes) and parallel checks live in
``costmodels/engine_defaults.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from servesim.costmodels.attention import AttentionCosts, _window_pairs
from servesim.costmodels.batch import BatchShape, OpCost, StepCost
from servesim.costmodels.calibration import Calibration, load_calibration
from servesim.costmodels.engine_defaults import (
    _resolved,
    allreduce_rms_fusion_tokens,
    cudagraph_sizes,
    full_decode_sizes,
    resolved_cudagraph_mode,
    shared_experts_stream_tokens,
    validate_parallel,
)
from servesim.costmodels.operators import (
    _K_ATTN,
    _K_LM_HEAD,
    _K_NORM,
    _K_SAMPLER,
    DEFAULT,
    SPEC_SHEET,
    OperatorCosts,
)
from servesim.costmodels.quant import (
    ACT_BYTES,
    WeightFormat,
    kv_cache_dtype_bytes,
    resolve_weight_format,
)
from servesim.costmodels.specs import (
    HardwareSpec,
    Linear,
    ModelSpec,
    load_hardware_spec,
    load_model_spec,
)

HOST_DEFAULT = "default"  # host-overhead priors (HostOverhead), not a roofline


@dataclass(frozen=True)
class Efficiencies:
    """Default fractions of spec-sheet peak, used where no calibration file covers an op.

    Anchors: real decode kernels reach 60–80% of the HBM bound (course digest 1 §5: "real
    single-stream decode reaches 60–80% of the bound"); aiconfigurator ships
    ``mem_bw_empirical_scaling_factor: 0.8`` and a 3 µs constant per memory op. Large bf16
    GEMMs reach ~70–80% of the tensor peak; FlashAttention-2 forward ~50–70%. These are priors,
    not measurements: calibrate to replace them.
    """

    gemm_compute: float = 0.75  # dense GEMM, fraction of tensor peak
    gemm_memory: float = 0.80  # weight streaming (decode GEMV), fraction of HBM bw
    grouped_gemm_compute: float = 0.60  # fused MoE grouped GEMM: small per-expert m
    grouped_gemm_memory: float = 0.75
    attn_prefill_compute: float = 0.55  # causal flash attention forward
    attn_prefill_memory: float = 0.70
    attn_decode_compute: float = 0.50
    attn_decode_memory: float = 0.70  # paged KV gather: below a plain stream
    elementwise_memory: float = 0.70  # norms, rotary, activation, sampler passes
    # GPU-side per-kernel launch latency + tail (seconds): between the ~1 µs gaps inside a CUDA
    # graph and aiconfigurator's 3 µs constant; ~330 kernels make it ~0.7 ms of an 8B decode
    kernel_fixed_s: float = 2.0e-6


@dataclass(frozen=True)
class HostOverhead:
    """CPU time per engine step (seconds), calibratable (``host:`` in a calibration file).

    Priors: BLIS (peer-simulators.md §2.3) fits ~126 µs per step and ~4 µs per request on
    H100 vLLM traces; the course (digest 2 §1) gives ~5 µs CPU per eager kernel launch.
    ``per_token_s`` covers input preparation (ids, positions, slot mapping) per scheduled token.
    """

    per_step_s: float = 126e-6  # scheduler + input prep + output processing, per step
    per_request_s: float = 4e-6  # per scheduled request
    per_token_s: float = 2e-8  # per scheduled token
    launch_s: float = 5e-6  # CPU time per eager kernel launch
    graph_launch_s: float = 10e-6  # CPU time per CUDA-graph replay
    async_residual_s: float = 20e-6  # non-overlapped part per step with async scheduling

    @classmethod
    def from_dict(cls, d: dict) -> HostOverhead:
        names = {f.name for f in fields(cls)}
        return cls(**{k: float(v) for k, v in d.items() if k in names})


# runtime CUDA-graph modes
NONE, FULL, PIECEWISE = 0, 1, 2
_MODE_NAMES = {NONE: "NONE", FULL: "FULL", PIECEWISE: "PIECEWISE"}


class StepCostModel(AttentionCosts, OperatorCosts):
    """Step time of one engine step for a fixed (model, hardware, parallel, cache, graph) config.

    Build with :func:`build_cost_model`. ``step_seconds(batch)`` is the hot path;
    ``step_time(batch)`` returns the same seconds with a per-op breakdown and provenance.
    """

    def __init__(self, spec: ModelSpec, hw: HardwareSpec, *, tp: int = 1, pp: int = 1,
                 weight_format: WeightFormat | None = None, kv_dtype_bytes: int = 2,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 async_scheduling: bool = False, cudagraph_mode: str = "FULL_AND_PIECEWISE",
                 cudagraph_sizes: list[int] | None = None, enforce_eager: bool = False,
                 calibration: Calibration | None = None,
                 efficiencies: Efficiencies = Efficiencies(),
                 host: HostOverhead | None = None, num_spec_tokens: int = 0,
                 allreduce_rms_fusion_tokens: int = 0):
        validate_parallel(spec, tp, pp)
        # padded batches up to this many tokens run each all-reduce fused with the RMSNorm
        # after it (engine_defaults.allreduce_rms_fusion_tokens; 0: never)
        self.allreduce_rms_fusion_tokens = allreduce_rms_fusion_tokens if tp > 1 else 0
        # up to this many tokens the shared experts overlap the routed ones (0: never)
        self.shared_experts_stream_tokens = shared_experts_stream_tokens(hw, spec)
        self.spec, self.hw, self.tp, self.pp = spec, hw, tp, pp
        self.weight_format = weight_format or WeightFormat("bf16", 2.0, "bf16")
        self.kv_dtype_bytes = kv_dtype_bytes
        self.calibration = calibration
        self.eff = efficiencies
        if host is None:
            host = HostOverhead.from_dict(calibration.host) if calibration and \
                calibration.host else HostOverhead()
        self.host = host
        self.host_provenance = f"calibration:{calibration.host_source}" if calibration and \
            calibration.host else HOST_DEFAULT
        self.async_scheduling = async_scheduling
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        # -- speculative decoding and multi-LoRA (costmodels/spec_decode.py, lora.py) ---------
        # vLLM's GPUModelRunner.uniform_decode_query_len: a decode-only batch whose rows all
        # carry 1 + k query tokens replays the FULL decode graph; any other decode batch is
        # "mixed" (_is_uniform_decode).
        self.uniform_decode_query_len = 1 + num_spec_tokens
        # Per-step terms added to the forward: objects with ``__call__(batch) -> (gpu_s,
        # host_s)`` (hot path) and ``ops(batch) -> list[OpCost]`` (breakdown): the spec-decode
        # proposer, LoRA shrink/expand kernels and adapter loads.
        self.step_extensions: tuple = ()

        # peaks (FLOP/s, bytes/s)
        self.peak = hw.peak_flops("bf16")
        self.peak_w = hw.peak_flops(self.weight_format.compute)
        self.bw = hw.mem_bw
        cal = calibration
        self._ew_eff = (cal.memcpy_eff if cal and cal.memcpy_eff else efficiencies.elementwise_memory)
        self._ew_prov = f"calibration:{cal.memcpy_source}" if cal and cal.memcpy_eff else DEFAULT

        # -- geometry per rank -------------------------------------------------------------------
        L = spec.num_hidden_layers
        self.L = L
        self.nh_r = spec.num_attention_heads // tp
        self.kv_elems = spec.kv_elems_per_token_per_layer(tp)  # per token per layer
        self.window = spec.sliding_window
        self._gemms: list[tuple[Linear, int, int]] = [(lin, *lin.shard(tp)) for lin in
                                                      spec.linears()]

        # -- CUDA graphs -------------------------------------------------------------------------
        mode = "NONE" if enforce_eager else cudagraph_mode
        self.cudagraph_mode = mode
        self._decode_mode = {"NONE": NONE, "PIECEWISE": PIECEWISE}.get(mode, FULL)
        self._mixed_mode = {"NONE": NONE, "FULL_DECODE_ONLY": NONE, "FULL": FULL}.get(
            mode, PIECEWISE)
        self.capture_sizes = [] if mode == "NONE" else (cudagraph_sizes or [])
        self._max_graph = self.capture_sizes[-1] if self.capture_sizes else 0
        # FULL decode graphs beside the mixed mode (FULL_AND_PIECEWISE, FULL_DECODE_ONLY) exist
        # only for uniform decode batches of q…q·max_num_seqs tokens (CudagraphDispatcher
        # .initialize_cudagraph_keys); a larger one falls back to the mixed mode's graph
        self._decode_max = self._max_graph if mode not in (
            "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY") else max(full_decode_sizes(
                self.capture_sizes, self.uniform_decode_query_len, max_num_seqs), default=0)
        self._pad = [0] * (self._max_graph + 1)
        j = 0
        for t in range(1, self._max_graph + 1):
            while self.capture_sizes[j] < t:
                j += 1
            self._pad[t] = self.capture_sizes[j]

        # -- attention coefficients (all layers, seconds per unit) -------------------------------
        e = efficiencies
        kvb = kv_dtype_bytes
        if spec.is_mla:
            lat, rope, v = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.v_head_dim
            dec_fpt = 2 * (lat + rope) * self.nh_r + 2 * lat * self.nh_r  # absorbed MLA
            dec_row_bytes = (self.nh_r * (lat + rope) + self.nh_r * lat) * ACT_BYTES
            pre_fpp = (2 * (spec.qk_nope_head_dim + rope) + 2 * v) * self.nh_r
            pre_row_bytes = self.nh_r * (spec.qk_nope_head_dim + rope + v) * ACT_BYTES
        else:
            hd = spec.head_dim
            dec_fpt = 4 * self.nh_r * hd  # QK^T + PV: 2·hd FLOPs each per (query, key, head)
            dec_row_bytes = 2 * self.nh_r * hd * ACT_BYTES  # q read + o write
            pre_fpp = 4 * self.nh_r * hd
            pre_row_bytes = 2 * self.nh_r * hd * ACT_BYTES
        kv_tok = self.kv_elems * kvb  # bytes per cached token per layer
        # per layer, at 100% of peak (used with calibrated efficiencies)
        self._dec_f1, self._dec_b1 = dec_fpt, kv_tok  # per context token
        self._dec_rb1 = dec_row_bytes + kv_tok  # per decode row (+ its KV write)
        self._pre_f1 = pre_fpp  # per (query, key) pair
        self._pre_b1_kv, self._pre_rb1 = kv_tok, pre_row_bytes + kv_tok
        # all layers, default efficiencies, seconds
        self._dF = L * dec_fpt / (self.peak * e.attn_decode_compute)
        self._dB = L * kv_tok / (self.bw * e.attn_decode_memory)
        self._dBr = L * self._dec_rb1 / (self.bw * e.attn_decode_memory)
        self._pF = L * pre_fpp / (self.peak * e.attn_prefill_compute)
        self._pBkv = L * kv_tok / (self.bw * e.attn_prefill_memory)
        self._pBr = L * self._pre_rb1 / (self.bw * e.attn_prefill_memory)
        # measured attention tables (GQA/MHA layouts; MLA has its own kernels: roofline)
        self._layout = (self.nh_r, spec.kv_heads_per_rank(tp), spec.head_dim,
                        "fp8" if kv_dtype_bytes == 1 else "bfloat16")
        self._cal_dec = cal is not None and cal.has("decode_attention") and not spec.is_mla
        self._cal_pre = cal is not None and cal.has("prefill_attention") and not spec.is_mla
        # measured attention kernels include their own fixed cost; reshape_and_cache is not
        n_fixed = _K_ATTN - 1 if (self._cal_dec or self._cal_pre) else _K_ATTN
        self._attn_fixed = L * n_fixed * e.kernel_fixed_s
        # parts of one step's attention that run in one kernel call share its latency floor
        self._attn_floor = 0.0
        self._attn_unified = True
        if self._cal_dec and self._cal_pre:
            self._attn_floor = L * cal.attention_floor(*self._layout)
            self._attn_unified = cal.unified_attention()
        self._dec_cache: dict[tuple[int, int], tuple[float, str]] = {}
        self._pre_cache: dict[tuple[int, int], tuple[float, str]] = {}
        self._cal_prefill = cal.prefill_fn(*self._layout) if self._cal_pre else None
        self._moe_cache: dict[int, tuple[float, str] | None] = {}

        # -- CPU launches per step, by runtime mode (the LM head/sampler run eagerly always) -----
        self._layer_kernels = self._kernels_per_layer()
        n_eager = L * self._layer_kernels + 2  # + embedding + final norm
        if tp > 1:
            n_eager += 2 * L + 1
        ho = self.host
        self._launch = {
            NONE: n_eager * ho.launch_s,
            FULL: ho.graph_launch_s,
            PIECEWISE: (L + 1) * ho.graph_launch_s + L * _K_ATTN * ho.launch_s,
        }
        # an eager (compiled, ungraphed) step with fused all-reduce + RMSNorm: no norm kernels
        self._launch_fused_eager = (n_eager - (2 * L + 1) * _K_NORM) * ho.launch_s
        self._head_launch = (_K_LM_HEAD + _K_SAMPLER) * ho.launch_s
        self._dense_cache: dict[int, float] = {}
        self._dense_comp: dict[int, float] = {}  # (same keys) their compute-bound part
        self._uva: dict[str, int] = {}  # --cpu-offload-gb: linear -> layers read over UVA
        self.scales: dict[str, float] = {}  # op family -> time factor (set_scales)
        self._attn_scale = 1.0
        self._head_cache: dict[int, float] = {}
        self._decode_step_cache: dict[tuple[int, int], float] = {}
        self._decode_step_token: tuple = (None, None)
        self._decode_shape = BatchShape()

    # -- the hot path ----------------------------------------------------------------------------

    def runtime_mode(self, batch: BatchShape) -> tuple[int, int]:
        """(CUDA-graph mode, padded token count) vLLM would use for this batch."""
        pre = batch.prefill_new_tokens
        nd, ns = batch.num_decode, batch.num_spec_tokens
        T = nd + ns + (sum(pre) if pre else 0)
        uniform = not pre and ns == nd * (self.uniform_decode_query_len - 1) \
            and T <= self._decode_max
        mode = self._decode_mode if uniform else self._mixed_mode
        if mode and 0 < T <= self._max_graph:
            return mode, self._pad[T]
        return NONE, T

    def decode_step_seconds(self, nd: int, ctx_sum: int) -> float:
        """:meth:`step_seconds` of a decode-only batch of ``nd`` rows reading ``ctx_sum``
        context tokens in all (every row samples, no drafts, no adapters). With measured
        decode attention, no sliding window and no step extensions the time depends on
        ``ctx_sum`` only through the table's 16-token bucket of the mean context, so it is
        cached per (rows, bucket): the same float. The cache holds while the host terms,
        scales and extensions it was computed with do (``simulate fit`` varies them)."""
        if self._cal_dec and not self.window and not self.step_extensions:
            token = self._decode_step_token
            if token[0] is not self.host or token[1] is not self.scales:
                self._decode_step_cache.clear()
                self._decode_step_token = (self.host, self.scales)
            key = (nd, (ctx_sum // nd + 8) >> 4)
            got = self._decode_step_cache.get(key)
            if got is None:
                got = self._decode_step_cache[key] = self.step_seconds(
                    BatchShape(nd, ctx_sum, 0, (), (), nd))
            return got
        shape = self._decode_shape
        shape.num_decode = shape.num_sampled = nd
        shape.decode_context_sum = ctx_sum
        return self.step_seconds(shape)

    def step_seconds(self, batch: BatchShape) -> float:
        """Seconds of one engine step (O(1) in the number of running requests)."""
        nd = batch.num_decode
        ns = batch.num_spec_tokens
        pre = batch.prefill_new_tokens
        if pre:
            T = nd + ns + sum(pre)
            mode = self._mixed_mode
        else:
            T = nd + ns
            # spec decode: only uniform decode batches (every row 1 + k tokens) replay FULL,
            # and only up to q · max_num_seqs tokens
            mode = self._decode_mode if ns == nd * (self.uniform_decode_query_len - 1) \
                and T <= self._decode_max else self._mixed_mode
        if mode and 0 < T <= self._max_graph:
            Tp = self._pad[T]
        else:
            mode = NONE
            Tp = T
        gpu = self._dense_cache.get(Tp if mode else -Tp)
        if gpu is None:
            gpu = self._dense_seconds(Tp, mode != NONE)
        att = self._attn_fixed if T else 0.0
        if nd:
            ctx = batch.decode_context_sum
            if self.window and ctx > nd * self.window:
                ctx = nd * self.window
            if ns:
                att += self._spec_decode_attn(nd, ns, ctx, self._decode_attn(nd, ctx))
            else:
                att += self._decode_attn(nd, ctx)
        if pre:
            pc = batch.prefill_context
            if len(pc) != len(pre):
                pc = tuple(pc) + (0,) * (len(pre) - len(pc))
            for c, p in zip(pre, pc):
                att += self._prefill_attn(c, p)
            if self._attn_floor:
                att -= self._attn_shared(nd, len(pre))
        gpu += att * self._attn_scale
        launch = self._launch[mode] if mode or Tp > self.allreduce_rms_fusion_tokens \
            else self._launch_fused_eager
        s = batch.num_sampled
        if s:
            hs = self._head_cache.get(s)
            if hs is None:
                hs = self._head_seconds(s)
            gpu += hs
            launch += self._head_launch
        gpu = max(gpu, launch)
        ho = self.host
        host = ho.per_step_s + ho.per_request_s * (nd + len(pre)) + ho.per_token_s * T
        for ext in self.step_extensions:  # spec-decode proposer, LoRA (see __init__)
            g, h = ext(batch)
            gpu += g
            host += h
        if self.async_scheduling:
            return (max(host, gpu)) + ho.async_residual_s
        return gpu + host

    def compute_seconds(self, batch: BatchShape) -> float:
        """GPU seconds of the step's compute-bound work, the part a power cap slows
        (``costmodels.power``): the dense ops whose roofline is compute-bound (GEMMs and MoE
        experts at enough tokens) and the prefill chunks whose attention FLOPs outweigh its
        bytes; decode attention, norms, activations and the LM head are memory-bound."""
        mode, Tp = self.runtime_mode(batch)
        key = Tp if mode else -Tp
        c = self._dense_comp.get(key)
        if c is None:
            self._dense_seconds(Tp, mode != NONE)
            c = self._dense_comp[key]
        pre = batch.prefill_new_tokens
        if pre:
            pc = batch.prefill_context
            if len(pc) != len(pre):
                pc = tuple(pc) + (0,) * (len(pre) - len(pc))
            for n, p in zip(pre, pc):
                if self._prefill_compute_bound(n, p):
                    c += self._prefill_attn(n, p) * self._attn_scale
        return c

    # -- breakdown -------------------------------------------------------------------------------

    def step_time(self, batch: BatchShape) -> StepCost:
        """:meth:`step_seconds` with a per-op breakdown (totals over all layers) and provenance.

        The breakdown sums to ``seconds`` (up to float rounding): ``kernel_launch`` is the CPU
        launch time not hidden behind GPU work, ``host`` the exposed host time.
        """
        seconds = self.step_seconds(batch)
        mode, Tp = self.runtime_mode(batch)
        nd, pre = batch.num_decode, batch.prefill_new_tokens
        T = batch.num_tokens
        ops = list(self.dense_ops(Tp, mode != NONE))
        # attention (decode rows + prefill chunks share one kernel per layer)
        attn_s = self._attn_fixed if T else 0.0
        flops = nbytes = 0.0
        L = self.L
        provs = set()
        if nd:
            ctx = batch.decode_context_sum
            if self.window and ctx > nd * self.window:
                ctx = nd * self.window
            ns = batch.num_spec_tokens
            t = self._decode_attn(nd, ctx)
            attn_s += self._spec_decode_attn(nd, ns, ctx, t) if ns else t
            provs.add(self._decode_cal(nd, ctx)[1] if self._cal_dec else DEFAULT)
            flops += L * ctx * (nd + ns) / nd * self._dec_f1
            nbytes += L * (ctx * self._dec_b1 + (nd + ns) * self._dec_rb1)
        pc = tuple(batch.prefill_context) + (0,) * (len(pre) - len(batch.prefill_context))
        for c, p in zip(pre, pc):
            attn_s += self._prefill_attn(c, p)
            provs.add(self._prefill_cal(c, p)[1] if self._cal_pre else DEFAULT)
            w = self.window
            pairs = (_window_pairs(p + c, w) - _window_pairs(p, w)) if w else c * p + c * (
                c + 1) / 2
            kv = min(p + c, w + c) if w else p + c
            flops += L * pairs * self._pre_f1
            nbytes += L * (kv * self._pre_b1_kv + c * self._pre_rb1)
        if pre and self._attn_floor:
            attn_s -= self._attn_shared(nd, len(pre))
        attn_s *= self._attn_scale
        if T:
            # one label: the least direct source among the parts
            prov = min(provs, key=lambda x: (x.startswith("calibration:"),
                                             x.startswith("roofline:nearest"), x))
            t_c, t_m = flops / self.peak, nbytes / self.bw
            bound = "compute" if t_c > t_m else "memory"
            # effective efficiency: roofline at 100% / modelled time
            eff = max(t_c, t_m) / attn_s if attn_s else 0.0
            ops.insert(self._attn_index(ops), OpCost("attn", L, attn_s, flops, nbytes, bound,
                                                     eff, prov))
        ops.extend(self.head_ops(batch.num_sampled))
        gpu = 0.0
        for op in ops:
            gpu += op.seconds
        launch = (self._launch[mode] if mode or Tp > self.allreduce_rms_fusion_tokens
                  else self._launch_fused_eager) + (self._head_launch if batch.num_sampled
                                                    else 0.0)
        n_launch = self._launch_count(mode, batch.num_sampled, Tp)
        fwd = max(gpu, launch)
        ops.append(OpCost("kernel_launch", n_launch, fwd - gpu, 0.0, 0.0, "host", 1.0,
                          self.host_provenance))
        # spec-decode proposer, LoRA kernels and adapter copies (GPU side; their host side,
        # such as an n-gram proposer or a disk read, is in "host")
        ext_gpu = ext_host = 0.0
        for ext in self.step_extensions:
            g, h = ext(batch)
            ext_gpu += g
            ext_host += h
            ops.extend(ext.ops(batch))
        ops.append(OpCost("host", 1, seconds - fwd - ext_gpu, 0.0, 0.0, "host", 1.0,
                          self.host_provenance))
        ho = self.host
        host = ho.per_step_s + ho.per_request_s * batch.num_reqs + ho.per_token_s * T + ext_host
        fwd += ext_gpu
        return StepCost(seconds=seconds, breakdown=ops, gpu_seconds=fwd, host_seconds=host,
                        padded_batch=Tp, cudagraph=_MODE_NAMES[mode])

    @staticmethod
    def _attn_index(ops: list[OpCost]) -> int:
        for i, op in enumerate(ops):
            if op.name == "rotary_emb":
                return i + 1
        return len(ops)

    def _launch_count(self, mode: int, s: int, T: int) -> int:
        L = self.L
        head = (_K_LM_HEAD + _K_SAMPLER) if s else 0
        if mode == FULL:
            return 1 + head
        if mode == PIECEWISE:
            return L + 1 + L * _K_ATTN + head
        n = L * self._layer_kernels + 2 + (2 * L + 1 if self.tp > 1 else 0)
        if T <= self.allreduce_rms_fusion_tokens:  # (the norms run inside the all-reduces)
            n -= (2 * L + 1) * _K_NORM
        return round(n) + head

    # -- roofline floor (tests, reports) --------------------------------------------------------

    def roofline_floor(self, batch: BatchShape) -> float:
        """Σ over GPU ops of max(flops/peak, bytes/bw) at 100% efficiency (seconds): a lower
        bound no step can beat (no launch, host or latency terms)."""
        t = 0.0
        for op in self.step_time(batch).breakdown:
            if op.bound in ("host",) or op.provenance == SPEC_SHEET:
                continue
            peak = self.peak_w if op.name in self._quantized_ops() else self.peak
            t += max(op.flops / peak, op.bytes / self.bw)
        return t

    def _quantized_ops(self) -> set[str]:
        return {lin.op for lin, _, _ in self._gemms if lin.quantized}


def build_cost_model(cfg, *, efficiencies: Efficiencies | None = None,
                     host: HostOverhead | None = None) -> StepCostModel:
    """Resolved :class:`~servesim.simulator.config.ExperimentConfig` → :class:`StepCostModel`."""
    spec = load_model_spec(cfg.model)
    hw = load_hardware_spec(cfg.hardware)
    tp = cfg.parallel.tensor_parallel_size
    pp = cfg.parallel.pipeline_parallel_size
    validate_parallel(spec, tp, pp)
    seqs, toks, _ = _resolved(cfg, hw, spec)
    # speculative decoding / LoRA: costmodels/spec_decode.py, costmodels/lora.py
    scfg = getattr(cfg, "speculative_config", None)
    k = scfg.num_speculative_tokens if scfg is not None else 0
    sizes = cudagraph_sizes(cfg, seqs, toks)
    fused = allreduce_rms_fusion_tokens(cfg, hw, spec)
    mode = resolved_cudagraph_mode(cfg)
    cal = load_calibration(cfg.hardware, hw)
    model = StepCostModel(
        spec, hw, tp=tp, pp=pp,
        weight_format=resolve_weight_format(cfg.model, spec, hw),
        kv_dtype_bytes=kv_cache_dtype_bytes(cfg.cache.cache_dtype),
        max_num_seqs=seqs, max_num_batched_tokens=toks,
        async_scheduling=cfg.scheduler.async_scheduling,
        cudagraph_mode=mode, cudagraph_sizes=sizes,
        enforce_eager=cfg.model.enforce_eager, calibration=cal,
        efficiencies=efficiencies or Efficiencies(), host=host, num_spec_tokens=k,
        allreduce_rms_fusion_tokens=fused,
    )
    if scfg is not None:
        from servesim.costmodels.spec_decode import attach_proposer

        attach_proposer(model, cfg)
    if getattr(getattr(cfg, "lora", None), "enable_lora", False):
        from servesim.costmodels.lora import attach_lora

        attach_lora(model, cfg)
    if getattr(cfg, "cpu_offload_gb", 0.0) > 0:
        from servesim.costmodels.memory import uva_offload

        model.set_cpu_offload(uva_offload(spec, model.weight_format, tp, pp,
                                          cfg.cpu_offload_gb).layers)
    if cal is not None and cal.scales:
        model.set_scales(cal.scales)
    return model


__all__ = [
    "Efficiencies",
    "HostOverhead",
    "StepCostModel",
    "build_cost_model",
]
