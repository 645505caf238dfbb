"""Hardware and model specs: catalogs in ``configs/hardware`` and ``configs/models``.

Units: FLOP/s, bytes, bytes/s, seconds. The YAML files use TFLOP/s (1e12), GB/s (1e9 B/s),
GiB (2**30 B) and microseconds, as spec sheets do; the properties here convert.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from servesim.costmodels.config import (
    MAX_HARDWARE_VALUE,
    MAX_MEMORY_GIB,
    HardwareConfig,
    ModelConfig,
)
from servesim.simulator.errors import ConfigError, path_is_dir, path_is_file

GIB = 1 << 30


def configs_dir() -> Path:
    """The ``configs/`` package folder (servesim.configs)."""
    import servesim.configs

    return Path(servesim.configs.__file__).resolve().parent


_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, when installed


def _read_mapping(path: Path, what: str) -> dict:
    """Read a YAML or JSON mapping; ConfigError (one line, naming the file) on any problem."""
    if not path_is_file(path):
        raise ConfigError(f"{path}: no such {what} file")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.load(text, Loader=_SafeLoader)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: invalid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of {what} fields at the top level")
    return data


# ---------------------------------------------------------------------------------------------
# Hardware


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU's spec-sheet constants (dense tensor rates, no 2:4 sparsity).

    ``memory_gib`` is the capacity *as the device reports it* (``torch.cuda.mem_get_info()[1]``,
    which vLLM uses as ``total_gpu_memory``): e.g. ~79.15 GiB on an "80 GB" A100, not 80 GB.
    ``num_sms`` holds compute units on AMD. ``link_*`` is the intra-node GPU-GPU path used by
    TP all-reduce and PP handoffs (NVLink, Infinity Fabric, or PCIe when there is none).
    """

    name: str
    bf16_tflops: float
    memory_gib: float
    mem_bw_gbps: float
    num_sms: int = 108
    fp8_tflops: float | None = None
    int8_tops: float | None = None
    l2_mib: float | None = None
    link_kind: str = "pcie"
    link_bw_gbps: float = 32.0
    link_latency_us: float = 10.0
    pcie_bw_gbps: float = 32.0
    # CUDA compute capability (9.0 Hopper, 10.0 Blackwell, ...; None: not a CUDA GPU): which
    # attention backend vLLM picks (``costmodels.engine_defaults.kv_block_size``)
    compute_capability: float | None = None
    # power cap under sustained compute (costmodels/power.py): measured (compute share, time
    # factor of compute-bound work) points, () = not measured; the share's averaging time (s)
    power_cap_curve: tuple[tuple[float, float], ...] = ()
    power_cap_tau_s: float = 0.06
    description: str = ""
    file: str | None = None
    source: dict = field(default_factory=dict, compare=False)

    @property
    def memory_bytes(self) -> int:
        """Device memory, bytes (as reported by the device)."""
        return int(self.memory_gib * GIB)

    @property
    def mem_bw(self) -> float:
        """HBM/GDDR bandwidth, bytes/s."""
        return self.mem_bw_gbps * 1e9

    @property
    def link_bw(self) -> float:
        """GPU-GPU bandwidth per direction, bytes/s."""
        return self.link_bw_gbps * 1e9

    @property
    def link_latency(self) -> float:
        """Small-message GPU-GPU latency, seconds."""
        return self.link_latency_us * 1e-6

    @property
    def has_nvlink(self) -> bool:
        """True when GPUs have a direct P2P fabric (vLLM's custom all-reduce is usable)."""
        return self.link_kind in ("nvlink", "infinity-fabric")

    def peak_flops(self, compute: str = "bf16") -> float:
        """Dense tensor FLOP/s for ``compute`` in {"bf16", "fp8", "int8"}; falls back to the
        bf16 rate when the GPU has no faster path for that type (e.g. fp8 on A100)."""
        if compute == "fp8" and self.fp8_tflops:
            return self.fp8_tflops * 1e12
        if compute == "int8" and self.int8_tops:
            return self.int8_tops * 1e12
        return self.bf16_tflops * 1e12

    def has_fast_path(self, compute: str) -> bool:
        """Whether ``compute`` ("fp8"/"int8") runs at a faster tensor rate than bf16."""
        if compute == "fp8":
            return bool(self.fp8_tflops)
        if compute == "int8":
            return bool(self.int8_tops)
        return True

    @property
    def is_a100(self) -> bool:
        return "a100" in self.name.lower()


_HW_REQUIRED = ("bf16_tflops", "memory_gib", "mem_bw_gbps")
_HW_FIELDS = (
    "bf16_tflops", "fp8_tflops", "int8_tops", "memory_gib", "mem_bw_gbps", "l2_mib", "num_sms",
    "link_bw_gbps", "link_latency_us", "pcie_bw_gbps",
)


def hardware_names() -> list[str]:
    """Names of the shipped hardware files."""
    return sorted(p.stem for p in (configs_dir() / "hardware").glob("*.yaml"))


def load_hardware_spec(hw_cfg: HardwareConfig) -> HardwareSpec:
    """``hardware`` section → :class:`HardwareSpec`.

    ``name`` picks ``configs/hardware/<name>.yaml`` (or a path to such a file); fields given
    inline override the file. A ``name`` that is neither gives a fully inline spec, which then
    needs ``bf16_tflops``, ``memory_gib`` and ``mem_bw_gbps``.
    """
    path = configs_dir() / "hardware" / f"{hw_cfg.name}.yaml"
    if not path_is_file(path) and hw_cfg.name.endswith((".yaml", ".yml")):
        path = Path(hw_cfg.name)
        if not path_is_file(path):
            raise ConfigError(f"hardware.name: no such hardware file {hw_cfg.name}")
    base: dict[str, Any] = {}
    file = None
    if path_is_file(path):
        base = _read_mapping(path, "hardware")
        file = str(path)
    inline = {k: getattr(hw_cfg, k) for k in _HW_FIELDS if getattr(hw_cfg, k) is not None}
    merged = {**base, **inline}
    missing = [k for k in _HW_REQUIRED if merged.get(k) is None]
    if missing:
        known = ", ".join(hardware_names())
        raise ConfigError(
            f"hardware.{missing[0]}: required for hardware '{hw_cfg.name}', which is not a "
            f"shipped GPU ({known}); give it inline or pick a shipped name"
        )
    source = dict(merged.get("source") or {})
    for k in inline:
        source[k] = "inline override in the experiment config"
    kw: dict[str, Any] = {"name": merged.get("name") or hw_cfg.name, "file": file,
                          "source": source, "description": merged.get("description", "")}
    if file is None:
        kw["name"] = hw_cfg.name
    for k in _HW_FIELDS + ("link_kind",):
        v = merged.get(k)
        if v is not None:
            kw[k] = v
    for k in _HW_FIELDS:
        v = kw.get(k)
        limit = MAX_MEMORY_GIB if k == "memory_gib" else MAX_HARDWARE_VALUE
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not math.isfinite(v) or v < 0 or v > limit
                              or (v == 0 and k not in ("link_latency_us",))):
            where = file or "hardware"
            raise ConfigError(f"{where}: hardware.{k} must be a positive finite number of at "
                              f"most {limit:,}, got {v!r}")
    if "num_sms" in kw:
        kw["num_sms"] = int(kw["num_sms"])
    cc = merged.get("compute_capability")
    if cc is not None:
        if isinstance(cc, bool) or not isinstance(cc, (int, float)) or cc <= 0:
            raise ConfigError(f"{file or 'hardware'}: compute_capability must be a positive "
                              f"number such as 9.0, got {cc!r}")
        kw["compute_capability"] = float(cc)
    curve = merged.get("power_cap_curve")
    if curve is not None:
        kw["power_cap_curve"] = _power_cap_curve(curve, file or "hardware")
    tau = merged.get("power_cap_tau_s")
    if tau is not None:
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 < tau < 10:
            raise ConfigError(f"{file or 'hardware'}: power_cap_tau_s must be seconds in "
                              f"(0, 10), got {tau!r}")
        kw["power_cap_tau_s"] = float(tau)
    return HardwareSpec(**kw)


def _power_cap_curve(curve, where: str) -> tuple[tuple[float, float], ...]:
    """``[[share, factor], ...]``: compute shares rising in (0, 1], factors >= 1."""
    ok = isinstance(curve, list) and all(
        isinstance(pt, list) and len(pt) == 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            for x in pt) for pt in curve)
    pts = tuple((float(a), float(b)) for a, b in curve) if ok else ()
    if not pts or any(not 0 < a <= 1 or b < 1 for a, b in pts) or any(
            b[0] <= a[0] for a, b in itertools.pairwise(pts)):
        raise ConfigError(f"{where}: power_cap_curve must be [[compute share, time factor], "
                          f"...] with shares rising in (0, 1] and factors >= 1, got {curve!r}")
    return pts


# ---------------------------------------------------------------------------------------------
# Model


@dataclass(frozen=True)
class Linear:
    """One linear module family of the decoder, with vLLM's name and TP style.

    ``k`` × ``n`` are the full (unsharded) in/out features. ``parallel``: "column"
    (ColumnParallelLinear: n sharded), "row" (RowParallelLinear: k sharded, all-reduce after),
    "replicated". Routed experts hold ``num_experts`` copies of which ``active_experts`` serve
    each token. ``layers``: how many decoder layers contain it.
    """

    name: str
    op: str
    k: int
    n: int
    layers: int
    parallel: str = "column"
    num_experts: int = 1
    active_experts: int = 1
    bias: bool = False
    quantized: bool = True
    q_heads: int = 0  # qkv_proj only: heads, for KV-head replication when kv_heads < tp
    kv_heads: int = 0
    head_dim: int = 0

    def shard(self, tp: int) -> tuple[int, int]:
        """(n, k) per TP rank. qkv_proj replicates KV heads when num_kv_heads < tp (vLLM)."""
        if self.parallel == "replicated" or tp == 1:
            return self.n, self.k
        if self.q_heads:
            kv = max(1, self.kv_heads // tp)
            return (self.q_heads // tp + 2 * kv) * self.head_dim, self.k
        if self.parallel == "column":
            return -(-self.n // tp), self.k
        return self.n, -(-self.k // tp)

    def params(self, experts: int | None = None) -> int:
        """Parameters over all its layers (``experts`` copies; default all)."""
        e = self.num_experts if experts is None else experts
        return self.layers * e * (self.k * self.n + (self.n if self.bias else 0))


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts from a Hugging Face ``config.json`` (``text_config`` merged up)."""

    name: str
    source: str
    architectures: tuple[str, ...]
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    qkv_bias: bool = False
    sliding_window: int | None = None
    rotary_dim: int = 0
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    router_bias: bool = False
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # weights as shipped
    quant_method: str | None = None
    weight_block_size: tuple[int, int] | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # -- context length --------------------------------------------------------------------------

    @property
    def max_len(self) -> MaxLen:
        """The context limits vLLM derives from this config.json (:func:`derive_max_len`)."""
        return derive_max_len(self.raw or {"max_position_embeddings":
                                            self.max_position_embeddings}, self.source)

    # -- structure -----------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        """Decoder layers with a routed-expert MLP (DeepSeek: after ``first_k_dense_replace``,
        every ``moe_layer_freq``-th)."""
        return self.moe_layers_in(0, self.num_hidden_layers)

    def moe_layers_in(self, start: int, end: int) -> int:
        """How many of decoder layers ``start`` … ``end - 1`` have the routed-expert MLP
        (:meth:`is_moe_layer`), counted without a loop over the layers."""
        if not self.is_moe:
            return 0
        f = max(1, self.moe_layer_freq)
        first = -(-max(start, self.first_k_dense_replace) // f)  # first multiple of f, / f
        return max(0, (end - 1) // f - first + 1) if end > start else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_hidden_layers - self.num_moe_layers

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` has the routed-expert MLP (the rule of
        :attr:`num_moe_layers`)."""
        return (self.is_moe and i >= self.first_k_dense_replace
                and i % max(1, self.moe_layer_freq) == 0)

    def linears(self) -> list[Linear]:
        """The decoder's linear modules (vLLM names), excluding embedding and LM head."""
        h, L = self.hidden_size, self.num_hidden_layers
        nh, nkv, hd = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        out: list[Linear] = []
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            kv_a = self.kv_lora_rank + self.qk_rope_head_dim
            if self.q_lora_rank:
                out.append(Linear("fused_qkv_a_proj", "qkv_a_proj", h, self.q_lora_rank + kv_a,
                                  L, "replicated"))
                out.append(Linear("q_b_proj", "q_b_proj", self.q_lora_rank, nh * qk, L))
            else:
                out.append(Linear("q_proj", "q_proj", h, nh * qk, L))
                out.append(Linear("kv_a_proj_with_mqa", "qkv_a_proj", h, kv_a, L, "replicated"))
            out.append(Linear("kv_b_proj", "kv_b_proj", self.kv_lora_rank,
                              nh * (self.qk_nope_head_dim + self.v_head_dim), L))
            out.append(Linear("o_proj", "o_proj", nh * self.v_head_dim, h, L, "row"))
        else:
            out.append(Linear("qkv_proj", "qkv_proj", h, (nh + 2 * nkv) * hd, L, "column",
                              bias=self.qkv_bias, q_heads=nh, kv_heads=nkv, head_dim=hd))
            out.append(Linear("o_proj", "o_proj", nh * hd, h, L, "row"))
        Ld, Lm = self.num_dense_layers, self.num_moe_layers
        if Ld:
            out.append(Linear("gate_up_proj", "gate_up_proj", h, 2 * self.intermediate_size, Ld))
            out.append(Linear("down_proj", "down_proj", self.intermediate_size, h, Ld, "row"))
        if Lm:
            E, k, im = self.num_experts, self.num_experts_per_tok, self.moe_intermediate_size
            out.append(Linear("gate", "router", h, E, Lm, "replicated", bias=self.router_bias,
                              quantized=False))
            out.append(Linear("experts.w13", "experts", h, 2 * im, Lm, "column", E, k))
            out.append(Linear("experts.w2", "experts", im, h, Lm, "row", E, k))
            ish = self.shared_expert_intermediate_size
            if ish:
                out.append(Linear("shared_experts.gate_up_proj", "shared_experts", h, 2 * ish, Lm))
                out.append(Linear("shared_experts.down_proj", "shared_experts", ish, h, Lm,
                                  "row"))
        return out

    def norm_params_per_layer(self) -> int:
        """RMSNorm weights per decoder layer (input + post-attention; MLA's latent norms)."""
        extra = (self.q_lora_rank or 0) + self.kv_lora_rank if self.is_mla else 0
        return 2 * self.hidden_size + extra

    # -- parameter counts ----------------------------------------------------------------------

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """0 when tied to the embedding."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def _count(self, active: bool) -> int:
        n = self.embedding_params + self.lm_head_params + self.hidden_size  # + final norm
        n += self.num_hidden_layers * self.norm_params_per_layer()
        for lin in self.linears():
            n += lin.params(lin.active_experts if active else None)
        return n

    @property
    def num_params(self) -> int:
        """Total parameters (MTP/next-n modules excluded, as published counts do)."""
        return self._count(active=False)

    @property
    def num_active_params(self) -> int:
        """Parameters touched per token (top-k routed experts + shared + dense parts)."""
        return self._count(active=True)

    # -- KV cache ------------------------------------------------------------------------------

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads per TP rank; replicated (1 per rank) when num_key_value_heads < tp."""
        return max(1, self.num_key_value_heads // tp)

    def kv_elems_per_token_per_layer(self, tp: int = 1) -> int:
        """Cached elements per token per layer on one rank: GQA 2·kv_heads/tp·head_dim;
        MLA kv_lora_rank + qk_rope_head_dim (the latent is replicated across TP ranks)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.kv_heads_per_rank(tp) * self.head_dim

    def layers_per_rank(self, pp: int = 1) -> int:
        """Decoder layers on the most loaded pipeline stage."""
        return -(-self.num_hidden_layers // pp)

    def kv_bytes_per_token(self, dtype_bytes: float, tp: int = 1, pp: int = 1) -> int:
        """KV cache bytes per token on one rank: layers/pp · elems/layer · dtype_bytes.

        Llama-3.1-8B bf16: 2·32·8·128·2 = 131,072; DeepSeek-V3 MLA: 61·576·2 = 70,272.
        """
        return int(self.layers_per_rank(pp) * self.kv_elems_per_token_per_layer(tp)
                   * dtype_bytes)

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.torch_dtype == "float32" else 2


# config.json keys that bound the context, the smallest present wins (vLLM
# ``ModelArchConfigConvertor.derive_max_model_len_and_key``)
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "model_max_length", "max_target_positions", "max_sequence_length",
                 "max_seq_length", "seq_len")


@dataclass(frozen=True)
class MaxLen:
    """vLLM's context limits for a model (tokens): ``derived`` (the largest max_model_len
    allowed), from config key ``key``; ``default`` (max_model_len when unset); the config's
    own ``model_max_length`` (a larger user value up to it is allowed too)."""

    derived: int
    key: str
    default: int
    model_max_length: int | None = None

    def check(self, max_model_len: int, where: str) -> None:
        """vLLM's refusal of a longer max_model_len (without VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
        if max_model_len <= self.derived or (
                self.model_max_length is not None and max_model_len <= self.model_max_length):
            return
        raise ConfigError(
            f"{where}: User-specified max_model_len ({max_model_len}) is greater than the "
            f"derived max_model_len ({self.key}={self.derived} or model_max_length="
            f"{self.model_max_length} in model's config.json) (vLLM refuses it without "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)")


def derive_max_len(d: dict, source: str = "config.json") -> MaxLen:
    """vLLM 0.22.1 ``_get_and_verify_max_len`` on config.json fields ``d`` (no tokenizer
    config, sliding window kept): the smallest of :data:`_MAX_LEN_KEYS` present
    (``model_max_length`` wins when set; 2048 when none is), times the RoPE scaling factor
    (``rope_scaling``, transformers v5's ``rope_parameters``) unless the type is ``llama3``,
    ``longrope`` or ``su`` (their lengths are already scaled) or the model is Gemma 3;
    ``yarn`` scales its ``original_max_position_embeddings``. Unset max_model_len: the
    derived value, or ``original_max_position_embeddings`` for LongRoPE (``su``)."""

    def number(key: str, v: Any, whole: bool = True) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v <= 0 or (whole and v != int(v)):
            kind = "a positive whole number" if whole else "a positive number"
            raise ConfigError(f"{source}: {key} must be {kind}, got {v!r}")
        return v

    derived, key = math.inf, "max_position_embeddings"
    for k in _MAX_LEN_KEYS:
        if d.get(k) is not None and number(k, d[k]) < derived:
            derived, key = d[k], k
    mml = d.get("model_max_length")
    if mml is not None:
        derived, key = number("model_max_length", mml), "model_max_length"
    if derived == math.inf:
        derived = 2048
    rope = d.get("rope_scaling") or d.get("rope_parameters")
    longrope = False
    if isinstance(rope, dict) and rope and "gemma3" not in str(d.get("model_type", "")):
        nested = all(isinstance(v, dict) for v in rope.values())
        factor = 1.0
        for rp in (rope.values() if nested else [rope]):
            rtype = rp.get("rope_type") or rp.get("type") or "default"
            longrope = longrope or rtype in ("longrope", "su")
            if rtype not in ("su", "longrope", "llama3"):
                if rp.get("factor") is not None:
                    factor = number("rope_scaling.factor", rp["factor"], whole=False)
                if rtype == "yarn":
                    orig = rp.get("original_max_position_embeddings",
                                  d.get("original_max_position_embeddings"))
                    if orig is not None:
                        derived = number("original_max_position_embeddings", orig)
        derived *= factor
    default = derived
    if longrope and d.get("original_max_position_embeddings") is not None:
        default = number("original_max_position_embeddings", d["original_max_position_embeddings"])
    return MaxLen(int(derived), key, int(default), int(mml) if mml is not None else None)


_REQUIRED_MODEL_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")

# Upper bounds on config.json counts and sizes: far above any real model (the largest today
# have ~130 layers, 128 heads, hidden sizes ~20k, 384 experts, vocabularies ~260k), so a
# typo or a garbage file is refused at once instead of being modelled (or looped over) as is.
MODEL_LIMITS = {
    "num_hidden_layers": 10_000,
    "num_attention_heads": 10_000, "num_key_value_heads": 10_000,
    "hidden_size": 1_000_000, "intermediate_size": 10_000_000, "head_dim": 100_000,
    "moe_intermediate_size": 10_000_000, "shared_expert_intermediate_size": 10_000_000,
    "num_local_experts": 100_000, "n_routed_experts": 100_000, "num_experts": 100_000,
    "num_experts_per_tok": 100_000, "n_shared_experts": 100_000,
    "vocab_size": 100_000_000,
    "q_lora_rank": 1_000_000, "kv_lora_rank": 1_000_000, "qk_nope_head_dim": 100_000,
    "qk_rope_head_dim": 100_000, "v_head_dim": 100_000,
}


def model_spec_from_hf(cfg: dict, name: str, source: str) -> ModelSpec:
    """Build a :class:`ModelSpec` from HF ``config.json`` fields (``text_config`` merged up)."""
    d = dict(cfg)
    tc = d.pop("text_config", None)
    if isinstance(tc, dict):
        d.update(tc)
    for k in _REQUIRED_MODEL_KEYS:
        if k not in d or d[k] is None:
            raise ConfigError(f"{source}: missing {k} (a Hugging Face config.json field)")

    def as_int(key: str, default: Any = None) -> Any:
        v = d.get(key, default)
        if v is None:
            return default
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                or v < 0 or v != int(v)):
            raise ConfigError(f"{source}: {key} must be a non-negative integer, got {v!r}")
        limit = MODEL_LIMITS.get(key)
        if limit is not None and v > limit:
            raise ConfigError(f"{source}: {key} must be at most {limit:,} (no real model comes "
                              f"close), got {v!r}")
        return int(v)

    h = as_int("hidden_size")
    nh = as_int("num_attention_heads")
    L = as_int("num_hidden_layers")
    for key, v in (("hidden_size", h), ("num_attention_heads", nh), ("num_hidden_layers", L)):
        if not v:
            raise ConfigError(f"{source}: {key} must be positive, got 0")
    nkv = as_int("num_key_value_heads", nh)
    if not nkv:
        raise ConfigError(f"{source}: num_key_value_heads must be positive, got 0")
    if nh % nkv:
        raise ConfigError(f"{source}: num_attention_heads ({nh}) must be divisible by "
                          f"num_key_value_heads ({nkv}) (vLLM refuses this model)")
    hd = as_int("head_dim") or h // nh
    inter = as_int("intermediate_size", 4 * h)
    E = as_int("num_local_experts") or as_int("n_routed_experts") or as_int("num_experts") or 0
    topk = as_int("num_experts_per_tok", 0) or (2 if E else 0)
    moe_inter = as_int("moe_intermediate_size") or (inter if E else 0)
    n_shared = as_int("n_shared_experts", 0) or 0
    shared_inter = as_int("shared_expert_intermediate_size") or n_shared * moe_inter
    model_type = str(d.get("model_type", ""))
    arch = tuple(d.get("architectures") or ())
    # sliding window: Qwen2 ships a value but disables it with use_sliding_window: false.
    sw = as_int("sliding_window")
    if d.get("use_sliding_window") is False:
        sw = None
    qkv_bias = bool(d.get("attention_bias", False) or d.get("qkv_bias", False)
                    or model_type in ("qwen2", "qwen2_moe"))
    qc = d.get("quantization_config") or {}
    qm = qc.get("quant_method") if isinstance(qc, dict) else None
    wbs = qc.get("weight_block_size") if isinstance(qc, dict) else None
    kv_lora = as_int("kv_lora_rank", 0) or 0
    rope_dim = as_int("qk_rope_head_dim", 0) or 0
    partial = d.get("partial_rotary_factor", 1.0) or 1.0
    if (isinstance(partial, bool) or not isinstance(partial, (int, float))
            or not 0 < partial <= 1):
        raise ConfigError(f"{source}: partial_rotary_factor must be a number in (0, 1], "
                          f"got {partial!r}")
    rotary_dim = rope_dim if kv_lora else int(hd * partial)
    max_pos = as_int("max_position_embeddings", 2048)
    return ModelSpec(
        name=name, source=source, architectures=arch, model_type=model_type,
        hidden_size=h, intermediate_size=inter, num_hidden_layers=L,
        num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd,
        vocab_size=as_int("vocab_size"), max_position_embeddings=max_pos,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
        qkv_bias=qkv_bias, sliding_window=sw, rotary_dim=rotary_dim,
        num_experts=E, num_experts_per_tok=topk if E else 0,
        moe_intermediate_size=moe_inter if E else 0,
        num_shared_experts=n_shared if E else 0,
        shared_expert_intermediate_size=shared_inter if E else 0,
        first_k_dense_replace=as_int("first_k_dense_replace", 0) or 0,
        moe_layer_freq=as_int("moe_layer_freq", 1) or 1,
        router_bias=d.get("topk_method") == "noaux_tc",
        q_lora_rank=as_int("q_lora_rank"), kv_lora_rank=kv_lora,
        qk_nope_head_dim=as_int("qk_nope_head_dim", 0) or 0, qk_rope_head_dim=rope_dim,
        v_head_dim=as_int("v_head_dim", 0) or 0,
        quant_method=str(qm) if qm else None,
        weight_block_size=tuple(wbs) if isinstance(wbs, (list, tuple)) and len(wbs) == 2
        else None,
        raw=d,
    )


def model_names() -> list[str]:
    return sorted(p.stem for p in (configs_dir() / "models").glob("*.yaml"))


def load_model_spec(model_cfg: ModelConfig) -> ModelSpec:
    """``model`` section → :class:`ModelSpec`.

    ``name`` is a file stem in ``configs/models/`` (HF config.json fields as YAML), or a path
    to a ``config.json`` / YAML file, or a directory holding a ``config.json``.
    """
    name = model_cfg.name
    path = configs_dir() / "models" / f"{name}.yaml"
    if not path_is_file(path):
        p = Path(name).expanduser()
        if path_is_dir(p):
            p = p / "config.json"
        looks_like_path = "/" in name or name.endswith((".json", ".yaml", ".yml"))
        if path_is_file(p):
            path = p
        elif looks_like_path:
            raise ConfigError(f"model.name: no such model config file {name}")
        else:
            raise ConfigError(
                f"model.name: unknown model '{name}' (not in configs/models/: "
                f"{', '.join(model_names())}; nor a path to a config.json)"
            )
    data = _read_mapping(path, "model config")
    stem = path.stem if path.name != "config.json" else path.parent.name
    return model_spec_from_hf(data, name=stem, source=str(path))


def _isclose(a: float, b: float) -> bool:  # pragma: no cover - tiny helper for callers
    return math.isclose(a, b, rel_tol=1e-9)
