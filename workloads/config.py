"""Config section ``workload`` (owned by workloads/): which requests arrive, and when.

Field names follow ``vllm bench serve`` (``--num-prompts``, ``--random-input-len``,
``--request-rate``, ``--burstiness``, ``--max-concurrency``, ``--seed``, ``--ramp-up-*``).
The section is a discriminated union on ``kind``: ``random`` (vLLM's RandomDataset),
``trace`` (a file, see :mod:`servesim.workloads.importers`), ``synthetic`` (length
distributions, shared-prefix groups, rate profiles) and ``sessions`` (multi-turn chats).
"""

from __future__ import annotations

import itertools
import math
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveInt,
    field_validator,
    model_validator,
)
from servesim.workloads.schema import MAX_TOKENS


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _rate(v):
    """Accept a positive float or ``inf`` (the string, as vLLM's CLI does)."""
    if isinstance(v, str) and v.strip().lower() in ("inf", "+inf", "infinity"):
        return math.inf
    return v


LongRequests = Literal["keep", "clamp", "reject"]
_LONG_DOC = (
    "Requests longer than max_model_len: keep (the engine rejects them, as vLLM does), "
    "clamp (shorten prompt, then output) or reject (drop here); counted in meta"
)


class Stage(_Section):
    """One load stage (see ``workloads/stages.py``): open loop at ``rate`` req/s, or closed
    loop with ``concurrency`` requests in flight (both: open loop capped at ``concurrency``),
    for ``duration_s`` and/or ``num_requests``. Stages run one after the other; by default a
    stage starts when every request of the previous one has ended, plus ``gap_s`` (what
    inference-perf, GuideLLM and AIPerf do)."""

    rate: float | None = Field(None, gt=0, description="Requests/s (open loop); inf = all at once")
    concurrency: PositiveInt | None = Field(None, description="Requests in flight (closed loop)")
    duration_s: float | None = Field(None, gt=0, description="Stage length, s")
    num_requests: PositiveInt | None = Field(None, description="Requests in the stage")
    arrivals: Literal["poisson", "constant", "gamma", "inference-perf"] = Field(
        "poisson", description="Open-loop gaps: poisson (exponential), constant, gamma "
        "(burstiness), inference-perf (exponential gaps rescaled to end at duration_s)")
    burstiness: float = Field(1.0, gt=0, description="Gamma shape for arrivals: gamma")
    warmup: bool = Field(False, description="The whole stage is warm-up (excluded from metrics)")
    barrier: bool = Field(True, description="Start when the previous stage has drained")
    gap_s: float = Field(0.0, ge=0, description="Idle seconds before the stage starts")
    grace_s: float | None = Field(
        None, ge=0, description="After duration_s, cancel requests still in flight after this "
        "many seconds (None: wait for them)")
    label: str | None = None

    _v_rate = field_validator("rate", mode="before")(_rate)

    @model_validator(mode="after")
    def _check(self):
        if self.rate is None and self.concurrency is None:
            raise ValueError("a stage needs rate (open loop) or concurrency (closed loop)")
        if self.duration_s is None and self.num_requests is None:
            raise ValueError("a stage needs duration_s or num_requests")
        if (self.rate is not None and math.isinf(self.rate) and self.num_requests is None):
            raise ValueError("rate: inf needs num_requests (all are sent at once)")
        return self


class Warmup(_Section):
    """Leading requests of each stage (or of the run) excluded from the metrics."""

    duration_s: float | None = Field(None, gt=0, description="Requests sent in the first s")
    num_requests: PositiveInt | None = Field(None, description="The first N requests")

    @model_validator(mode="after")
    def _one(self):
        if (self.duration_s is None) == (self.num_requests is None):
            raise ValueError("warmup needs exactly one of duration_s, num_requests")
        return self


class _Common(_Section):
    max_concurrency: PositiveInt | None = Field(
        None, description="Client-side cap on in-flight requests (closed loop)"
    )
    seed: int = Field(0, ge=0, le=2**32 - 1, description="vllm bench --seed (numpy: 0..2**32-1)")
    long_requests: LongRequests = Field("keep", description=_LONG_DOC)
    stages: list[Stage] | None = Field(
        None, description="Staged load replacing the kind's arrival process (workloads/stages.py)")
    warmup: Warmup | None = Field(None, description="Leading requests excluded from the metrics")


class _Arrivals(_Common):
    request_rate: float = Field(
        math.inf, gt=0, description="Requests/s; inf sends every request at t=0"
    )
    burstiness: float = Field(
        1.0, gt=0, description="Gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier"
    )
    ramp_up_strategy: Literal["linear", "exponential"] | None = Field(
        None, description="vllm bench --ramp-up-strategy (then request_rate must stay inf)"
    )
    ramp_up_start_rps: float | None = Field(None, gt=0, description="Requests/s at the start")
    ramp_up_end_rps: float | None = Field(None, gt=0, description="Requests/s at the end")

    _v_rate = field_validator("request_rate", "burstiness", mode="before")(_rate)

    @model_validator(mode="after")
    def _check_ramp_up(self):
        if self.ramp_up_strategy is None:
            return self
        if not math.isinf(self.request_rate):
            raise ValueError("with ramp_up_strategy, leave request_rate unset (inf), as vLLM does")
        if self.ramp_up_start_rps is None or self.ramp_up_end_rps is None:
            raise ValueError("ramp_up_strategy needs ramp_up_start_rps and ramp_up_end_rps")
        if self.ramp_up_start_rps > self.ramp_up_end_rps:
            raise ValueError("ramp_up_start_rps must be <= ramp_up_end_rps")
        return self


Ratio = Annotated[float, Field(ge=0, lt=1)]


class RangeRatios(_Section):
    """``--random-range-ratio '{"input": r1, "output": r2}'``: separate ratios."""

    input: Ratio
    output: Ratio


class RandomWorkload(_Arrivals):
    """``vllm bench serve --dataset-name random``."""

    kind: Literal["random"] = "random"
    num_prompts: PositiveInt = 1000
    input_len: int = Field(1024, ge=1, le=MAX_TOKENS)
    output_len: int = Field(128, ge=1, le=MAX_TOKENS)
    range_ratio: Ratio | RangeRatios = Field(
        0.0, description="one ratio for input and output lengths, or {input: r1, output: r2}")
    prefix_len: int = Field(0, ge=0, le=MAX_TOKENS)

    @property
    def range_ratios(self) -> tuple[float, float]:
        """(input, output) range ratios (vLLM ``_resolve_range_ratios``)."""
        r = self.range_ratio
        return (r.input, r.output) if isinstance(r, RangeRatios) else (r, r)

    @field_validator("range_ratio")
    @classmethod
    def _one_ratio(cls, v):
        """Equal ratios are the one-ratio form (same run, same config hash)."""
        return v.input if isinstance(v, RangeRatios) and v.input == v.output else v

    @model_validator(mode="after")
    def _min_input(self):
        if self.prefix_len + math.floor(self.input_len * (1 - self.range_ratios[0])) < 1:
            raise ValueError(
                "prefix_len + floor(input_len*(1-range_ratio)) must be at least 1 (as in vLLM)"
            )
        return self


# --------------------------------------------------------------------------------------------
# Length distributions (tokens; also used for turn counts and think times)


class FixedDist(_Section):
    dist: Literal["fixed"] = "fixed"
    value: float = Field(..., ge=0)


class UniformDist(_Section):
    """Integers uniform in [low, high] inclusive (reals for think times)."""

    dist: Literal["uniform"] = "uniform"
    low: float = Field(..., ge=0)
    high: float = Field(..., ge=0)

    @model_validator(mode="after")
    def _order(self):
        if self.low > self.high:
            raise ValueError("low must be <= high")
        return self


class LognormalDist(_Section):
    """exp(N(ln median, sigma²)), rounded, clipped to [min, max]."""

    dist: Literal["lognormal"] = "lognormal"
    median: float = Field(..., gt=0)
    sigma: float = Field(..., ge=0)
    min: float = Field(1, ge=0)
    max: float | None = Field(None, gt=0)


class ExponentialDist(_Section):
    dist: Literal["exponential"] = "exponential"
    mean: float = Field(..., gt=0)


class EmpiricalDist(_Section):
    """Resample (with replacement) the lengths of a trace file."""

    dist: Literal["empirical"] = "empirical"
    path: str
    format: str = "auto"
    column: Literal["prompt_len", "output_len"] = "prompt_len"


def _shorthand(v):
    """A bare number means ``{dist: fixed, value: N}``."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return {"dist": "fixed", "value": v}
    return v


LengthDist = Annotated[
    FixedDist | UniformDist | LognormalDist | ExponentialDist | EmpiricalDist,
    Field(discriminator="dist"),
    BeforeValidator(_shorthand),
]


class PrefixGroups(_Section):
    """N shared system prompts; each request picks group k with probability ∝ 1/k^zipf_s."""

    num_groups: PositiveInt = 1
    lengths: list[PositiveInt] = Field(
        default_factory=lambda: [512], description="Tokens per group prompt (cycled over groups)"
    )
    zipf_s: float = Field(1.0, ge=0, description="Zipf exponent of group popularity (0 = uniform)")
    fraction: float = Field(1.0, ge=0, le=1, description="Share of requests that use a group")


class RateProfile(_Section):
    """Time-varying request rate. ``piecewise``: ``points`` = [[t_s, rate], ...], rate held from
    each t_s to the next. ``diurnal``: rate = mean·(1 + amplitude·sin(2π(t/period_s) + phase)),
    stepped every ``resolution_s``. The profile repeats after its last point / period."""

    kind: Literal["piecewise", "diurnal"] = "piecewise"
    points: list[tuple[float, float]] = Field(default_factory=list)
    period_s: float = Field(86400.0, gt=0)
    amplitude: float = Field(0.5, ge=0, lt=1)
    phase: float = 0.0
    resolution_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _check(self):
        if self.kind == "piecewise":
            if not self.points:
                raise ValueError("piecewise rate profile needs points [[t_s, rate], ...]")
            ts = [p[0] for p in self.points]
            if ts[0] != 0 or any(b <= a for a, b in itertools.pairwise(ts)):
                raise ValueError("points must start at t_s=0 and increase")
            if any(r < 0 for _, r in self.points) or not any(r > 0 for _, r in self.points):
                raise ValueError("rates must be >= 0 and not all 0")
        return self


class SyntheticWorkload(_Common):
    """Length distributions, shared-prefix groups and a (time-varying) Gamma arrival process."""

    kind: Literal["synthetic"] = "synthetic"
    num_prompts: PositiveInt = 1000
    request_rate: float = Field(math.inf, gt=0, description="Mean requests/s (scaled by profile)")
    burstiness: float = Field(1.0, gt=0)
    rate_profile: RateProfile | None = None
    input: LengthDist = Field(default_factory=lambda: FixedDist(value=1024))
    output: LengthDist = Field(default_factory=lambda: FixedDist(value=128))
    prefix_groups: PrefixGroups | None = None

    _v_rate = field_validator("request_rate", "burstiness", mode="before")(_rate)


class SessionsWorkload(_Common):
    """Multi-turn chat sessions: turn k+1 re-sends turn k's prompt and output plus new user
    tokens, ``think_time_s`` after turn k finishes (closed loop, applied by the engine)."""

    kind: Literal["sessions"] = "sessions"
    num_sessions: PositiveInt = 100
    session_rate: float = Field(math.inf, gt=0, description="New sessions/s (vLLM Gamma process)")
    burstiness: float = Field(1.0, gt=0)
    turns: LengthDist = Field(default_factory=lambda: FixedDist(value=4))
    system_prompt_len: int = Field(0, ge=0, description="Tokens shared by every session")
    first_input: LengthDist = Field(default_factory=lambda: FixedDist(value=256))
    user_input: LengthDist = Field(default_factory=lambda: FixedDist(value=64))
    output: LengthDist = Field(default_factory=lambda: FixedDist(value=128))
    think_time_s: LengthDist = Field(default_factory=lambda: ExponentialDist(mean=5.0))
    max_context_len: PositiveInt | None = Field(
        None, description="End a session before a turn would exceed this (default max_model_len)"
    )

    _v_rate = field_validator("session_rate", "burstiness", mode="before")(_rate)


TraceFormat = Literal[
    "auto", "canonical", "azure2023", "azure2024", "burstgpt", "mooncake", "sharegpt",
    "vidur", "vllm_result",
]


class TraceWorkload(_Common):
    """Replay a trace file. Timestamps are shifted so the first request arrives at t=0."""

    kind: Literal["trace"] = "trace"
    path: str
    format: TraceFormat = "auto"
    skip_bad_rows: bool = False
    time_scale: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="Multiply arrival times (2.0 = half the rate)"
    )
    request_rate: float | None = Field(
        None, gt=0, description="Rescale to this mean rate (requests/s); for formats without "
        "timestamps, the rate of vLLM's Gamma arrivals (default inf)"
    )
    burstiness: float = Field(1.0, gt=0, description="For generated arrivals only")
    use_timestamps: bool = Field(True, description="False: vLLM-style generated arrivals")
    start_s: float | None = Field(None, ge=0, allow_inf_nan=False,
                                  description="Window start, s after first row")
    end_s: float | None = Field(None, gt=0, description="Window end, s after first row")
    max_requests: PositiveInt | None = Field(None, description="Keep the first N (in window)")
    sample: PositiveInt | None = Field(None, description="Keep N random requests (seeded)")
    # format-specific
    model: str | None = Field(None, description="BurstGPT: keep only this Model")
    log_type: str | None = Field(None, description="BurstGPT: keep only this Log Type")
    keep_failed: bool = Field(False, description="BurstGPT/vllm_result: keep failed requests")
    tokenizer: str | None = Field(None, description="ShareGPT: local HF tokenizer name/path")
    sharegpt_output_len: PositiveInt | None = None
    sharegpt_filter: bool = Field(True, description="vLLM's ShareGPT length filters")

    _v_rate = field_validator("request_rate", "burstiness", mode="before")(_rate)

    @model_validator(mode="after")
    def _window(self):
        if self.start_s is not None and self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError("end_s must be > start_s")
        return self


ProfileFormat = Literal["auto", "inference-perf", "guidellm", "aiperf", "genai-perf"]


class ProfileWorkload(_Common):
    """A benchmark client's own load profile (inference-perf config YAML, GuideLLM scenario,
    AIPerf / genai-perf config), replayed as that client sends it (``workloads/profiles.py``).
    ``stages`` / ``warmup`` given here replace the profile's."""

    kind: Literal["profile"] = "profile"
    path: str
    format: ProfileFormat = "auto"
    benchmarks: list[int] | None = Field(
        None, description="GuideLLM: run only these benchmark indices (default all)")
    sweep_rates: list[float] | None = Field(
        None, description="GuideLLM sweep: the rates of its constant/poisson benchmarks "
        "(a sweep measures them; default: derived by simulate sweep, else none)")

    _v_rates = field_validator("sweep_rates", mode="before")(
        lambda v: [_rate(x) for x in v] if isinstance(v, list) else v)


WorkloadConfig = Annotated[
    RandomWorkload | TraceWorkload | SyntheticWorkload | SessionsWorkload | ProfileWorkload,
    Field(discriminator="kind"),
]
