"""Config sections owned by the cost model: ``model`` and ``hardware`` (vLLM field names)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """``model``: which model, as vLLM's ``ModelConfig`` names it."""

    name: str = Field(
        "llama-3.1-8b",
        description="A file in configs/models/ (HF config.json fields as YAML) or a path to a "
        "Hugging Face config.json",
    )
    max_model_len: PositiveInt | None = Field(
        None, description="Context limit in tokens; default: the model's max_position_embeddings"
    )
    dtype: Literal["auto", "bfloat16", "float16"] = "auto"
    quantization: Literal["none", "fp8", "int8", "int4-awq", "int4-gptq"] = "none"
    enforce_eager: bool = Field(False, description="vLLM --enforce-eager: no CUDA graphs")


class HardwareConfig(_Section):
    """``hardware``: a GPU from configs/hardware/ by ``name``, optionally with spec fields
    overridden inline (or a fully inline spec when ``name`` is not a shipped file)."""

    name: str = "a100-sxm4-80gb"
    bf16_tflops: float | None = Field(None, gt=0, description="Dense BF16/FP16 tensor TFLOP/s")
    fp8_tflops: float | None = Field(None, gt=0, description="Dense FP8 tensor TFLOP/s")
    int8_tops: float | None = Field(None, gt=0, description="Dense INT8 tensor TOP/s")
    memory_gib: float | None = Field(None, gt=0, description="Device memory, GiB")
    mem_bw_gbps: float | None = Field(None, gt=0, description="HBM bandwidth, GB/s")
    l2_mib: float | None = Field(None, gt=0)
    num_sms: int | None = Field(None, gt=0)
    link_bw_gbps: float | None = Field(
        None, gt=0, description="Intra-node GPU-GPU bandwidth per direction, GB/s"
    )
    link_latency_us: float | None = Field(None, ge=0)
    pcie_bw_gbps: float | None = Field(None, gt=0)
    calibration: str | None = Field(
        "auto",
        description='"auto": per op family, your measured <calibration dir>/<name>.yaml, else '
        'the shipped configs/calibration/<name>.json (default efficiencies when neither '
        'exists); "none": default efficiencies; or a path to one calibration file',
    )
