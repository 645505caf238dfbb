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
from servesim.workloads.schema import MAX_ARRIVAL_S, MAX_REQUESTS, MAX_TOKENS, MIN_RATE


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _rate(v):
    """Accept a positive float or ``inf`` (the string, as vLLM's CLI does)."""
    if isinstance(v, str) and v.strip().lower() in ("inf", "+inf", "infinity"):
        return math.inf
    return v


def _min_rate(v):
    """A finite rate sends one request per 1/rate s at most MAX_ARRIVAL_S apart (inf is fine)."""
    if v is not None and v < MIN_RATE:
        raise ValueError(f"expected inf or a rate of at least {MIN_RATE:g}/s (one request per "
                         f"{MAX_ARRIVAL_S:g} s, the longest run)")
    return v


def _check_span(n: int, rate: float, what: str) -> None:
    """``n`` requests at ``rate``/s (vLLM's arrivals end at n/rate) within MAX_ARRIVAL_S."""
    if not math.isinf(rate) and n / rate > MAX_ARRIVAL_S:
        raise ValueError(f"{what} = {n / rate:.3g} s, longer than the longest run "
                         f"({MAX_ARRIVAL_S:g} s); raise the rate")


def _check_warmup(w, n: int | None, last_send_s: float | None) -> None:
    """Refuse a warm-up that covers all ``n`` requests of an unstaged run (nothing measured)."""
    if w is None:
        return
    if w.num_requests is not None and n is not None and w.num_requests >= n:
        raise ValueError(f"warmup.num_requests ({w.num_requests}) covers all {n} requests: "
                         "nothing would be measured")
    if w.duration_s is not None and last_send_s is not None and w.duration_s > last_send_s:
        raise ValueError(f"warmup.duration_s ({w.duration_s:g} s) covers the whole run (the "
                         f"last request is sent at {last_send_s:g} s): nothing would be measured")


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
    duration_s: float | None = Field(None, gt=0, le=MAX_ARRIVAL_S, allow_inf_nan=False,
                                     description="Stage length, s")
    num_requests: PositiveInt | None = Field(None, le=MAX_REQUESTS,
                                             description="Requests in the stage")
    arrivals: Literal["poisson", "constant", "gamma", "inference-perf"] = Field(
        "poisson", description="Open-loop gaps: poisson (exponential), constant, gamma "
        "(burstiness), inference-perf (exponential gaps rescaled to end at duration_s)")
    burstiness: float = Field(1.0, gt=0, description="Gamma shape for arrivals: gamma")
    warmup: bool = Field(False, description="The whole stage is warm-up (excluded from metrics)")
    barrier: bool = Field(True, description="Start when the previous stage has drained")
    gap_s: float = Field(0.0, ge=0, le=MAX_ARRIVAL_S, allow_inf_nan=False,
                         description="Idle seconds before the stage starts")
    grace_s: float | None = Field(
        None, ge=0, le=MAX_ARRIVAL_S, allow_inf_nan=False, description="After duration_s, cancel requests still in flight after this "
        "many seconds (None: wait for them)")
    label: str | None = None

    _v_rate = field_validator("rate", mode="before")(_rate)
    _v_min_rate = field_validator("rate")(_min_rate)

    @model_validator(mode="after")
    def _check(self):
        if self.rate is None and self.concurrency is None:
            raise ValueError("a stage needs rate (open loop) or concurrency (closed loop)")
        if self.duration_s is None and self.num_requests is None:
            raise ValueError("a stage needs duration_s or num_requests")
        if (self.rate is not None and math.isinf(self.rate) and self.num_requests is None):
            raise ValueError("rate: inf needs num_requests (all are sent at once)")
        if self.rate is not None and self.num_requests is None:
            n = self.rate * self.duration_s  # int(rate * duration_s) requests (stages.py)
            if n > MAX_REQUESTS:
                raise ValueError(f"rate × duration_s = {n:.3g} requests, more than "
                                 f"{MAX_REQUESTS:.0e} in one stage")
            if n < 1:
                raise ValueError(f"rate × duration_s = {self.rate:g} × {self.duration_s:g} "
                                 "rounds to 0 requests (int(rate·duration_s)); raise rate or "
                                 "duration_s, or give num_requests")
        if self.rate is not None and self.num_requests is not None and self.duration_s is None:
            _check_span(self.num_requests, self.rate, "num_requests / rate")
        return self


class Warmup(_Section):
    """Leading requests of each stage (or of the run) excluded from the metrics."""

    duration_s: float | None = Field(None, gt=0, le=MAX_ARRIVAL_S, allow_inf_nan=False,
                                     description="Requests sent in the first s")
    num_requests: PositiveInt | None = Field(None, le=MAX_REQUESTS,
                                             description="The first N requests")

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

    @field_validator("stages")
    @classmethod
    def _some_stages(cls, v):
        from servesim.workloads.stages import check_plan, stage_plan

        if v is not None and not v:
            raise ValueError("an empty list has no stage: list at least one, or leave stages "
                             "out for an unstaged run")
        if v:
            check_plan(stage_plan(v))
        return v

    @field_validator("warmup")
    @classmethod
    def _warm_stages(cls, v, info):
        from servesim.workloads.stages import check_plan, stage_plan

        if v is not None and info.data.get("stages"):
            check_plan(stage_plan(info.data["stages"]), v.model_dump(exclude_none=True))
        return v


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
    ramp_up_start_rps: float | None = Field(None, ge=MIN_RATE, allow_inf_nan=False,
                                            description="Requests/s at the start")
    ramp_up_end_rps: float | None = Field(None, ge=MIN_RATE, allow_inf_nan=False,
                                          description="Requests/s at the end")

    _v_rate = field_validator("request_rate", "burstiness", mode="before")(_rate)
    _v_min_rate = field_validator("request_rate")(_min_rate)

    @model_validator(mode="after")
    def _check_ramp_up(self):
        if self.stages:  # each stage sets its own load: say so where one is set besides
            given = [f"{k} {getattr(self, k)}" for k in ("request_rate", "ramp_up_strategy")
                     if k in self.model_fields_set and getattr(self, k) not in (math.inf, None)]
            if given:
                import warnings

                warnings.warn(f"workload.{given[0]} is not used: the stages set each stage's "
                              "load (rate or concurrency)", stacklevel=2)
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
    num_prompts: PositiveInt = Field(1000, le=MAX_REQUESTS)
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
        if not self.stages:
            _check_span(self.num_prompts, self.request_rate, "num_prompts / request_rate")
            _check_warmup(self.warmup, self.num_prompts, None if self.ramp_up_strategy else
                          self.num_prompts / self.request_rate)
        return self


# --------------------------------------------------------------------------------------------
# Length distributions (tokens; also used for turn counts and think times)


class FixedDist(_Section):
    dist: Literal["fixed"] = "fixed"
    value: float = Field(..., ge=0, allow_inf_nan=False)


class UniformDist(_Section):
    """Integers uniform in [low, high] inclusive (reals for think times)."""

    dist: Literal["uniform"] = "uniform"
    low: float = Field(..., ge=0, allow_inf_nan=False)
    high: float = Field(..., ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _order(self):
        if self.low > self.high:
            raise ValueError("low must be <= high")
        return self


class LognormalDist(_Section):
    """exp(N(ln median, sigma²)), rounded, clipped to [min, max]."""

    dist: Literal["lognormal"] = "lognormal"
    median: float = Field(..., gt=0, allow_inf_nan=False)
    sigma: float = Field(..., ge=0, allow_inf_nan=False)
    min: float = Field(1, ge=0, allow_inf_nan=False)
    max: float | None = Field(None, gt=0, allow_inf_nan=False)


class ExponentialDist(_Section):
    dist: Literal["exponential"] = "exponential"
    mean: float = Field(..., gt=0, allow_inf_nan=False)


class EmpiricalDist(_Section):
    """Resample (with replacement) the lengths of a trace file."""

    dist: Literal["empirical"] = "empirical"
    path: str
    format: str = "auto"
    column: Literal["prompt_len", "output_len"] = "prompt_len"


_DIST_FORMS = ("a number or a distribution {dist: fixed|uniform|lognormal|exponential|"
               "empirical, ...}")


def _shorthand(v):
    """A bare number (also a string YAML 1.1 leaves unparsed: ``1e9``) means
    ``{dist: fixed, value: N}``."""
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise ValueError(f"expected {_DIST_FORMS}") from None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return {"dist": "fixed", "value": v}
    if not isinstance(v, (dict, BaseModel)):
        raise ValueError(f"expected {_DIST_FORMS}")  # noqa: TRY004 (pydantic reports ValueError)
    return v


def _dist_limit(limit: float, unit: str):
    """A validator: the distribution's scale (fixed value, uniform high, lognormal median /
    min / max, exponential mean) at most ``limit`` (samples are clipped to it as well)."""
    def check(d):
        for k in ("value", "high", "median", "min", "max", "mean"):
            x = getattr(d, k, None)
            if x is not None and x > limit:
                top = f"{limit:g}" if float(f"{limit:g}") == limit else str(int(limit))
                raise ValueError(f"{k}: {x:g} is more than {top} {unit}")
        return d
    return check


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
    period_s: float = Field(86400.0, gt=0, le=MAX_ARRIVAL_S, allow_inf_nan=False)
    amplitude: float = Field(0.5, ge=0, lt=1)
    phase: float = Field(0.0, allow_inf_nan=False)
    resolution_s: float = Field(60.0, gt=0, le=MAX_ARRIVAL_S, allow_inf_nan=False)

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
            if any(not math.isfinite(t) or t > MAX_ARRIVAL_S or not math.isfinite(r)
                   or 0 < r < MIN_RATE for t, r in self.points):
                raise ValueError(f"points: times must be finite and at most {MAX_ARRIVAL_S:g} s, "
                                 f"rates finite and 0 or at least {MIN_RATE:g}/s")
        return self


class SyntheticWorkload(_Common):
    """Length distributions, shared-prefix groups and a (time-varying) Gamma arrival process."""

    kind: Literal["synthetic"] = "synthetic"
    num_prompts: PositiveInt = Field(1000, le=MAX_REQUESTS)
    request_rate: float = Field(math.inf, gt=0, description="Mean requests/s (scaled by profile)")
    burstiness: float = Field(1.0, gt=0)
    rate_profile: RateProfile | None = None
    input: LengthDist = Field(default_factory=lambda: FixedDist(value=1024))
    output: LengthDist = Field(default_factory=lambda: FixedDist(value=128))
    prefix_groups: PrefixGroups | None = None

    _v_rate = field_validator("request_rate", "burstiness", mode="before")(_rate)
    _v_min_rate = field_validator("request_rate")(_min_rate)
    _v_lengths = field_validator("input", "output")(_dist_limit(MAX_TOKENS, "tokens"))

    @model_validator(mode="after")
    def _check_run(self):
        if not self.stages:
            _check_span(self.num_prompts, self.request_rate, "num_prompts / request_rate")
            _check_warmup(self.warmup, self.num_prompts, None if self.rate_profile else
                          self.num_prompts / self.request_rate)
        return self


class SessionsWorkload(_Common):
    """Multi-turn chat sessions: turn k+1 re-sends turn k's prompt and output plus new user
    tokens, ``think_time_s`` after turn k finishes (closed loop, applied by the engine)."""

    kind: Literal["sessions"] = "sessions"
    num_sessions: PositiveInt = Field(100, le=MAX_REQUESTS)
    session_rate: float = Field(math.inf, gt=0, description="New sessions/s (vLLM Gamma process)")
    burstiness: float = Field(1.0, gt=0)
    turns: LengthDist = Field(default_factory=lambda: FixedDist(value=4))
    system_prompt_len: int = Field(0, ge=0, le=MAX_TOKENS,
                                   description="Tokens shared by every session")
    first_input: LengthDist = Field(default_factory=lambda: FixedDist(value=256))
    user_input: LengthDist = Field(default_factory=lambda: FixedDist(value=64))
    output: LengthDist = Field(default_factory=lambda: FixedDist(value=128))
    think_time_s: LengthDist = Field(default_factory=lambda: ExponentialDist(mean=5.0))
    max_context_len: PositiveInt | None = Field(
        None, description="End a session before a turn would exceed this (default max_model_len)"
    )

    _v_rate = field_validator("session_rate", "burstiness", mode="before")(_rate)
    _v_min_rate = field_validator("session_rate")(_min_rate)
    _v_lengths = field_validator("turns", "first_input", "user_input", "output")(
        _dist_limit(MAX_TOKENS, "tokens"))
    _v_think = field_validator("think_time_s")(_dist_limit(MAX_ARRIVAL_S, "s"))

    @field_validator("turns")
    @classmethod
    def _one_turn(cls, v):
        if (isinstance(v, FixedDist) and v.value < 1) or (isinstance(v, UniformDist)
                                                           and v.high < 1):
            raise ValueError("a session has at least 1 turn")
        return v

    @model_validator(mode="after")
    def _check_sessions(self):
        _check_span(self.num_sessions, self.session_rate, "num_sessions / session_rate")
        return self


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

    @field_validator("sweep_rates")
    @classmethod
    def _finite_rates(cls, v):
        if v is not None and not all(math.isfinite(r) and r >= MIN_RATE for r in v):
            raise ValueError(f"expected finite rates of at least {MIN_RATE:g}/s")
        return v


WorkloadConfig = Annotated[
    RandomWorkload | TraceWorkload | SyntheticWorkload | SessionsWorkload | ProfileWorkload,
    Field(discriminator="kind"),
]
