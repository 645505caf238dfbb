"""Speculative decoding in the engine, as vLLM 0.22.1 schedules it.

Config (``speculative_config:``, vLLM's ``SpeculativeConfig`` names) plus servesim's
acceptance model, which replaces the real draft and target distributions:

- ``acceptance: {rate: α}``: geometric acceptance — draft position i (1-based) is accepted
  with probability α given that the earlier ones were, so P(≥ i accepted) = α^i and the mean
  tokens per step (vLLM's "mean acceptance length", bonus token included) is
  (1 − α^(k+1)) / (1 − α);
- ``acceptance: {per_position: [p1, ..., pk]}``: the unconditional per-position acceptance
  rates vLLM reports (``vllm:spec_decode_num_accepted_tokens_per_pos / num_drafts``,
  ``spec_decode_per_position_acceptance_rates`` in ``vllm bench`` results), non-increasing;
- ``acceptance: {column: NAME[, rate: α]}``: a per-request α from the trace column ``NAME``
  (canonical CSV traces keep extra columns in ``RequestSpec.extra``), α for requests
  without one;
- or vLLM's own synthetic rejection sampler (``rejection_sample_method: synthetic`` with
  ``synthetic_acceptance_rates`` or ``synthetic_acceptance_length``), read with vLLM's
  semantics (``_acceptance_length_to_rates``: the minimum-variance schedule).

Draws are seeded (``numpy.random.Generator`` from the run's seed and the replica index) and
use one uniform per draft: the accepted count is the inverse CDF of P(≥ i accepted).

Scheduling (``Scheduler`` hooks, vLLM's structure):

- a request that sampled a token in a step gets k drafts for the next (``spec_tokens``;
  vLLM ``update_draft_token_ids`` sync, ``AsyncScheduler._update_after_schedule``'s
  placeholders async); prefill chunks and preempted requests get none;
- the running loop schedules ``num_tokens_with_spec − num_computed_tokens`` (= 1 + k for a
  decoding request), clamped as usual, and allocates KV for ``num_lookahead_tokens`` more
  (k for EAGLE/MTP/draft models, 0 for n-gram);
- ``update_from_output`` rolls rejections back (:meth:`SpecDecoding.rollback`): the accepted
  count a of s scheduled drafts comes from the acceptance model; ``num_computed_tokens −=
  s − a``; a + 1 tokens are appended, trimmed at a stop (``check_stop`` per token). The
  blocks stay allocated (vLLM overwrites the rejected slots next step), so nothing is freed
  and nothing leaks; the KV cache caches full blocks up to ``num_tokens`` only.
- async scheduling, one batch in flight (``Replica._run_async``): a batch's acceptance is
  drawn when it is scheduled and applied at once; what vLLM does not know until the batch
  returns is kept in ``Request.spec_inflight`` = (batch, rejected, accepted tokens it
  appended): the next
  schedule allocates for the optimistic ``num_computed_tokens`` vLLM holds (+ rejected),
  clamps at ``max_model_len`` from it, and skips a request only when the one token the
  batch in flight surely returns reaches ``max_tokens`` (``Scheduler._clamp``).

Stats per step (:class:`SpecDecodingStats`, vLLM's ``make_spec_decoding_stats``) feed the
``vllm:spec_decode_*`` counters of ``timeseries.csv`` and the ``spec_decode_*`` keys that
``vllm bench serve`` writes to ``result.json``.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator
from servesim.costmodels.config import QUANTIZATION_ALIASES, WEIGHT_FORMATS
from servesim.costmodels.spec_decode import METHODS, num_lookahead_tokens
from servesim.simulator.errors import ConfigError, TraceError

SpecMethod = Literal["ngram", "ngram_gpu", "suffix", "eagle", "eagle3", "mtp", "draft_model",
                     "medusa"]
assert set(SpecMethod.__args__) == set(METHODS)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AcceptanceConfig(_Section):
    """servesim's acceptance model (one of ``rate``, ``per_position``, ``column``)."""

    rate: float | None = Field(None, ge=0, le=1, description="Geometric per-position "
                               "acceptance α (with column: α for rows whose cell is empty; the column must exist)")
    per_position: list[float] | None = Field(
        None, description="Unconditional acceptance rate of draft positions 1..k, as vLLM "
        "reports them (non-increasing)")
    column: str | None = Field(None, description="Trace column holding each request's α")

    @model_validator(mode="after")
    def _one(self):
        if self.per_position is not None:
            if self.rate is not None or self.column is not None:
                raise ValueError("give one of rate, per_position or column (column may come "
                                 "with a rate for requests without a value)")
            _check_rates(self.per_position, "per_position")
        elif self.rate is None and self.column is None:
            raise ValueError("expected {rate: α}, {per_position: [...]} or {column: NAME}")
        return self


def _check_rates(rates: list[float], what: str) -> None:
    if not rates:
        raise ValueError(f"{what}: expected at least one rate")
    if not all(0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"{what}: entries must be in [0, 1], got {rates}")
    if any(rates[i] > rates[i - 1] for i in range(1, len(rates))):
        raise ValueError(f"{what}: must be non-increasing (P(position i accepted) ≤ "
                         f"P(position i-1 accepted)), got {rates}")


class SpeculativeConfig(_Section):
    """``speculative_config``: vLLM's ``SpeculativeConfig`` fields plus ``acceptance``."""

    method: SpecMethod | None = Field(
        None, description="ngram | ngram_gpu | suffix | eagle | eagle3 | mtp | draft_model | "
        "medusa (default with a model: draft_model)")
    num_speculative_tokens: PositiveInt = Field(description="Drafts per step (k)")
    model: str | None = Field(
        None, description="Draft model / head: a file in configs/models/ or a path to a "
        "config.json (draft_model: required; eagle/eagle3: optional, else derived from the "
        "target's layer)")
    draft_tensor_parallel_size: PositiveInt | None = None
    quantization: str | None = None
    enforce_eager: bool | None = None
    prompt_lookup_max: PositiveInt | None = Field(None, description="ngram (accepted; the "
                                                  "acceptance model stands for its matches)")
    prompt_lookup_min: PositiveInt | None = None
    rejection_sample_method: Literal["standard", "synthetic"] = "standard"
    synthetic_acceptance_rates: list[float] | None = None
    synthetic_acceptance_length: float | None = None
    acceptance: AcceptanceConfig | None = None

    @field_validator("method", mode="before")
    @classmethod
    def _method(cls, v):
        if v == "mlp_speculator":  # (a SpeculativeMethod vLLM 0.22.1's model runner refuses)
            raise ValueError("vLLM 0.22.1 refuses it at start-up (GPUModelRunner: \"Unknown "
                             "speculative decoding method: mlp_speculator\")")
        return v

    @field_validator("quantization")
    @classmethod
    def _quantization(cls, v):
        if v is not None and v not in WEIGHT_FORMATS and v not in QUANTIZATION_ALIASES:
            raise ValueError(f"expected {', '.join(WEIGHT_FORMATS)} or vLLM's "
                             f"{', '.join(QUANTIZATION_ALIASES)} (others are not modelled)")
        return v

    @field_validator("prompt_lookup_min")
    @classmethod
    def _lookup(cls, v, info):
        hi = info.data.get("prompt_lookup_max")
        if v is not None and hi is not None and v > hi:  # (vLLM SpeculativeConfig)
            raise ValueError(f"prompt_lookup_min={v} must be <= prompt_lookup_max={hi}")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.method is None:
            if not self.model:
                raise ValueError("method: required (or give model: for a draft model)")
            object.__setattr__(self, "method", "draft_model")
        k = self.num_speculative_tokens
        if self.rejection_sample_method == "synthetic":
            rates, length = self.synthetic_acceptance_rates, self.synthetic_acceptance_length
            if (rates is None) == (length is None):
                raise ValueError("rejection_sample_method='synthetic' requires exactly one of "
                                 "synthetic_acceptance_rates or synthetic_acceptance_length")
            if rates is not None:
                if len(rates) != k:
                    raise ValueError(f"synthetic_acceptance_rates must have length {k}, "
                                     f"got {rates}")
                _check_rates(rates, "synthetic_acceptance_rates")
            elif not 1.0 <= length <= k + 1:
                raise ValueError(f"synthetic_acceptance_length must be in [1, {k + 1}], "
                                 f"got {length}")
            if self.acceptance is not None:
                raise ValueError("acceptance: give either acceptance or vLLM's synthetic "
                                 "rejection sampler, not both")
        else:
            if self.synthetic_acceptance_rates is not None or \
                    self.synthetic_acceptance_length is not None:
                raise ValueError("synthetic_acceptance_rates / synthetic_acceptance_length "
                                 "are only valid with rejection_sample_method='synthetic'")
            if self.acceptance is None:
                raise ValueError("acceptance: required — {rate: α}, {per_position: [...]} or "
                                 "{column: NAME} (or vLLM's rejection_sample_method: "
                                 "synthetic)")
        acc = self.acceptance
        if acc is not None and acc.per_position is not None and len(acc.per_position) != k:
            raise ValueError(f"acceptance.per_position: expected {k} rates (one per draft "
                             f"position), got {len(acc.per_position)}")
        return self


def acceptance_length_to_rates(length: float, n: int) -> list[float]:
    """vLLM ``SpeculativeConfig._acceptance_length_to_rates`` (minimum-variance schedule)."""
    num_drafts = length - 1
    num_full = int(num_drafts)
    return ([1.0] * num_full + [num_drafts - num_full] + [0.0] * (n - num_full - 1))[:n]


def expected_acceptance_length(alpha: float, k: int) -> float:
    """Mean tokens per step under geometric acceptance: (1 − α^(k+1)) / (1 − α)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


# ---------------------------------------------------------------------------------------------
# Acceptance models


class _Uniforms:
    """Seeded uniforms in (0, 1], drawn in blocks (one numpy call per 65,536 draws)."""

    def __init__(self, rng: np.random.Generator, block: int = 65536):
        self.rng, self.block = rng, block
        self.buf: list[float] = []
        self.i = 0

    def __call__(self) -> float:
        i = self.i
        if i >= len(self.buf):
            self.buf = (1.0 - self.rng.random(self.block)).tolist()
            i = 0
        self.i = i + 1
        return self.buf[i]


class GeometricAcceptance:
    """P(≥ i of the drafts accepted) = α^i."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self._log = math.log(alpha) if 0.0 < alpha < 1.0 else None

    def accepted(self, req, s: int, u: float) -> int:
        a = self.alpha
        if a >= 1.0:
            return s
        if a <= 0.0:
            return 0
        n = int(math.log(u) / self._log)
        return n if n < s else s


class PerPositionAcceptance:
    """P(≥ i accepted) = ``rates[i − 1]`` (vLLM's per-position rates, unconditional)."""

    def __init__(self, rates: list[float]):
        self.rates = list(rates)

    def accepted(self, req, s: int, u: float) -> int:
        n = 0
        rates = self.rates
        while n < s and n < len(rates) and u <= rates[n]:
            n += 1
        return n


class ColumnAcceptance:
    """Per-request geometric α from the trace column ``column`` (``RequestSpec.extra``)."""

    def __init__(self, column: str, default: float | None):
        self.column, self.default = column, default
        self._cache: dict[float, GeometricAcceptance] = {}

    def accepted(self, req, s: int, u: float) -> int:
        v = req.spec.extra.get(self.column)
        if v is None or v == "":
            if self.default is None:
                raise TraceError(
                    f"request {req.request_id}: no value in column "
                    f"{self.column!r} (speculative_config.acceptance.column); give "
                    "acceptance.rate for requests without one")
            v = self.default
        try:
            alpha = float(v)
        except (TypeError, ValueError):
            alpha = -1.0
        if not 0.0 <= alpha <= 1.0:
            raise TraceError(f"request {req.request_id}: column {self.column!r} = {v!r}: "
                             "expected an acceptance rate in [0, 1]")
        m = self._cache.get(alpha)
        if m is None:
            m = self._cache[alpha] = GeometricAcceptance(alpha)
        return m.accepted(req, s, u)


def check_acceptance_column(cfg) -> None:
    """``speculative_config.acceptance.column`` must name a column of the workload: only a
    canonical CSV trace keeps its other columns (``RequestSpec.extra``). ``rate``, given with
    a column, is the α of rows whose cell is empty, never of a column the trace lacks (a
    misspelt name would silently run every request at ``rate``). ConfigError otherwise."""
    scfg = getattr(cfg, "speculative_config", None)
    acc = scfg.acceptance if scfg is not None else None
    if acc is None or acc.column is None:
        return
    key, col, wl = "speculative_config.acceptance.column", acc.column, cfg.workload
    if wl.kind != "trace":
        raise ConfigError(f"{key}: {col!r} is read from a trace column, but workload.kind is "
                          f"{wl.kind} (use a canonical CSV trace with that column)")
    import csv

    from servesim.workloads.importers import detect_format
    from servesim.workloads.importers_common import open_text

    fmt = wl.format if wl.format != "auto" else detect_format(wl.path)
    if fmt != "canonical":
        raise ConfigError(f"{key}: {col!r}: only a canonical CSV trace keeps extra columns; "
                          f"{wl.path} is {fmt}")
    with open_text(wl.path, errors="replace") as f:
        header = [c.strip() for c in next(csv.reader(f), [])]
    from servesim.workloads.importers_csv import CANONICAL_OPTIONAL, CANONICAL_REQUIRED

    others = [c for c in header if c and c not in CANONICAL_REQUIRED + CANONICAL_OPTIONAL]
    if col not in others:
        raise ConfigError(f"{key}: {col!r} is not one of the trace's extra columns "
                          f"({', '.join(others) or 'none'} in {wl.path})")


def build_acceptance(scfg: SpeculativeConfig):
    """``speculative_config`` → acceptance model (``accepted(req, s, u) -> int``)."""
    if scfg.rejection_sample_method == "synthetic":
        rates = scfg.synthetic_acceptance_rates or acceptance_length_to_rates(
            scfg.synthetic_acceptance_length, scfg.num_speculative_tokens)
        return PerPositionAcceptance(rates)
    acc = scfg.acceptance
    if acc.per_position is not None:
        return PerPositionAcceptance(acc.per_position)
    if acc.column is not None:
        return ColumnAcceptance(acc.column, acc.rate)
    return GeometricAcceptance(acc.rate)


# ---------------------------------------------------------------------------------------------
# Scheduler-side state


class SpecDecodingStats:
    """vLLM's ``SpecDecodingStats`` for one step (``observe_draft`` per request), plus the
    tokens the step appended (servesim: ``vllm:generation_tokens``)."""

    __slots__ = ("num_accepted_tokens", "num_accepted_tokens_per_pos", "num_draft_tokens",
                 "num_drafts", "num_generation_tokens")

    def __init__(self, num_spec_tokens: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * num_spec_tokens
        self.num_generation_tokens = 0

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted_tokens):
            per_pos[i] += 1


class SpecDecoding:
    """One engine's speculative decoding: k, lookahead, the acceptance draws and the
    rejection rollback (``Scheduler.update_from_output``)."""

    def __init__(self, scfg: SpeculativeConfig, rng: np.random.Generator):
        self.method = scfg.method
        self.num_spec_tokens = scfg.num_speculative_tokens
        self.num_lookahead_tokens = num_lookahead_tokens(self.method, self.num_spec_tokens)
        self.acceptance = build_acceptance(scfg)
        self._u = _Uniforms(rng)

    def new_stats(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_spec_tokens)

    def rollback(self, req, s: int, stats: SpecDecodingStats) -> int:
        """vLLM ``update_from_output`` for a row that verified ``s`` drafts: draw the accepted
        count a, roll ``num_computed_tokens`` back by the s − a rejected tokens, observe the
        draft; return a (the step appends a + 1 tokens, fewer past a stop)."""
        a = self.acceptance.accepted(req, s, self._u())
        if req.num_computed_tokens > 0:
            req.num_computed_tokens -= s - a
        stats.observe_draft(s, a)
        return a

    def lookahead(self, req) -> int:
        """KV slots to reserve past the scheduled tokens: vLLM's ``num_lookahead_tokens``,
        plus the drafts of the batch in flight that will be rejected (vLLM's
        ``num_computed_tokens`` still counts them)."""
        inf = req.spec_inflight
        return self.num_lookahead_tokens + (inf[1] if inf is not None else 0)


class SpecDecodeTotals:
    """Run-wide ``vllm:spec_decode_*`` counters (summed over steps and engines), and the
    ``timeseries.csv`` columns they feed (cumulative, as Prometheus counters)."""

    def __init__(self, num_spec_tokens: int):
        self.k = num_spec_tokens
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.per_pos = [0] * num_spec_tokens
        self.num_generation_tokens = 0

    def columns(self) -> list[str]:
        return (["vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"]
                + [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'
                   for i in range(self.k)]
                + ["vllm:generation_tokens_total"])

    def add(self, st: SpecDecodingStats | None) -> None:
        if st is None:
            return
        self.num_drafts += st.num_drafts
        self.num_draft_tokens += st.num_draft_tokens
        self.num_accepted_tokens += st.num_accepted_tokens
        for i, v in enumerate(st.num_accepted_tokens_per_pos):
            self.per_pos[i] += v
        self.num_generation_tokens += st.num_generation_tokens

    def row(self) -> list[float]:
        return ([self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens]
                + self.per_pos + [self.num_generation_tokens])

    def counters(self) -> dict:
        """``RunResult.counters`` entries."""
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.per_pos),
                "spec_decode_num_generation_tokens": self.num_generation_tokens}
