"""Cost model: hardware/model specs, roofline step time, memory model, calibration reader.

Public API::

    load_model_spec(model_cfg) -> ModelSpec
    load_hardware_spec(hw_cfg) -> HardwareSpec
"""

from servesim.costmodels.batch import BatchShape, OpCost, StepCost
from servesim.costmodels.specs import (
    HardwareSpec,
    ModelSpec,
    load_hardware_spec,
    load_model_spec,
)

__all__ = [
    "BatchShape",
    "HardwareSpec",
    "ModelSpec",
    "OpCost",
    "StepCost",
    "load_hardware_spec",
    "load_model_spec",
]
