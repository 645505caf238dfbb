"""vLLM engine start-up defaults and checks, as ``EngineArgs`` / ``VllmConfig`` resolve them:
the scheduler limits (``max_num_seqs``, ``max_num_batched_tokens``), the CUDA-graph mode and
capture sizes (with ``-O``/``--optimization-level`` and ``--performance-mode``) and the
tensor/pipeline-parallel layout checks."""

from __future__ import annotations

from servesim.costmodels.specs import HardwareSpec, ModelSpec
from servesim.simulator.errors import ConfigError


def scheduler_defaults(hw: HardwareSpec) -> tuple[int, int]:
    """vLLM's API-server defaults (max_num_seqs, max_num_batched_tokens): 1024 / 8192 on GPUs
    with ≥ 70 GiB that are not A100s, else 256 / 2048 (ecosystem-formats.md §3)."""
    if hw.memory_gib >= 70 and not hw.is_a100:
        return 1024, 8192
    return 256, 2048


def batch_limits(hw: HardwareSpec, max_num_seqs: int | None, max_num_batched_tokens: int | None,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 performance_mode: str = "balanced") -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) as vLLM's
    ``EngineArgs._set_default_max_num_seqs_and_batched_tokens_args`` fills unset ones: the
    hardware defaults (:func:`scheduler_defaults`), each doubled with ``--performance-mode
    throughput``; an unset token budget is at least max_model_len without chunked prefill and
    at most max_num_seqs · max_model_len; an unset max_num_seqs is at most the token budget."""
    seq_default, tok_default = scheduler_defaults(hw)
    if performance_mode == "throughput":
        seq_default, tok_default = 2 * seq_default, 2 * tok_default
    seqs = max_num_seqs if max_num_seqs is not None else seq_default
    toks = max_num_batched_tokens
    if toks is None:
        toks = tok_default
        if not enable_chunked_prefill:
            toks = max(max_model_len, toks)
        toks = min(seqs * max_model_len, toks)
    if max_num_seqs is None:
        seqs = min(seqs, toks)
    return seqs, toks


def kv_block_size(spec: ModelSpec, hw: HardwareSpec, cache_dtype: str = "auto") -> int:
    """vLLM 0.22.1's KV block size (tokens) when ``--block-size`` is unset: 16
    (``CacheConfig.DEFAULT_BLOCK_SIZE``), unless the attention backend it selects
    (``CudaPlatform`` priorities, first valid) does not take 16 and prefers its smallest size
    (``Platform._find_non_ssm_backend`` → ``get_preferred_block_size``). That happens for MLA
    models only:

    - Blackwell (compute capability 10.x): FlashInfer-MLA (qk_nope_head_dim 64, 128 or 192;
      sizes 32, 64) → 32; else CUTLASS-MLA (128) → 128;
    - Hopper (9.x): FlashAttention-MLA (16-bit KV only; multiples of 16) → 16; with an fp8 KV
      cache FlashMLA (64) → 64;
    - other GPUs, or an MLA head size (kv_lora_rank + qk_rope_head_dim) other than 320 or 576
      that only Triton-MLA serves: multiples of 16 → 16.

    Non-MLA backends take 16 everywhere. No MLA backend takes an fp8_e5m2 KV cache: vLLM
    finds no attention backend and stops (refused here)."""
    if spec.is_mla and cache_dtype == "fp8_e5m2":
        raise ConfigError(
            f"cache.cache_dtype: fp8_e5m2: no MLA attention backend of vLLM 0.22.1 takes it "
            f"for {spec.name} (No valid attention backend found); use fp8 (fp8_e4m3) or auto")
    cc = hw.compute_capability
    if not spec.is_mla or cc is None or spec.kv_lora_rank + spec.qk_rope_head_dim not in (320, 576):
        return 16
    if int(cc) == 10:
        return 32 if spec.qk_nope_head_dim in (64, 128, 192) else 128
    if int(cc) == 9 and cache_dtype.startswith("fp8"):
        return 64
    return 16


# -O / --optimization-level → the CUDA-graph mode it sets when none is given
# (vLLM ``OPTIMIZATION_LEVEL_00`` .. ``_03``)
LEVEL_CUDAGRAPH_MODE = {0: "NONE", 1: "PIECEWISE", 2: "FULL_AND_PIECEWISE", 3: "FULL_AND_PIECEWISE"}


def cudagraph_mode(mode: str | None, optimization_level: int = 2) -> str:
    """vLLM's CUDA-graph mode (``VllmConfig.__post_init__``): an unset mode is the optimization
    level's (:data:`LEVEL_CUDAGRAPH_MODE`); at -O0 nothing is compiled
    (``CompilationMode.NONE``), and a mode with piecewise graphs (PIECEWISE,
    FULL_AND_PIECEWISE: they replay the compiled graph's pieces) becomes NONE. (``--enforce-eager``
    turns graphs off as well; the cost and memory models read it on its own.)"""
    if mode is None:
        mode = LEVEL_CUDAGRAPH_MODE[optimization_level]
    if optimization_level == 0 and mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        return "NONE"
    return mode


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int,
                  max_capture: int | None = None, sizes: list[int] | None = None,
                  decode_query_len: int = 1, interactivity: bool = False) -> list[int]:
    """vLLM's CUDA-graph capture sizes in tokens (``VllmConfig._set_cudagraph_sizes``):
    max = min(max_num_batched_tokens, max_cudagraph_capture_size or min(2 · max_num_seqs ·
    decode_query_len, 512)); sizes ``[1, 2, 4] + range(8, min(max + 1, 256), 8) +
    range(256, max + 1, 16)`` (``--performance-mode interactivity``: every size from 1 to
    min(max, 32) instead of [1, 2, 4]), plus max_num_batched_tokens itself when it is ≤ max. A
    configured list is only filtered by max_num_batched_tokens."""
    if sizes:
        return sorted({int(s) for s in sizes if s <= max_num_batched_tokens})
    top = max_capture if max_capture is not None else min(
        2 * max_num_seqs * decode_query_len, 512)
    top = min(top, max_num_batched_tokens)
    if interactivity:
        out = list(range(1, min(top, 32) + 1))
    else:
        out = [i for i in (1, 2, 4) if i <= top]
    if top >= 8:
        out += range(8, min(top + 1, 256), 8)
    if top >= 256:
        out += range(256, top + 1, 16)
    if max_num_batched_tokens <= top:
        out.append(max_num_batched_tokens)
    return sorted(set(out))


def validate_parallel(spec: ModelSpec, tp: int, pp: int) -> None:
    """vLLM's checks: TP divides the attention heads; KV heads divide or are divided by TP."""
    if spec.num_attention_heads % tp:
        raise ConfigError(
            f"parallel.tensor_parallel_size={tp} does not divide num_attention_heads="
            f"{spec.num_attention_heads} of {spec.name}"
        )
    nkv = spec.num_key_value_heads
    if not spec.is_mla and (nkv % tp if tp <= nkv else tp % nkv):
        raise ConfigError(
            f"parallel.tensor_parallel_size={tp} is incompatible with num_key_value_heads="
            f"{nkv} of {spec.name} (one must divide the other)"
        )
    if pp > spec.num_hidden_layers:
        raise ConfigError(
            f"parallel.pipeline_parallel_size={pp} exceeds num_hidden_layers="
            f"{spec.num_hidden_layers} of {spec.name}"
        )


def _resolved(cfg, hw: HardwareSpec, spec: ModelSpec) -> tuple[int, int, int]:
    """(max_num_seqs, max_num_batched_tokens, max_model_len), filling vLLM defaults when the
    config has not been through ``resolve_config`` yet."""
    sc = cfg.scheduler
    mml = cfg.model.max_model_len
    mml = spec.max_len.default if mml is None or mml == -1 else mml  # (-1: auto, not yet fit)
    seqs, toks = batch_limits(hw, sc.max_num_seqs, sc.max_num_batched_tokens, mml,
                              sc.enable_chunked_prefill, getattr(cfg, "performance_mode",
                                                                 "balanced"))
    return seqs, toks, mml


def resolved_cudagraph_mode(cfg) -> str:
    """:func:`cudagraph_mode` of an experiment config (resolved or not)."""
    return cudagraph_mode(cfg.compilation.cudagraph_mode, getattr(cfg, "optimization_level", 2))


def cudagraph_sizes(cfg, max_num_seqs: int, max_num_batched_tokens: int,
                    spec_rounding: bool = True) -> list[int]:
    """The CUDA-graph capture sizes (tokens) of an experiment config, resolved or not; [] when
    graphs are off (mode NONE, ``enforce_eager``): :func:`capture_sizes` with the config's
    settings, then (``spec_rounding``), with speculative decoding and FULL decode graphs,
    rounded to multiples of 1 + k (``adjust_cudagraph_sizes_for_spec_decode``)."""
    mode = resolved_cudagraph_mode(cfg)
    if mode == "NONE" or cfg.model.enforce_eager:
        return []
    comp = cfg.compilation
    scfg = getattr(cfg, "speculative_config", None)
    k = scfg.num_speculative_tokens if scfg is not None else 0
    sizes = capture_sizes(max_num_seqs, max_num_batched_tokens, comp.max_cudagraph_capture_size,
                          comp.cudagraph_capture_sizes, decode_query_len=1 + k,
                          interactivity=getattr(cfg, "performance_mode", "") == "interactivity")
    if k and mode != "PIECEWISE" and spec_rounding:
        from servesim.costmodels.spec_decode import adjust_cudagraph_sizes_for_spec_decode

        sizes = adjust_cudagraph_sizes_for_spec_decode(sizes, 1 + k, sizes[-1] if sizes else 0)
    return sizes


# vLLM 0.22.1 VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD (envs.py): up to this many tokens a MoE
# layer's shared experts run on an aux CUDA stream (fused_moe/runner/shared_experts.py)
SHARED_EXPERTS_STREAM_TOKENS = 256


def shared_experts_stream_tokens(hw: HardwareSpec, spec: ModelSpec) -> int:
    """Largest (padded) token count at which vLLM overlaps the shared experts with the router
    and routed experts (``SharedExpertsOrder.MULTI_STREAM_OVERLAPPED``: CUDA only, so not on
    ROCm; models with shared experts); 0: never."""
    if not (spec.num_moe_layers and spec.shared_expert_intermediate_size):
        return 0
    return SHARED_EXPERTS_STREAM_TOKENS if hw.compute_capability is not None else 0


# vLLM 0.22.1 FI_ALLREDUCE_FUSION_MAX_SIZE_MB (compilation/passes/fusion/allreduce_rms_fusion.py,
# the table PassConfig.flashinfer_max_size reads): {capability as an int: {TP: MiB}}
_AR_RMS_FUSION_MAX_MB = {90: {2: 64, 4: 2, 8: 0.5}, 100: {2: 64, 4: 32, 8: 1},
                         103: {2: 64, 4: 64, 8: 2}}


def allreduce_rms_fusion_tokens(cfg, hw: HardwareSpec, spec: ModelSpec) -> int:
    """Largest padded batch (tokens) whose all-reduces vLLM fuses with the RMSNorm after them
    (-O2/-O3 ``fuse_allreduce_rms``, ``enable_allreduce_rms_fusion``: TP > 1 on compute
    capability 9.0 or 10.x with FlashInfer, compiled; ``AllReduceFusionPass`` over the
    compile range up to ``flashinfer_max_size(tp) // (hidden · 2 bytes)``); 0: never (TP 1,
    other GPUs, TP not 2/4/8, -O0/-O1, ``enforce_eager``)."""
    tp = cfg.parallel.tensor_parallel_size
    cc = hw.compute_capability
    if (tp == 1 or cc is None or cfg.model.enforce_eager
            or getattr(cfg, "optimization_level", 2) < 2):
        return 0
    if not (cc == 9.0 or 10.0 <= cc < 11.0):  # (is_device_capability(90) / family(100))
        return 0
    mb = _AR_RMS_FUSION_MAX_MB.get(round(cc * 10), {}).get(tp)  # (capability.to_int())
    return 0 if mb is None else int(mb * 2**20) // (spec.hidden_size * 2)


def full_decode_sizes(sizes: list[int], decode_query_len: int, max_num_seqs: int) -> list[int]:
    """The capture sizes that get a FULL decode graph beside a mixed mode (FULL_AND_PIECEWISE,
    FULL_DECODE_ONLY): uniform decode batches of q…q·max_num_seqs tokens, q = 1 + speculative
    tokens (vLLM ``CudagraphDispatcher.initialize_cudagraph_keys``)."""
    q = decode_query_len
    return [s for s in sizes if q <= s <= q * max_num_seqs]


__all__ = [
    "LEVEL_CUDAGRAPH_MODE",
    "allreduce_rms_fusion_tokens",
    "batch_limits",
    "capture_sizes",
    "cudagraph_mode",
    "cudagraph_sizes",
    "full_decode_sizes",
    "kv_block_size",
    "resolved_cudagraph_mode",
    "scheduler_defaults",
    "validate_parallel",
]
