"""Weight formats (quantization) and KV-cache dtype: bytes per element and the tensor rate used.

- bf16/fp16: 2 bytes/param, bf16 tensor rate.
- fp8 (W8A8, dynamic per-token activation scales): 1 byte/param (+ fp32 block scales when the
  checkpoint has ``weight_block_size``); fp8 tensor rate **only** on GPUs with ``fp8_tflops``
  (Ada/Hopper+); elsewhere vLLM runs weight-only FP8 Marlin: bytes saved, bf16 FLOP rate.
- int8 (W8A8 SmoothQuant): 1 byte/param; int8 tensor rate where the GPU has ``int8_tops``.
- AWQ/GPTQ (W4A16, or W8A16 for an 8-bit GPTQ checkpoint): bits/8 + 2/group bytes/param
  (one fp16 scale per group; bits and ``group_size`` from the checkpoint's quantization_config,
  default 4 and 128: 0.515625; group -1 is one scale per output channel, ~0); matmul stays
  bf16 after in-register dequant, so no FLOP-rate gain.
- KV cache: ``auto`` = model dtype (2 bytes), ``fp8*`` = 1 byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from servesim.costmodels.config import ModelConfig
from servesim.costmodels.specs import HardwareSpec, ModelSpec
from servesim.simulator.errors import ConfigError


@dataclass(frozen=True)
class WeightFormat:
    """How decoder linear weights are stored and multiplied."""

    name: str  # bf16 | fp16 | fp8 | int8 | int4-awq | int4-gptq | int8-gptq (W8A16)
    bytes_per_param: float  # bytes per weight element, scales included
    compute: str  # tensor-core path actually used: "bf16" | "fp8" | "int8"
    note: str = ""


INT4_GROUP = 128


def _wna16_bytes(spec: ModelSpec) -> tuple[int, float]:
    """(bits, bytes per weight) of a W4A16/W8A16 checkpoint: ``bits``/8 + one fp16 scale per
    ``group_size`` weights (-1: per output channel, one per ``hidden_size`` weights); without
    a quantization_config (a what-if on an unquantized checkpoint): 4 bits, groups of 128."""
    qc = spec.raw.get("quantization_config") or {}
    qc = qc if isinstance(qc, dict) else {}
    bits = qc.get("bits", qc.get("w_bit", 4))
    group = qc.get("group_size", qc.get("q_group_size", INT4_GROUP))
    bits = bits if bits in (4, 8) else 4
    if not isinstance(group, int) or isinstance(group, bool) or group == 0 or group < -1:
        group = INT4_GROUP
    group = spec.hidden_size if group == -1 else group
    return bits, bits / 8 + 2 / group


def _from_checkpoint(spec: ModelSpec) -> str:
    qm = (spec.quant_method or "").lower()
    if qm == "fp8":
        return "fp8"
    if qm == "awq":
        return "int4-awq"
    if qm == "gptq":
        return "int4-gptq"  # (8-bit checkpoints: W8A16, see resolve_weight_format)
    return "none"


# servesim's weight format → the checkpoint quant_method vLLM accepts it for
_CHECKPOINT_METHOD = {"int4-awq": "awq", "int4-gptq": "gptq", "fp8": "fp8", "int8": "int8"}


def check_checkpoint_quantization(model_cfg: ModelConfig, spec: ModelSpec) -> None:
    """vLLM ``ModelConfig._verify_quantization``: a ``quantization`` other than the one of a
    quantized checkpoint (AWQ, GPTQ, FP8 ``quantization_config``) is refused; on an
    unquantized checkpoint any format is servesim's what-if."""
    q, qm = model_cfg.quantization, (spec.quant_method or "").lower()
    if q != "none" and qm in ("awq", "gptq", "fp8") and _CHECKPOINT_METHOD[q] != qm:
        raise ConfigError(
            f"model.quantization: Quantization method specified in the model config ({qm}) "
            f"does not match the quantization method specified in the `quantization` argument "
            f"({q}) (vLLM)")


def resolve_weight_format(model_cfg: ModelConfig, spec: ModelSpec,
                          hw: HardwareSpec) -> WeightFormat:
    """``model.quantization`` (or, when "none", the checkpoint's own ``quantization_config``)
    → :class:`WeightFormat` on this GPU."""
    q = model_cfg.quantization if model_cfg.quantization != "none" else _from_checkpoint(spec)
    if q == "fp8":
        scale = 0.0
        if spec.weight_block_size:
            a, b = spec.weight_block_size
            scale = 4.0 / (a * b)  # one fp32 scale per block
        if hw.has_fast_path("fp8"):
            return WeightFormat("fp8", 1.0 + scale, "fp8", "W8A8 fp8 at the fp8 tensor rate")
        return WeightFormat("fp8", 1.0 + scale, "bf16",
                            f"{hw.name} has no fp8 tensor cores: weight-only FP8 (Marlin), "
                            "bf16 FLOP rate")
    if q == "int8":
        if hw.has_fast_path("int8"):
            return WeightFormat("int8", 1.0, "int8", "W8A8 int8 at the int8 tensor rate")
        return WeightFormat("int8", 1.0, "bf16", "no int8 tensor rate known: bf16 FLOP rate")
    if q in ("int4-awq", "int4-gptq"):
        bits, nbytes = _wna16_bytes(spec)
        name = q if bits == 4 else q.replace("int4", "int8")
        return WeightFormat(name, nbytes, "bf16",
                            f"W{bits}A16: bytes saved, FLOPs at bf16 rate")
    dt = model_cfg.dtype if model_cfg.dtype != "auto" else spec.torch_dtype
    name = "fp16" if dt == "float16" else "bf16"
    return WeightFormat(name, 2.0, "bf16")


def kv_cache_dtype_bytes(cache_dtype: str) -> int:
    """Bytes per cached K/V element: ``auto`` (the model's 16-bit dtype), ``float16``,
    ``bfloat16`` → 2, ``fp8*`` → 1."""
    return 1 if cache_dtype.startswith("fp8") else 2


ACT_BYTES = 2  # activations are bf16/fp16 in every supported format
