"""Speculative decoding's price, as vLLM 0.22.1 runs it (``v1/spec_decode/``,
``GPUModelRunner``, ``VllmConfig``, ``CompilationConfig``).

One engine step with spec decode does, on the GPU:

1. the target's *verification* forward. Every decode row carries 1 + k query tokens (its
   new token and its k drafts, ``scheduled_spec_decode_tokens``); :class:`StepCostModel`
   charges them from the :class:`BatchShape` (``num_spec_tokens``): GEMMs over all tokens,
   attention with query length 1 + k that reads each row's KV once, logits and the
   rejection sampler over every draft position. CUDA graphs as vLLM: a decode batch whose
   rows all have 1 + k tokens (``uniform_decode_query_len``) replays the FULL decode graph,
   any other batch the PIECEWISE one, and the capture sizes are rounded up to multiples of
   1 + k (:func:`adjust_cudagraph_sizes_for_spec_decode`).
2. the *proposer* for the next step (:func:`attach_proposer`, a ``step_extensions`` term):

   - ``eagle`` / ``eagle3`` / ``mtp`` (``SpecDecodeBaseProposer.propose``): a one-layer head
     runs a first pass over every token the target just processed (it needs its own KV for
     them), samples one draft per request, then ``k − 1`` passes of one token per request,
     each with an LM head over the batch's rows. The head is the target's layer shapes
     (EAGLE-1: + ``fc`` 2h→h, LM head shared; EAGLE-3: + ``fc`` 3h→h and its own LM head
     over ``draft_vocab_size``; MTP: the model's own next-token layer — MoE for DeepSeek —
     + ``eh_proj`` 2h→h, LM head shared), or the head's own ``config.json`` when
     ``speculative_config.model`` names one. The drafter's CUDA graphs are PIECEWISE only
     (``SpecDecodeBaseProposer.initialize_cudagraph_keys``).
   - ``draft_model`` (``DraftModelProposer``): the same loop through a whole second model
     (same TP as the target, as vLLM requires), one extra slot per request in the first pass
     (``max_num_new_slots_for_drafting``).
   - ``medusa``: k heads (ResBlock h→h + LM head) over the rows, once.
   - ``ngram`` / ``suffix``: CPU (numba KMP over each request's tokens): host time per row
     and per context token — with async scheduling off (vLLM turns it off for these), it
     adds to every step. ``ngram_gpu``: one small GPU kernel over the token histories.

Memory (:func:`drafter_memory`): the proposer's weights load with the model and its layers'
KV lives in the same block tables, so every KV block grows by the drafter's bytes per token.
Coefficients for the CPU proposers are priors (:class:`ProposerHost`), not measurements.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from servesim.costmodels.batch import BatchShape, OpCost
from servesim.costmodels.quant import ACT_BYTES, WeightFormat
from servesim.costmodels.specs import Linear, ModelSpec
from servesim.simulator.errors import ConfigError

# vLLM SpeculativeConfig.use_eagle(): heads over the target's hidden states
EAGLE_METHODS = ("eagle", "eagle3", "mtp")
MODEL_METHODS = EAGLE_METHODS + ("draft_model",)
CPU_METHODS = ("ngram", "suffix")
HEAD_METHODS = ("medusa",)
METHODS = MODEL_METHODS + CPU_METHODS + HEAD_METHODS + ("ngram_gpu",)
# VllmConfig.__post_init__: async_scheduling=None stays on only for EagleModelTypes and
# NgramGPUTypes; explicitly on, draft_model is allowed too; any other method is an error.
ASYNC_DEFAULT_METHODS = EAGLE_METHODS + ("ngram_gpu",)
ASYNC_ALLOWED_METHODS = ASYNC_DEFAULT_METHODS + ("draft_model",)
EAGLE3_DRAFT_VOCAB = 32000  # draft_vocab_size of the published EAGLE-3 Llama heads


def num_lookahead_tokens(method: str, k: int) -> int:
    """vLLM ``Scheduler.__init__``: KV slots reserved past the scheduled tokens for the
    drafter's own forward passes — k for EAGLE-style heads and draft models, else 0."""
    return k if method in MODEL_METHODS else 0


def max_num_scheduled_tokens(method: str | None, max_num_batched_tokens: int,
                             max_num_seqs: int) -> int:
    """The scheduler's token budget (vLLM ``VllmConfig._set_max_num_scheduled_tokens``):
    max_num_batched_tokens less ``SpeculativeConfig.max_num_new_slots_for_drafting`` per
    seat: one for a separate draft model (its proposer adds a slot per request to the batch),
    none for the other methods or without speculative decoding (parallel drafting, which would
    add k − 1, belongs to methods servesim does not model)."""
    slots = 1 if method == "draft_model" else 0
    return max_num_batched_tokens - slots * max_num_seqs


def adjust_cudagraph_sizes_for_spec_decode(sizes: list[int], uniform_decode_query_len: int,
                                           max_size: int) -> list[int]:
    """``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``: capture sizes rounded up
    to multiples of 1 + k, those above the maximum dropped (``[1 + k]`` if that alone fits).
    Applies when the decode graph mode is FULL."""
    q = uniform_decode_query_len
    if not sizes or q <= 1:
        return list(sizes)
    rounded = sorted({-(-s // q) * q for s in sizes if -(-s // q) * q <= max_size})
    if not rounded and q <= max_size:
        rounded = [q]
    if not rounded:
        raise ConfigError(
            f"compilation.cudagraph_capture_sizes: no valid CUDA-graph sizes after rounding to "
            f"a multiple of num_speculative_tokens + 1 = {q}; adjust "
            f"speculative_config.num_speculative_tokens or max_cudagraph_capture_size "
            f"({max_size})")
    return rounded


# ---------------------------------------------------------------------------------------------
# The drafter's shapes


@dataclass(frozen=True)
class Drafter:
    """What a proposer runs: ``spec`` (a one-layer head or a draft model; None for the CPU,
    GPU-ngram and Medusa proposers), its extra input projection (``fc`` / ``eh_proj``),
    whether it owns its LM head and embedding weights, and how many sequential passes
    (``k`` for EAGLE/MTP/draft models)."""

    method: str
    k: int
    spec: ModelSpec | None
    extra: tuple[Linear, ...] = ()
    own_lm_head: bool = False
    own_embedding: bool = False
    weight_format: WeightFormat | None = None
    first_pass_extra_tokens: int = 0  # per request (draft model: one new slot)


def _head_spec(target: ModelSpec, method: str, vocab: int) -> ModelSpec:
    """The target's decoder layer as a one-layer model (EAGLE: dense; MTP: the real layer,
    MoE included)."""
    common = {"name": f"{target.name}-{method}-head", "num_hidden_layers": 1,
              "vocab_size": vocab, "tie_word_embeddings": False, "quant_method": None,
              "weight_block_size": None}
    if method == "mtp":
        return dataclasses.replace(target, first_k_dense_replace=0, moe_layer_freq=1, **common)
    return dataclasses.replace(
        target, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
        num_shared_experts=0, shared_expert_intermediate_size=0, first_k_dense_replace=0,
        **common)


def build_drafter(scfg, target: ModelSpec, target_wf: WeightFormat, hw) -> Drafter:
    """``speculative_config`` → :class:`Drafter` (shapes only; no cost yet)."""
    from servesim.costmodels.config import ModelConfig
    from servesim.costmodels.quant import resolve_weight_format
    from servesim.costmodels.specs import load_model_spec

    method, k = scfg.method, scfg.num_speculative_tokens
    h = target.hidden_size
    bf16 = WeightFormat("bf16", 2.0, "bf16")
    if method in ("eagle", "eagle3"):
        head = None
        if scfg.model:
            try:
                head = load_model_spec(ModelConfig(name=scfg.model))
            except ConfigError:
                head = None  # a Hugging Face repo id: the head is derived from the target
        n_in = 3 * h if method == "eagle3" else 2 * h
        if head is None:
            vocab = min(EAGLE3_DRAFT_VOCAB, target.vocab_size) if method == "eagle3" \
                else target.vocab_size
            head = _head_spec(target, method, vocab)
        else:
            vocab = int(head.raw.get("draft_vocab_size") or head.vocab_size)
            head = dataclasses.replace(head, vocab_size=vocab, num_hidden_layers=max(
                1, head.num_hidden_layers))
        fc = Linear("fc", "fc", n_in, head.hidden_size, 1, "replicated", quantized=False)
        return Drafter(method, k, head, (fc,), own_lm_head=method == "eagle3",
                       weight_format=bf16)
    if method == "mtp":
        if not int(target.raw.get("num_nextn_predict_layers") or 0):
            raise ConfigError(
                f"speculative_config.method: mtp needs a model with multi-token-prediction "
                f"layers (num_nextn_predict_layers in its config.json); {target.name} has none")
        head = _head_spec(target, "mtp", target.vocab_size)
        eh = Linear("eh_proj", "eh_proj", 2 * h, h, 1, "replicated", quantized=False)
        return Drafter(method, k, head, (eh,), weight_format=target_wf)
    if method == "draft_model":
        if not scfg.model:
            raise ConfigError("speculative_config.model: required for method draft_model "
                              "(a file in configs/models/ or a path to a config.json)")
        dcfg = ModelConfig(name=scfg.model, quantization=getattr(scfg, "quantization", None)
                           or "none")
        try:
            draft = load_model_spec(dcfg)
        except ConfigError as e:  # (its message names model.name: the draft's key here)
            why = str(e).split(": ", 1)[-1] if str(e).startswith("model.") else str(e)
            raise ConfigError(f"speculative_config.model: {why}") from None
        if draft.vocab_size != target.vocab_size:
            raise ConfigError(
                f"speculative_config.model: Target and draft model should have the same "
                f"vocabulary size. Target model vocab_size={target.vocab_size}. Draft model "
                f"vocab_size={draft.vocab_size}.")
        return Drafter(method, k, draft, own_lm_head=True, own_embedding=True,
                       weight_format=resolve_weight_format(dcfg, draft, hw),
                       first_pass_extra_tokens=1)
    return Drafter(method, k, None)


def drafter_memory(d: Drafter, target: ModelSpec, tp: int,
                   kv_dtype_bytes: float) -> tuple[int, int]:
    """(weight bytes per rank, KV bytes per token per rank) the proposer adds."""
    from servesim.costmodels.memory import _pad_vocab, weight_bytes_per_rank

    h = target.hidden_size
    if d.method in HEAD_METHODS:  # k × (ResBlock h×h + vocab-parallel LM head)
        return int(d.k * (h * h + h + _pad_vocab(target.vocab_size, tp) * h) * ACT_BYTES), 0
    if d.spec is None:
        return 0, 0
    s = d.spec
    kv = int(s.kv_bytes_per_token(kv_dtype_bytes, tp, 1))
    if d.method == "draft_model":
        return weight_bytes_per_rank(s, d.weight_format, tp, 1), kv
    wf = d.weight_format
    total = 0.0
    for lin in s.linears():
        n, k = lin.shard(tp)
        wb = wf.bytes_per_param if lin.quantized else ACT_BYTES
        total += lin.num_experts * (n * k * wb + (n * ACT_BYTES if lin.bias else 0)) * lin.layers
    for lin in d.extra:
        total += lin.k * lin.n * ACT_BYTES
    total += (s.norm_params_per_layer() * s.num_hidden_layers + 2 * s.hidden_size) * ACT_BYTES
    if d.own_lm_head:
        total += _pad_vocab(s.vocab_size, tp) * s.hidden_size * ACT_BYTES
    return int(total), kv


# ---------------------------------------------------------------------------------------------
# Per-step cost terms (StepCostModel.step_extensions)


@dataclass(frozen=True)
class ProposerHost:
    """Host-time priors for proposers that run on the CPU (seconds): vLLM's n-gram proposer
    is a numba KMP over each decoding request's tokens (``NgramProposer.propose``), suffix
    decoding walks and updates suffix trees per request; the GPU n-gram kernel costs a fixed
    launch plus a pass over the token histories."""

    ngram_per_request_s: float = 3e-6
    ngram_per_token_s: float = 0.5e-9
    suffix_per_request_s: float = 25e-6
    ngram_gpu_fixed_s: float = 30e-6


class ModelProposer:
    """EAGLE / EAGLE-3 / MTP / draft-model proposer: a first pass over the batch's tokens,
    then ``k − 1`` one-token passes over its rows, through ``drafter`` (a StepCostModel of the
    head or draft model with PIECEWISE graphs and no host terms of its own)."""

    name = "drafter"

    def __init__(self, d: Drafter, drafter):
        self.d = d
        self.model = drafter
        self._extra_cache: dict[int, float] = {}

    def _extra(self, T: int) -> float:
        got = self._extra_cache.get(T)
        if got is None:
            m = self.model
            got = 0.0
            for lin in self.d.extra:
                n, k = lin.shard(m.tp)
                got += m._gemm_op(lin.op, lin, n, k, T).seconds
            self._extra_cache[T] = got
        return got

    def passes(self, batch: BatchShape) -> list[BatchShape]:
        """The drafter's forward passes for the target batch ``batch``."""
        R = batch.num_decode + len(batch.prefill_new_tokens)
        if not R:
            return []
        x = self.d.first_pass_extra_tokens * R
        first = BatchShape(batch.num_decode, batch.decode_context_sum, batch.decode_context_max,
                           batch.prefill_new_tokens, batch.prefill_context, R,
                           batch.num_spec_tokens + x)
        out = [first]
        if self.d.k > 1:
            base = batch.decode_context_sum + batch.num_spec_tokens + sum(
                batch.prefill_new_tokens) + sum(batch.prefill_context)
            top = max([batch.decode_context_max + batch.num_spec_tokens]
                      + [p + c for p, c in zip(batch.prefill_context, batch.prefill_new_tokens)])
            for j in range(1, self.d.k):
                out.append(BatchShape(R, base + j * R, top + j, (), (), R))
        return out

    def __call__(self, batch: BatchShape) -> tuple[float, float]:
        ps = self.passes(batch)
        if not ps:
            return 0.0, 0.0
        step = self.model.step_seconds
        t = 0.0
        for p in ps:
            t += step(p)
        if self.d.extra:
            t += self._extra(ps[0].num_tokens) + (len(ps) - 1) * self._extra(ps[0].num_reqs)
        return t, 0.0

    def ops(self, batch: BatchShape) -> list[OpCost]:
        ps = self.passes(batch)
        if not ps:
            return []
        seconds, _ = self(batch)
        flops = nbytes = 0.0
        provs = set()
        for p in ps:
            for op in self.model.step_time(p).breakdown:
                flops += op.flops
                nbytes += op.bytes
                if op.bound != "host":
                    provs.add(op.provenance)
        m = self.model
        bound = "compute" if flops / m.peak > nbytes / m.bw else "memory"
        roof = max(flops / m.peak, nbytes / m.bw)
        prov = min(provs, key=lambda x: (x.startswith("calibration:"), x)) if provs else "default"
        return [OpCost(f"{self.name}.{self.d.method}", len(ps), seconds, flops, nbytes, bound,
                       roof / seconds if seconds else 0.0, prov)]


class HeadProposer:
    """Medusa / MLP speculator: k heads (a ResBlock h→h and an LM head each) over the rows,
    in one go (``MedusaProposer.propose``)."""

    name = "drafter"

    def __init__(self, target, k: int, method: str):
        self.target, self.k, self.method = target, k, method
        h = target.spec.hidden_size
        self._res = Linear("medusa.resblock", "medusa", h, h, 1, "replicated", bias=True,
                           quantized=False)
        self._cache: dict[int, list[OpCost]] = {}

    def _ops(self, R: int) -> list[OpCost]:
        got = self._cache.get(R)
        if got is None:
            t = self.target
            res = t._gemm_op("medusa.resblock", self._res, self._res.n, self._res.k, R)
            head = t.head_ops(R)[0]  # the LM head GEMM (argmax instead of the sampler)
            got = [OpCost(f"drafter.{self.method}", self.k, self.k * (res.seconds +
                          head.seconds), self.k * (res.flops + head.flops),
                          self.k * (res.bytes + head.bytes), head.bound, head.efficiency,
                          head.provenance)]
            self._cache[R] = got
        return got

    def __call__(self, batch: BatchShape) -> tuple[float, float]:
        R = batch.num_decode + len(batch.prefill_new_tokens)
        return (self._ops(R)[0].seconds, 0.0) if R else (0.0, 0.0)

    def ops(self, batch: BatchShape) -> list[OpCost]:
        R = batch.num_decode + len(batch.prefill_new_tokens)
        return list(self._ops(R)) if R else []


class HostProposer:
    """``ngram`` / ``suffix`` (CPU) and ``ngram_gpu`` (one GPU kernel) proposers."""

    name = "drafter"

    def __init__(self, method: str, bw: float, host: ProposerHost = ProposerHost()):
        self.method, self.bw, self.h = method, bw, host

    def __call__(self, batch: BatchShape) -> tuple[float, float]:
        R = batch.num_decode + len(batch.prefill_new_tokens)
        if not R:
            return 0.0, 0.0
        h = self.h
        ctx = batch.decode_context_sum + sum(batch.prefill_context) + sum(
            batch.prefill_new_tokens)
        if self.method == "ngram_gpu":
            return h.ngram_gpu_fixed_s + 4.0 * ctx / self.bw, 0.0
        if self.method == "suffix":
            return 0.0, h.suffix_per_request_s * R
        return 0.0, h.ngram_per_request_s * R + h.ngram_per_token_s * ctx

    def ops(self, batch: BatchShape) -> list[OpCost]:
        g, _ = self(batch)
        if self.method != "ngram_gpu" or not g:
            return []
        return [OpCost("drafter.ngram_gpu", 1, g, 0.0, g * self.bw, "memory", 1.0, "default")]


def attach_proposer(model, cfg, drafter_override=None) -> None:
    """Give ``model`` (the target's StepCostModel) the proposer term of
    ``cfg.speculative_config`` (no-op without one)."""
    scfg = getattr(cfg, "speculative_config", None)
    if scfg is None:
        return
    from servesim.costmodels.step import HostOverhead, StepCostModel

    d = drafter_override or build_drafter(scfg, model.spec, model.weight_format, model.hw)
    if d.method in MODEL_METHODS:
        ho = model.host
        mode = model.cudagraph_mode
        # the drafter's dispatcher captures the mixed mode only: PIECEWISE, or none
        dmode = "NONE" if mode in ("NONE", "FULL_DECODE_ONLY") else "PIECEWISE"
        if getattr(scfg, "enforce_eager", None):
            dmode = "NONE"
        drafter = StepCostModel(
            d.spec, model.hw, tp=model.tp, pp=1, weight_format=d.weight_format,
            kv_dtype_bytes=model.kv_dtype_bytes, max_num_seqs=model.max_num_seqs,
            max_num_batched_tokens=model.max_num_batched_tokens + model.max_num_seqs,
            async_scheduling=False, cudagraph_mode=dmode,
            cudagraph_sizes=list(model.capture_sizes), calibration=model.calibration,
            efficiencies=model.eff,
            host=HostOverhead(per_step_s=0.0, per_request_s=0.0, per_token_s=0.0,
                              launch_s=ho.launch_s, graph_launch_s=ho.graph_launch_s,
                              async_residual_s=0.0))
        ext = ModelProposer(d, drafter)
    elif d.method in HEAD_METHODS:
        ext = HeadProposer(model, d.k, d.method)
    else:
        ext = HostProposer(d.method, model.bw)
    model.step_extensions = tuple(model.step_extensions) + (ext,)
