"""Cost model: hardware/model specs, roofline step time, memory model, calibration reader.

Public API::

    load_model_spec(model_cfg: ModelConfig) -> ModelSpec
    load_hardware_spec(hw_cfg: HardwareConfig) -> HardwareSpec
    build_cost_model(cfg: ExperimentConfig) -> StepCostModel
        .step_seconds(batch: BatchShape) -> float          # hot path, O(1)
        .step_time(batch: BatchShape) -> StepCost           # same seconds + per-op breakdown
    plan_memory(cfg: ExperimentConfig) -> MemoryPlan        # num_gpu_blocks, log_lines()
    load_calibration(hw_cfg, hw_spec) -> Calibration | None
    scheduler_defaults(hw_spec) -> (max_num_seqs, max_num_batched_tokens)
"""

from servesim.costmodels.batch import BatchShape, OpCost, StepCost
from servesim.costmodels.calibration import Calibration, CalibrationWarning, load_calibration
from servesim.costmodels.engine_defaults import capture_sizes, scheduler_defaults
from servesim.costmodels.memory import MemoryCoefficients, MemoryPlan, plan_memory
from servesim.costmodels.quant import WeightFormat, resolve_weight_format
from servesim.costmodels.specs import (
    HardwareSpec,
    ModelSpec,
    load_hardware_spec,
    load_model_spec,
)
from servesim.costmodels.step import (
    Efficiencies,
    HostOverhead,
    StepCostModel,
    build_cost_model,
)

__all__ = [
    "BatchShape",
    "Calibration",
    "CalibrationWarning",
    "Efficiencies",
    "HardwareSpec",
    "HostOverhead",
    "MemoryCoefficients",
    "MemoryPlan",
    "ModelSpec",
    "OpCost",
    "StepCost",
    "StepCostModel",
    "WeightFormat",
    "build_cost_model",
    "capture_sizes",
    "load_calibration",
    "load_hardware_spec",
    "load_model_spec",
    "plan_memory",
    "resolve_weight_format",
    "scheduler_defaults",
]
