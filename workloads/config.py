"""Config section ``workload`` (owned by workloads/): which requests arrive, and when.

Field names follow ``vllm bench serve`` (``--num-prompts``, ``--random-input-len``,
``--request-rate``, ``--burstiness``, ``--max-concurrency``, ``--seed``).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _rate(v):
    """Accept a positive float or ``inf`` (the string, as vLLM's CLI does)."""
    if isinstance(v, str) and v.strip().lower() in ("inf", "+inf", "infinity"):
        return math.inf
    return v


class _Arrivals(_Section):
    request_rate: float = Field(
        math.inf, gt=0, description="Requests/s; inf sends every request at t=0"
    )
    burstiness: float = Field(
        1.0, gt=0, description="Gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier"
    )
    max_concurrency: Optional[PositiveInt] = Field(
        None, description="Client-side cap on in-flight requests (closed loop)"
    )
    seed: int = Field(0, description="vllm bench --seed")

    _v_rate = field_validator("request_rate", mode="before")(_rate)


class RandomWorkload(_Arrivals):
    """``vllm bench serve --dataset-name random``."""

    kind: Literal["random"] = "random"
    num_prompts: PositiveInt = 1000
    input_len: PositiveInt = 1024
    output_len: PositiveInt = 128
    range_ratio: float = Field(0.0, ge=0, lt=1)
    prefix_len: int = Field(0, ge=0)


WorkloadConfig = Annotated[Union[RandomWorkload], Field(discriminator="kind")]
