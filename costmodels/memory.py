"""Memory model: how many KV-cache blocks vLLM V1 carves out of one GPU.

vLLM (``gpu_worker.determine_available_memory``): load the weights, profile one worst-case
forward pass of ``max_num_batched_tokens`` tokens plus a dummy sampler pass over
``max_num_seqs`` rows, then

    requested       = ⌈total_gpu_memory · gpu_memory_utilization⌉          (bytes)
    available_kv    = requested − weights − activation_peak − non_torch
                      − CUDA-graph estimate                                 (bytes)
    num_gpu_blocks  = available_kv // (block_size · layers/pp · per-token-per-layer KV bytes)

with per-token-per-layer bytes = 2 · kv_heads/tp · head_dim · dtype_bytes (MLA: the
kv_lora_rank + qk_rope_head_dim latent, replicated on every TP rank). ``non_torch`` is the
memory outside PyTorch's allocator that grows after start-up (cuBLAS workspaces; NCCL and
custom all-reduce buffers when TP/PP > 1). Since vLLM 0.21 the profiler also estimates the
CUDA-graph pool (``GPUModelRunner.profile_cudagraph_memory``) and takes it out of the KV budget
(``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``, default 1: ``cache.
memory_profiler_estimate_cudagraphs``); with it off the graphs live in the (1 − utilization)
headroom. Every coefficient here is an estimate of what vLLM's profiler measures, documented
below, not a measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from servesim.costmodels.engine_defaults import (
    _resolved,
    cudagraph_sizes,
    full_decode_sizes,
    kv_block_size,
    resolved_cudagraph_mode,
    validate_parallel,
)
from servesim.costmodels.quant import (
    ACT_BYTES,
    WeightFormat,
    kv_cache_dtype_bytes,
    resolve_weight_format,
)
from servesim.costmodels.specs import (
    GIB,
    HardwareSpec,
    ModelSpec,
    load_hardware_spec,
    load_model_spec,
)
from servesim.simulator.errors import CapacityError

MIB = 1 << 20


@dataclass(frozen=True)
class MemoryCoefficients:
    """Start-up memory terms vLLM measures by profiling (bytes), as estimates.

    - ``non_torch_bytes``: cuBLAS/cuDNN workspaces and other non-PyTorch growth at TP=PP=1.
    - ``comm_bytes``: NCCL + custom all-reduce buffers per rank when TP or PP > 1
      (aiconfigurator measures ≈342–392 MB at TP ≥ 2).
    - ``sampler_bytes_per_logit``: dummy sampler pass over max_num_seqs × vocab logits: bf16
      logits (2) + fp32 copy (4) + probabilities (4) + one fp32 temporary (4) = 14 bytes.
    - ``rejection_sampler_bytes_per_logit``: with speculative decoding the dummy pass also
      runs the rejection sampler (``_dummy_sampler_run``: one draft token per row, so 2 ×
      max_num_seqs rows of logits), its peak per max_num_seqs × vocab logit: bf16 logits of
      the 2N rows (4) + the bonus rows' bf16 copy (2) + the bonus sampler's fp32 logits kept
      for logprobs (4) + the target rows' fp32 copy (4) and its clone (4) + the target
      probabilities (4) = 22 bytes (the larger of the two passes sets the peak).
    - ``cudagraph_bytes_per_graph``: private-pool overhead per captured graph (course: 46
      graphs of OPT-125m took 0.41 GiB ≈ 9 MiB each; a prior of 4 MiB; vLLM's estimate
      floors its measured per-graph sample at 1 MiB). The first capture of each runtime mode
      also holds the activations of its largest size (:func:`cudagraph_pool_bytes`).
    """

    non_torch_bytes: int = int(0.15 * GIB)
    comm_bytes: int = int(0.35 * GIB)
    sampler_bytes_per_logit: float = 14.0
    rejection_sampler_bytes_per_logit: float = 22.0
    cudagraph_bytes_per_graph: int = 4 * MIB


@dataclass
class MemoryPlan:
    """Per-rank memory plan (the most loaded rank) and the resulting KV-cache size."""

    model: str
    hardware: str
    tensor_parallel_size: int
    pipeline_parallel_size: int
    total_bytes: int
    gpu_memory_utilization: float
    requested_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int
    comm_bytes: int
    cudagraph_bytes: int
    cudagraph_in_kv_budget: bool
    available_kv_bytes: int
    block_size: int
    block_bytes: int
    kv_bytes_per_token: int
    num_gpu_blocks: int
    num_gpu_blocks_computed: int
    num_gpu_blocks_override: int | None
    max_model_len: int
    blocks_per_request: int
    weight_format: str = "bf16"
    kv_cache_dtype: str = "auto"
    notes: list[str] = field(default_factory=list)
    # speculative decoding's proposer (in weights_bytes / kv_bytes_per_token) and the LoRA
    # slot buffers (in weights_bytes): costmodels/spec_decode.py, costmodels/lora.py
    draft_weights_bytes: int = 0
    draft_kv_bytes_per_token: int = 0
    lora_bytes: int = 0
    # cache.kv_cache_memory_bytes: the KV cache's size given, memory profiling skipped
    kv_cache_memory_bytes: int | None = None
    # model.max_model_len auto: the derived length before the fit (None: not auto)
    auto_fit_from: int | None = None
    # --cpu-offload-gb: decoder weights in pinned CPU memory (not in weights_bytes)
    cpu_offload_bytes: int = 0
    # the CUDA graphs vLLM captures: (runtime mode, graphs, largest size in tokens)
    cudagraph_captures: tuple[tuple[str, int, int], ...] = ()

    @property
    def kv_cache_tokens(self) -> int:
        """GPU KV cache size in tokens: num_gpu_blocks · block_size."""
        return self.num_gpu_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens that fit at once: blocks / blocks per request."""
        return self.num_gpu_blocks / self.blocks_per_request

    @property
    def available_kv_gib(self) -> float:
        return self.available_kv_bytes / GIB

    def as_dict(self) -> dict:
        """JSON-friendly dict: every field (bytes, tokens) plus the derived figures."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["notes"] = list(self.notes)
        d.update(
            kv_cache_tokens=self.kv_cache_tokens,
            max_concurrency=self.max_concurrency,
            weights_gib=self.weights_bytes / GIB,
            available_kv_gib=self.available_kv_gib,
            total_gib=self.total_bytes / GIB,
        )
        return d

    def log_lines(self) -> list[str]:
        """The start-up log lines vLLM prints for this plan."""
        g = GIB
        lines = [f"Total CPU offloaded parameters: {format_gib(self.cpu_offload_bytes)}"] if (
            self.cpu_offload_bytes) else []
        lines += [
            f"Model loading took {self.weights_bytes / g:.4f} GiB"
            + (f" (speculative decoding proposer {self.draft_weights_bytes / g:.4f} GiB)"
               if self.draft_weights_bytes else "")
            + (f" (LoRA slots {self.lora_bytes / g:.4f} GiB)" if self.lora_bytes else ""),
            (f"Reserved {self.kv_cache_memory_bytes / g:.2f} GiB memory for KV Cache as "
             "specified by kv_cache_memory_bytes config and skipped memory profiling."
             if self.kv_cache_memory_bytes is not None else
             f"Memory profiling: total_gpu_memory ({self.total_bytes / g:.2f}GiB) x "
            f"gpu_memory_utilization ({self.gpu_memory_utilization:.2f}) = "
            f"{self.requested_bytes / g:.2f}GiB; model weights take "
            f"{self.weights_bytes / g:.2f}GiB; non_torch_memory takes "
            f"{(self.non_torch_bytes + self.comm_bytes) / g:.2f}GiB; PyTorch activation peak "
            f"memory takes {self.activation_peak_bytes / g:.2f}GiB; "
            + (f"the CUDA graph memory estimate takes {self.cudagraph_bytes / g:.2f}GiB; "
               if self.cudagraph_in_kv_budget and self.cudagraph_bytes else "")
            + f"the rest of the memory reserved for KV Cache is "
            f"{self.available_kv_bytes / g:.2f}GiB."),
        ]
        profiled = self.kv_cache_memory_bytes is None and self.cudagraph_bytes > 0
        if profiled:  # GPUModelRunner.profile_cudagraph_memory (info lines)
            lines.append("Profiling CUDA graph memory: " + ", ".join(
                f"{mode}={n} (largest={largest})" for mode, n, largest in self.cudagraph_captures))
            lines.append(f"Estimated CUDA graph memory: {self.cudagraph_bytes / g:.2f} GiB total")
        lines.append(f"Available KV cache memory: {format_gib(self.available_kv_bytes)} GiB")
        if profiled:  # Worker.determine_available_memory
            util = self.gpu_memory_utilization
            delta = self.cudagraph_bytes / self.total_bytes
            suggested = min(round(util + delta, 4), 1.0)
            lines.append(
                "CUDA graph memory profiling is enabled (default since v0.21.0). The current "
                f"--gpu-memory-utilization={util:.4f} is equivalent to "
                f"--gpu-memory-utilization={round(util - delta, 4):.4f} without CUDA graph "
                "memory profiling. To maintain the same effective KV cache size as before, "
                f"increase --gpu-memory-utilization to {suggested:.4f}. To disable, set "
                "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0." if self.cudagraph_in_kv_budget else
                "CUDA graph memory profiling is disabled "
                "(VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0). Without it, CUDA graph memory is "
                "not accounted for during KV cache allocation, which may require lowering "
                "--gpu-memory-utilization to avoid OOM. Consider re-enabling it (the default as "
                f"of v0.21.0) and increasing --gpu-memory-utilization from {util:.4f} to "
                f"{suggested:.4f}.")
        # get_kv_cache_configs: the override, then the auto-fit (against the override's
        # size when there is one), then _report_kv_cache_config
        if self.num_gpu_blocks_override is not None:
            lines.append(f"Overriding num_gpu_blocks={self.num_gpu_blocks_computed} with "
                         f"num_gpu_blocks_override={self.num_gpu_blocks_override}")
        if self.auto_fit_from is not None:
            usable = (self.available_kv_bytes if self.num_gpu_blocks_override is None
                      else self.num_gpu_blocks_override * self.block_bytes)
            lines.append(
                f"Auto-fit max_model_len: reduced from {self.auto_fit_from} to "
                f"{self.max_model_len} to fit in available GPU memory "
                f"({format_gib(usable)} GiB available for KV cache)"
                if self.max_model_len < self.auto_fit_from else
                f"Auto-fit max_model_len: full model context length {self.auto_fit_from} fits "
                "in available GPU memory")
        lines += [
            f"GPU KV cache size: {self.kv_cache_tokens:,} tokens",
            (f"Maximum concurrency for {self.max_model_len:,} tokens per request: "
             f"{self.max_concurrency:.2f}x"),
        ]
        lines.append(f"# GPU blocks: {self.num_gpu_blocks}, # CPU blocks: 0")
        where = ("beside the given KV cache size" if self.kv_cache_memory_bytes is not None
                 else "counted in the KV budget" if self.cudagraph_in_kv_budget
                 else "from the (1 - gpu_memory_utilization) headroom")
        lines.append(f"CUDA graph pool ~{self.cudagraph_bytes / g:.2f} GiB ({where})")
        return lines


def _pad_vocab(v: int, tp: int) -> int:
    """Vocab rows per rank: vLLM pads the vocabulary to a multiple of 64, then shards it."""
    return -(-(-(-v // 64) * 64) // tp)


def pp_layer_ranges(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """vLLM ``get_pp_indices``: L // pp layers per stage, the remainder one each to the
    stages before the last (from the second-to-last backwards)."""
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    out, start = [], 0
    for n in parts:
        out.append((start, start + n))
        start += n
    return out


def _layer_linears(spec: ModelSpec):
    """(attention, dense MLP, MoE) linears of a decoder layer, each in vLLM's parameter order
    (MoE: router gate, shared experts, routed experts)."""
    lins = spec.linears()
    dense = [x for x in lins if x.op in ("gate_up_proj", "down_proj")]
    moe = ([x for x in lins if x.op == "router"] + [x for x in lins if x.op == "shared_experts"]
           + [x for x in lins if x.op == "experts"])
    attn = [x for x in lins if x not in dense and x not in moe]
    return attn, dense, moe


def _linear_bytes(lin, wf: WeightFormat, tp: int) -> float:
    """One layer's parameters of ``lin`` on one TP rank (bytes; experts: all E copies)."""
    n, k = lin.shard(tp)
    wb = wf.bytes_per_param if lin.quantized else ACT_BYTES
    return lin.num_experts * (n * k * wb + (n * ACT_BYTES if lin.bias else 0))


@dataclass(frozen=True)
class UvaOffload:
    """What ``--cpu-offload-gb`` keeps in pinned CPU memory (vLLM ``UVAOffloader``): per
    stage, decoder-layer parameters from the stage's first layer on, in module order
    (attention, then the MLP: dense, or router + shared + routed experts; then norms), until
    the offloaded bytes reach the limit (the last parameter may pass it). ``per_stage``: bytes
    per pipeline stage (on each of its TP ranks); ``layers``: per linear (``Linear.name``), how
    many of its layers, over all stages, are read over the host link."""

    per_stage: tuple[int, ...]
    layers: dict[str, int]

    @property
    def bytes_per_rank(self) -> int:
        """The largest stage's offload (what vLLM logs on that GPU)."""
        return max(self.per_stage, default=0)


def uva_offload(spec: ModelSpec, wf: WeightFormat, tp: int, pp: int,
                limit_gib: float) -> UvaOffload:
    """:class:`UvaOffload` of ``limit_gib`` GiB per GPU (0: none)."""
    limit = limit_gib * GIB
    if limit <= 0:
        return UvaOffload((), {})
    attn, dense, moe = _layer_linears(spec)
    norm = spec.norm_params_per_layer() * ACT_BYTES
    layers: dict[str, int] = {}
    per_stage = []
    for start, end in pp_layer_ranges(spec.num_hidden_layers, pp):
        off = 0.0
        for i in range(start, end):
            if off >= limit:
                break
            for lin in attn + (moe if spec.is_moe_layer(i) else dense):
                if off >= limit:
                    break
                off += _linear_bytes(lin, wf, tp)
                layers[lin.name] = layers.get(lin.name, 0) + 1
            if off < limit:
                off += norm
        per_stage.append(int(off))
    return UvaOffload(tuple(per_stage), layers)


def stage_weight_bytes(spec: ModelSpec, wf: WeightFormat, tp: int = 1,
                       pp: int = 1) -> list[float]:
    """Weights of each pipeline stage on one TP rank (bytes): its decoder layers
    (:func:`pp_layer_ranges`; each layer's MLP dense or MoE by the model's rule) and their
    norms, the vocab-parallel embedding on the first stage, the LM head (none when tied at
    pp = 1) and the final norm on the last, the rotary cos/sin cache on every stage."""
    attn, dense, moe = _layer_linears(spec)
    a = sum(_linear_bytes(x, wf, tp) for x in attn) + spec.norm_params_per_layer() * ACT_BYTES
    d = sum(_linear_bytes(x, wf, tp) for x in dense)
    m = sum(_linear_bytes(x, wf, tp) for x in moe)
    h = spec.hidden_size
    emb = _pad_vocab(spec.vocab_size, tp) * h * ACT_BYTES
    head = 0 if (spec.tie_word_embeddings and pp == 1) else emb
    rope = spec.max_position_embeddings * (spec.rotary_dim or spec.head_dim) * ACT_BYTES
    out = []
    ranges = pp_layer_ranges(spec.num_hidden_layers, pp)
    for r, (start, end) in enumerate(ranges):
        t = sum(a + (m if spec.is_moe_layer(i) else d) for i in range(start, end)) + rope
        if r == 0:
            t += emb
        if r == len(ranges) - 1:
            t += head + h * ACT_BYTES
        out.append(t)
    return out


def gpu_stage_weight_bytes(spec: ModelSpec, wf: WeightFormat, tp: int = 1, pp: int = 1,
                           offload: UvaOffload | None = None) -> list[int]:
    """:func:`stage_weight_bytes` less what ``offload`` (``--cpu-offload-gb``) keeps in CPU
    memory on each stage: the weights on each stage's GPUs (bytes)."""
    stages = stage_weight_bytes(spec, wf, tp, pp)
    if offload is not None and offload.per_stage:
        stages = [w - o for w, o in zip(stages, offload.per_stage)]
    return [int(w) for w in stages]


def weight_bytes_per_rank(spec: ModelSpec, wf: WeightFormat, tp: int = 1, pp: int = 1,
                          offload: UvaOffload | None = None) -> int:
    """Bytes of weights on the most loaded GPU ("Model loading took X GiB"): the largest of
    :func:`gpu_stage_weight_bytes`."""
    return max(gpu_stage_weight_bytes(spec, wf, tp, pp, offload))


def forward_activation_bytes(spec: ModelSpec, tokens: int, tp: int = 1) -> int:
    """Peak live activations of one forward pass over ``tokens`` tokens on one rank (bytes):
    the larger of the attention block (residual, normed input, qkv, attention output) and the
    MLP block (residual, input, gate_up, activation, output; fused-MoE intermediate caches)."""
    h = spec.hidden_size
    nh_r = spec.num_attention_heads // tp
    if spec.is_mla:
        qkv = nh_r * (spec.qk_nope_head_dim + spec.qk_rope_head_dim) + spec.kv_lora_rank + \
            spec.qk_rope_head_dim
        attn_out = nh_r * spec.v_head_dim
    else:
        qkv = (nh_r + 2 * spec.kv_heads_per_rank(tp)) * spec.head_dim
        attn_out = nh_r * spec.head_dim
    attn = 2 * h + qkv + attn_out
    mlp = 0
    if spec.num_dense_layers:
        i_r = -(-spec.intermediate_size // tp)
        mlp = 3 * h + 3 * i_r
    if spec.num_moe_layers:
        im_r = -(-spec.moe_intermediate_size // tp)
        moe = 2 * h + spec.num_experts_per_tok * (3 * im_r + h)
        if spec.shared_expert_intermediate_size:
            moe += 3 * -(-spec.shared_expert_intermediate_size // tp)
        mlp = max(mlp, moe)
    return int(tokens * max(attn, mlp) * ACT_BYTES)


def plan_memory(cfg, coeffs: MemoryCoefficients | None = None) -> MemoryPlan:
    """Resolved ExperimentConfig → :class:`MemoryPlan` (``num_gpu_blocks`` as vLLM computes
    it; ``cache.num_gpu_blocks_override`` honoured).

    Raises CapacityError when the weights do not fit, nothing is left for the KV cache, or
    one max_model_len request does not fit; ConfigError for impossible parallel sizes.
    """
    co = coeffs or MemoryCoefficients()
    spec = load_model_spec(cfg.model)
    hw = load_hardware_spec(cfg.hardware)
    return plan_memory_for(cfg, spec, hw, co)


def plan_memory_for(cfg, spec: ModelSpec, hw: HardwareSpec,
                    co: MemoryCoefficients | None = None,
                    fit_from: int | None = None) -> MemoryPlan:
    """:func:`plan_memory` with the specs already loaded. ``fit_from``: max_model_len auto
    (``resolve_config`` fits it once: a resolved config keeps its fitted length), the derived
    length to fit from; an unresolved auto config (max_model_len -1) is fitted too."""
    co = co or MemoryCoefficients()
    tp = cfg.parallel.tensor_parallel_size
    pp = cfg.parallel.pipeline_parallel_size
    validate_parallel(spec, tp, pp)
    seqs, toks, mml = _resolved(cfg, hw, spec)
    spec.max_len.check(mml, f"model.max_model_len={mml} ({spec.name})")
    wf = resolve_weight_format(cfg.model, spec, hw)
    util = cfg.cache.gpu_memory_utilization
    total = hw.memory_bytes
    requested = math.ceil(total * util)  # (vLLM request_memory)
    offload = uva_offload(spec, wf, tp, pp, getattr(cfg, "cpu_offload_gb", 0.0))
    kvb = kv_cache_dtype_bytes(cfg.cache.cache_dtype)
    draft_w, draft_kv, lora_b = _extra_memory(cfg, spec, hw, wf, tp, kvb)
    stage_w = [w + draft_w + lora_b for w in gpu_stage_weight_bytes(spec, wf, tp, pp, offload)]
    weights = max(stage_w)
    where = (f"{spec.name} on {hw.name} (tensor_parallel_size={tp}, "
             f"pipeline_parallel_size={pp})")
    explicit = getattr(cfg.cache, "kv_cache_memory_bytes", None)
    if explicit is not None and weights >= total:
        parts, fix = _weight_parts(cfg, weights, draft_w, lora_b)
        raise CapacityError(
            f"{where}: model weights take {weights / GIB:.2f} GiB per GPU{parts}, more than "
            f"the {hw.memory_gib:.2f} GiB device; {fix}")
    if explicit is None and weights >= requested:
        parts, fix = _weight_parts(cfg, weights, draft_w, lora_b)
        raise CapacityError(
            f"{where}: model weights take {weights / GIB:.2f} GiB per GPU{parts} but only "
            f"{requested / GIB:.2f} GiB available at gpu_memory_utilization={util} "
            f"({hw.memory_gib:.2f} GiB device); {fix}"
        )
    fwd = forward_activation_bytes(spec, toks, tp)
    per_logit = co.sampler_bytes_per_logit
    if getattr(cfg, "speculative_config", None) is not None:  # + the rejection sampler's pass
        per_logit = max(per_logit, co.rejection_sampler_bytes_per_logit)
    sampler = int(seqs * spec.vocab_size * per_logit)
    # profile_run per pipeline stage: the dummy forward everywhere, the sampler pass on the
    # last stage only; the stages after the first also hold the hidden states + residual they
    # receive (IntermediateTensors of max_num_batched_tokens rows) throughout
    recv = 2 * toks * spec.hidden_size * ACT_BYTES
    acts = [(recv if i else 0) + (max(fwd, sampler) if i == pp - 1 else fwd) for i in range(pp)]
    act = max(acts)  # (reported: the most loaded stage, as the weights)
    comm = co.comm_bytes if tp * pp > 1 else 0
    non_torch = co.non_torch_bytes
    captures = cudagraph_captures(cfg, cudagraph_sizes(cfg, seqs, toks), seqs)
    graphs = cudagraph_pool_bytes(captures, spec, tp, co)
    # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS (default 1 since vLLM 0.21)
    in_budget = explicit is None and getattr(
        cfg.cache, "memory_profiler_estimate_cudagraphs", True)
    bs = cfg.cache.block_size or kv_block_size(spec, hw, cfg.cache.cache_dtype)
    # vLLM get_kv_cache_configs: each stage's KV memory over its own layers' KV bytes; every
    # stage gets the smallest block count (one stage at pp = 1)
    per_layer = spec.kv_elems_per_token_per_layer(tp) * kvb
    fewest = None
    for w_r, a_r, (start, end) in zip(stage_w, acts,
                                      pp_layer_ranges(spec.num_hidden_layers, pp)):
        # ``determine_available_memory``; with kv_cache_memory_bytes the profile run still
        # happens (it compiles the model), then the KV cache gets exactly that, whatever
        # gpu_memory_utilization says
        a_r = explicit if explicit is not None else (
            requested - w_r - a_r - non_torch - comm - (graphs if in_budget else 0))
        t_r = int((end - start) * per_layer) + draft_kv
        if fewest is None or a_r // (bs * t_r) < fewest[0]:
            fewest = (a_r // (bs * t_r), a_r, t_r)
    _, available, per_token = fewest
    block_bytes = bs * per_token
    if available <= 0:
        raise CapacityError(
            f"{where}: No available memory for the cache blocks (weights "
            f"{weights / GIB:.2f} GiB + activation peak {act / GIB:.2f} GiB + non-torch "
            f"{(non_torch + comm) / GIB:.2f} GiB"
            + (f" + CUDA graph estimate {graphs / GIB:.2f} GiB" if in_budget and graphs else "")
            + f" exceed {requested / GIB:.2f} GiB at "
            f"gpu_memory_utilization={util}). Try increasing `gpu_memory_utilization` when "
            "initializing the engine."
        )
    computed = available // block_bytes

    def request_blocks(length: int) -> int:
        """Blocks one request of ``length`` tokens may hold: ceil(length / block_size);
        sliding window (vLLM SlidingWindowSpec.max_admission_blocks_per_request):
        ceil(min(window − 1 + step tokens, length) / block_size) + 1, the window need not
        start at a block boundary (the startup check; at run time a window ≥ max_model_len
        frees nothing and a request holds ceil(length / block_size), as in vLLM)."""
        if spec.sliding_window:  # (vLLM: every window, even one ≥ the length)
            return -(-min(length, spec.sliding_window - 1 + toks) // bs) + 1
        return -(-length // bs)

    override = cfg.cache.num_gpu_blocks_override
    # vLLM 0.22.1 get_kv_cache_configs plans the auto-fit and the one-request check against
    # the override's size when there is one (num_gpu_blocks_override · block bytes)
    usable = available if override is None else override * block_bytes

    def fits(length: int) -> bool:
        return request_blocks(length) * block_bytes <= usable

    if fit_from is None and cfg.model.max_model_len == -1:
        fit_from = mml  # (not resolved yet)
    if fit_from is not None:  # max_model_len auto: the longest that the KV cache holds
        mml = fit_max_model_len(fit_from, fits)
    per_req_blocks = request_blocks(mml)
    needed = per_req_blocks * block_bytes
    if needed > usable:
        est = fit_max_model_len(mml, fits) if fits(1) else 0
        est_msg = (f"Based on the available memory, the estimated maximum model length is "
                   f"{est}. " if est > 0 else "")
        raise CapacityError(
            f"model.max_model_len={mml}: To serve at least one request with the model's max "
            f"seq len ({mml}), ({format_gib(needed)} GiB KV cache is needed, which is larger "
            f"than the available KV cache memory ({format_gib(usable)} GiB). {est_msg}Try "
            "increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
            "initializing the engine."
        )
    blocks = override if override is not None else computed
    if override is not None or explicit is not None:
        # vLLM sizes the KV tensors from the override or the explicit size without checking
        # them against the profile; they must still fit beside the weights and the CUDA-graph
        # pool captured after them, or their allocation (or the capture) fails
        key = ("cache.num_gpu_blocks_override" if override is not None
               else "cache.kv_cache_memory_bytes")
        room = total - weights - non_torch - comm - graphs
        if blocks * block_bytes > room:
            raise CapacityError(
                f"{key}: {blocks} blocks need {blocks * block_bytes / GIB:,.2f} GiB of KV cache, "
                f"more than the {max(room, 0) / GIB:.2f} GiB left on the GPU beside the model "
                f"weights ({weights / GIB:.2f} GiB) and CUDA graphs ({graphs / GIB:.2f} GiB): "
                "allocating them fails (CUDA out of memory)")
    return MemoryPlan(
        model=spec.name, hardware=hw.name, tensor_parallel_size=tp, pipeline_parallel_size=pp,
        total_bytes=total, gpu_memory_utilization=util, requested_bytes=requested,
        weights_bytes=weights, activation_peak_bytes=act, non_torch_bytes=non_torch,
        comm_bytes=comm, cudagraph_bytes=graphs,
        cudagraph_in_kv_budget=in_budget, available_kv_bytes=available,
        block_size=bs, block_bytes=block_bytes, kv_bytes_per_token=per_token,
        num_gpu_blocks=blocks,
        num_gpu_blocks_computed=computed, num_gpu_blocks_override=override,
        max_model_len=mml, blocks_per_request=per_req_blocks, weight_format=wf.name,
        kv_cache_dtype=cfg.cache.cache_dtype, draft_weights_bytes=draft_w,
        draft_kv_bytes_per_token=draft_kv, lora_bytes=lora_b, kv_cache_memory_bytes=explicit,
        auto_fit_from=getattr(cfg.model, "_auto_fit_from", None) or fit_from,
        cpu_offload_bytes=offload.bytes_per_rank, cudagraph_captures=captures,
    )


def cudagraph_captures(cfg, sizes: list[int], max_num_seqs: int
                       ) -> tuple[tuple[str, int, int], ...]:
    """The CUDA graphs vLLM captures (``CudagraphDispatcher.initialize_cudagraph_keys``,
    ``get_capture_descs``): (runtime mode, graphs, largest size in tokens), PIECEWISE first.
    The mixed-batch mode (PIECEWISE; FULL in FULL mode) takes every capture size; FULL decode
    graphs beside it (FULL_AND_PIECEWISE, FULL_DECODE_ONLY) take the uniform decode sizes,
    q ≤ size ≤ q · max_num_seqs (q = 1 + speculative tokens). Each once per LoRA case: one
    without LoRA; with LoRA, without and with adapters (``_get_lora_cases`` with vLLM's
    ``cudagraph_specialize_lora``: [0, max_loras + 1])."""
    if not sizes:
        return ()
    mode = resolved_cudagraph_mode(cfg)
    scfg = getattr(cfg, "speculative_config", None)
    q = 1 + (scfg.num_speculative_tokens if scfg is not None else 0)
    lc = getattr(cfg, "lora", None)
    cases = 2 if lc is not None and lc.enable_lora else 1
    out = []
    if mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        out.append(("PIECEWISE", len(sizes) * cases, sizes[-1]))
    if mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"):
        dec = full_decode_sizes(sizes, q, max_num_seqs)
        if dec:
            out.append(("FULL", len(dec) * cases, dec[-1]))
    elif mode == "FULL":
        out.append(("FULL", len(sizes) * cases, sizes[-1]))
    return tuple(out)


def cudagraph_pool_bytes(captures, spec: ModelSpec, tp: int,
                         co: MemoryCoefficients | None = None) -> int:
    """vLLM's CUDA-graph memory estimate (``GPUModelRunner.profile_cudagraph_memory``, bytes):
    each mode's first capture (its largest size) overlays the others in the shared pool, each
    further graph adds its own: max over modes (activations of the largest size + g) + Σ g ·
    (graphs − 1), g = ``cudagraph_bytes_per_graph``."""
    if not captures:
        return 0
    g = (co or MemoryCoefficients()).cudagraph_bytes_per_graph
    first = max(forward_activation_bytes(spec, largest, tp) for _, _, largest in captures)
    return first + g + sum(g * (n - 1) for _, n, _ in captures)


def format_gib(b: float) -> str:
    """vLLM ``mem_utils.format_gib``: GiB rounded to 2 decimals, as Python prints the float
    (``16.0``, ``1.96``, ``0.2``)."""
    return f"{round(b / GIB, 2)}"


def fit_max_model_len(derived: int, fits) -> int:
    """vLLM ``_auto_fit_max_model_len``: the largest length in [1, ``derived``] for which
    ``fits(length)`` (one request's blocks fit the KV cache), by binary search; CapacityError
    when not even one token fits."""
    if not fits(1):
        raise CapacityError(
            "model.max_model_len: Cannot auto-fit max_model_len: not enough GPU memory "
            "available to serve even a single token. Try increasing `gpu_memory_utilization`.")
    lo, hi, best = 1, derived, 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def _weight_parts(cfg, weights: int, draft_w: int, lora_b: int) -> tuple[str, str]:
    """For a weights-do-not-fit error: " (x GiB model + y GiB ...)" naming the keys of what
    speculative_config and lora add (empty when they add nothing), and what to change."""
    fix = "raise parallel.tensor_parallel_size, quantize the model, or use a larger GPU"
    if not draft_w and not lora_b:
        return "", fix
    parts = [f"{(weights - draft_w - lora_b) / GIB:.2f} GiB model"]
    fixes = []
    if draft_w:
        scfg = cfg.speculative_config
        what = f"speculative_config.model {scfg.model}" if scfg.model else (
            f"speculative_config.method {scfg.method} drafter")
        parts.append(f"{draft_w / GIB:.2f} GiB {what}")
        fixes.append("a smaller speculative_config.model" if scfg.model else "")
    if lora_b:
        lc = cfg.lora
        parts.append(f"{lora_b / GIB:.2f} GiB LoRA slots (lora.max_loras={lc.max_loras}, "
                     f"max_lora_rank={lc.max_lora_rank})")
        fixes.append("fewer lora.max_loras or a lower max_lora_rank")
    fixes = [f for f in fixes if f]
    return f" ({' + '.join(parts)})", (f"use {' or '.join(fixes)}, or {fix}" if fixes else fix)


def _extra_memory(cfg, spec: ModelSpec, hw: HardwareSpec, wf: WeightFormat, tp: int,
                  kvb: float) -> tuple[int, int, int]:
    """(proposer weights per rank, proposer KV bytes per token per rank, LoRA slot bytes per
    rank): what ``speculative_config`` and ``lora`` add to the memory plan. vLLM loads the
    drafter with the model and gives its attention layers KV in the same block tables; the
    LoRA stacked buffers are allocated at model load (both before the KV cache is sized)."""
    draft_w = draft_kv = lora_b = 0
    scfg = getattr(cfg, "speculative_config", None)
    if scfg is not None:
        from servesim.costmodels.spec_decode import build_drafter, drafter_memory

        draft_w, draft_kv = drafter_memory(build_drafter(scfg, spec, wf, hw), spec, tp, kvb)
    lc = getattr(cfg, "lora", None)
    if lc is not None and lc.enable_lora:
        from servesim.costmodels.lora import slot_bytes_per_rank

        lora_b = slot_bytes_per_rank(spec, lc.max_loras, lc.max_lora_rank, tp,
                                     lc.target_modules, lc.fully_sharded_loras)
    return draft_w, draft_kv, lora_b
