"""Config sections owned by the cost model: ``model`` and ``hardware`` (vLLM field names)."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
)


def human_readable_int(value: Any) -> Any:
    """vLLM's ``human_readable_int`` for byte and token counts: '25.6k' = 25,600 and '2g' =
    2·10⁹ (decimal suffixes k m g t), '2G' = 2·2³⁰ (binary suffixes K M G T, whole numbers
    only); anything else is left to the field's own validation."""
    if not isinstance(value, str):
        return value
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value.strip())
    if not m:
        return value
    number, suffix = m.groups()
    if suffix.islower():
        x = float(number) * 10 ** (3 * "kmgt".index(suffix) + 3)
        if x == float("inf"):
            raise ValueError(f"{value.strip()[:20]}... is too large")
        return int(x)
    if "." in number:
        raise ValueError(f"decimals are not allowed with binary suffixes like {suffix}: did you "
                         f"mean {number}{suffix.lower()}?")
    return int(number) << (10 * ("KMGT".index(suffix) + 1))


# an int field that also takes vLLM's human-readable form ('16k', '16K', '16G')
HumanInt = Annotated[int, BeforeValidator(human_readable_int)]

AUTO_MAX_MODEL_LEN = -1  # vLLM --max-model-len -1 / auto: fit the length to the KV cache


def _max_model_len(value: Any) -> Any:
    """vLLM's ``human_readable_int_or_auto``: ``auto`` or -1 → -1 (auto-fit), else
    :func:`human_readable_int`."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "-1"):
        return AUTO_MAX_MODEL_LEN
    if isinstance(value, bool):  # (YAML yes/no/true/false; pydantic reports a ValueError)
        raise ValueError("expected a number of tokens, or auto, not a boolean")  # noqa: TRY004
    return human_readable_int(value)


def _positive_or_auto(value: int) -> int:
    """After parsing: a positive length, or -1 (auto); 0 and other negatives are refused."""
    if value < 1 and value != AUTO_MAX_MODEL_LEN:
        raise ValueError("expected a positive number of tokens, or auto (-1: the longest "
                         "that fits in the KV cache)")
    return value

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(v: Any) -> int:
    """A byte count: ``8589934592``, vLLM's human-readable ``8G`` (GiB) / ``8g`` (1e9), or
    with a unit ``8GiB``, ``"8 GB"`` → bytes (int)."""
    if isinstance(v, bool):
        raise ValueError(  # noqa: TRY004 (pydantic wants ValueError)
            "expected a byte count such as 8589934592, '8G' or '8GiB'")
    if isinstance(v, (int, float)):
        if not math.isfinite(v):
            raise ValueError("expected a finite byte count")
        if v < 0:
            raise ValueError("must be >= 0")
        return int(v)
    x = human_readable_int(v)
    if isinstance(x, int):
        return x
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(v))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError("expected a byte count such as 8589934592, '8G' or '8GiB'")
    x = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(x):
        raise ValueError("expected a finite byte count")
    return int(x)


# a byte-count field: bytes, vLLM's '16G' / '16g', or '16GiB' / '16 GB'
Bytes = Annotated[int, BeforeValidator(parse_bytes)]


def _dtype(v: Any) -> Any:
    """vLLM's ``--dtype`` spellings: ``half`` is float16; float32 weights are not modelled."""
    if v == "half":
        return "float16"
    if v in ("float", "float32"):
        raise ValueError("float32 weights and activations are not modelled (the cost model "
                         "is for 16-bit and quantized weights); use auto, bfloat16 or float16")
    return v


# vLLM ``--quantization`` names (vllm/model_executor/layers/quantization/__init__.py, 0.22.1)
# → servesim's weight formats. AWQ/GPTQ and their Marlin kernels are W4A16 (the checkpoint's
# bits and group size are read from its quantization_config); the online fp8 shorthands and
# ModelOpt FP8 checkpoints are W8A8 fp8 (fbgemm_fp8 is deprecated in 0.22.1: refused there).
WEIGHT_FORMATS = ("none", "fp8", "int8", "int4-awq", "int4-gptq")
QUANTIZATION_ALIASES = {
    "awq": "int4-awq", "awq_marlin": "int4-awq",
    "gptq": "int4-gptq", "gptq_marlin": "int4-gptq", "auto_gptq": "int4-gptq",
    "fp8_per_tensor": "fp8", "fp8_per_block": "fp8", "modelopt": "fp8",
}


def _quantization(v: Any) -> Any:
    """vLLM's ``--quantization`` spellings (:data:`QUANTIZATION_ALIASES`); null is none."""
    if v is None:
        return "none"
    if isinstance(v, str) and v not in WEIGHT_FORMATS and v not in QUANTIZATION_ALIASES:
        raise ValueError(f"expected {', '.join(WEIGHT_FORMATS)} or vLLM's "
                         f"{', '.join(QUANTIZATION_ALIASES)} (others are not modelled)")
    return QUANTIZATION_ALIASES.get(v, v) if isinstance(v, str) else v


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """``model``: which model, as vLLM's ``ModelConfig`` names it."""

    name: str = Field(
        "llama-3.1-8b",
        description="A file in configs/models/ (HF config.json fields as YAML) or a path to a "
        "Hugging Face config.json",
    )
    max_model_len: Annotated[int, BeforeValidator(_max_model_len),
                             AfterValidator(_positive_or_auto)] | None = Field(
        None, description="Context limit in tokens ('32k' = 32,000, '32K' = 32,768); "
        "default: what vLLM derives from the config.json (max_position_embeddings, RoPE "
        "scaling); auto or -1: that length, or the longest the KV cache holds when it is "
        "shorter")
    dtype: Annotated[Literal["auto", "bfloat16", "float16"], BeforeValidator(_dtype)] = Field(
        "auto", description="vLLM --dtype: auto, bfloat16, float16 (or half)")
    quantization: Annotated[Literal["none", "fp8", "int8", "int4-awq", "int4-gptq"],
                            BeforeValidator(_quantization)] = Field(
        "none", description="Weight format: none (checkpoint's own), fp8, int8, int4-awq, "
        "int4-gptq, or vLLM's --quantization name (awq, awq_marlin, gptq, gptq_marlin, "
        "auto_gptq, modelopt, fp8_per_tensor, fp8_per_block)")
    enforce_eager: bool = Field(False, description="vLLM --enforce-eager: no CUDA graphs")
    # set by resolve_config for max_model_len auto: the derived length before the fit (the
    # plan's log line says whether the KV cache cut it); not dumped
    _auto_fit_from: int | None = PrivateAttr(None)


# Upper bounds on hardware spec numbers, far above any real GPU (the largest today: ~290 GiB,
# ~10 PFLOP/s dense FP8, ~8 TB/s): device memory in GiB, and every other spec field (TFLOP/s,
# GB/s, MiB, SMs, microseconds).
MAX_MEMORY_GIB = 10_000
MAX_HARDWARE_VALUE = 1_000_000


class HardwareConfig(_Section):
    """``hardware``: a GPU from configs/hardware/ by ``name``, optionally with spec fields
    overridden inline (or a fully inline spec when ``name`` is not a shipped file)."""

    name: str = "a100-sxm4-80gb"
    # spec fields: finite, positive, and below MAX_HARDWARE_VALUE (memory_gib: MAX_MEMORY_GIB)
    bf16_tflops: float | None = Field(None, gt=0, le=MAX_HARDWARE_VALUE, allow_inf_nan=False,
                                      description="Dense BF16/FP16 tensor TFLOP/s")
    fp8_tflops: float | None = Field(None, gt=0, le=MAX_HARDWARE_VALUE, allow_inf_nan=False,
                                     description="Dense FP8 tensor TFLOP/s")
    int8_tops: float | None = Field(None, gt=0, le=MAX_HARDWARE_VALUE, allow_inf_nan=False,
                                    description="Dense INT8 tensor TOP/s")
    memory_gib: float | None = Field(None, gt=0, le=MAX_MEMORY_GIB, allow_inf_nan=False,
                                     description="Device memory, GiB")
    mem_bw_gbps: float | None = Field(None, gt=0, le=MAX_HARDWARE_VALUE, allow_inf_nan=False,
                                      description="HBM bandwidth, GB/s")
    l2_mib: float | None = Field(None, gt=0, le=MAX_HARDWARE_VALUE, allow_inf_nan=False)
    num_sms: int | None = Field(None, gt=0, le=MAX_HARDWARE_VALUE)
    link_bw_gbps: float | None = Field(
        None, gt=0, le=MAX_HARDWARE_VALUE, allow_inf_nan=False,
        description="Intra-node GPU-GPU bandwidth per direction, GB/s"
    )
    link_latency_us: float | None = Field(None, ge=0, le=MAX_HARDWARE_VALUE, allow_inf_nan=False)
    pcie_bw_gbps: float | None = Field(None, gt=0, le=MAX_HARDWARE_VALUE, allow_inf_nan=False)
    calibration: str | None = Field(
        "auto",
        description='"auto": per op family, your measured <calibration dir>/<name>.yaml, else '
        'the shipped configs/calibration/<name>.json (default efficiencies when neither '
        'exists); "none": default efficiencies; or a path to one calibration file',
    )
