"""Synthetic request generators: vLLM's ``random`` dataset, ``synthetic`` and ``sessions``.

Block-id ranges (``prefix_block_ids`` are opaque ints; equal leading ids = shared prefix):
random shared prefix ``RANDOM_PREFIX_BASE + j``; synthetic prefix groups
``SYNTHETIC_GROUP_BASE + g·2^24 + j``; sessions ``SESSION_BASE + counter`` (system prompt
``SESSION_SYSTEM_BASE + j``); Mooncake ``MOONCAKE_BASE + h·512 + end offset`` (importers).
All ids are < 2^62.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np
from servesim.workloads.arrivals import CHUNK, gamma_renewal_unit, vllm_arrival_times
from servesim.workloads.config import (
    EmpiricalDist,
    ExponentialDist,
    FixedDist,
    LognormalDist,
    RandomWorkload,
    RateProfile,
    SessionsWorkload,
    SyntheticWorkload,
    UniformDist,
)
from servesim.workloads.schema import MAX_ARRIVAL_S, MAX_TOKENS, RequestSpec

RANDOM_PREFIX_BASE = 1 << 56
SYNTHETIC_GROUP_BASE = 2 << 56
SESSION_SYSTEM_BASE = 3 << 56
SESSION_BASE = 4 << 56
MOONCAKE_BASE = 5 << 56


# --------------------------------------------------------------------------------------------
# vLLM RandomDataset


def random_len_bounds(input_len: int, output_len: int, range_ratio: float,
                      num_special_tokens: int = 0,
                      output_range_ratio: float | None = None) -> tuple[int, int, int, int]:
    """vLLM ``datasets.utils.get_sampling_params`` bounds (inclusive), tokens.

    low = floor(L·(1−r)), high = ceil(L·(1+r)), output low/high at least 1, with the input's
    ratio ``range_ratio`` and the output's ``output_range_ratio`` (default: the same; vLLM's
    ``{"input": r1, "output": r2}`` form); L for the input is ``input_len −
    num_special_tokens`` (0 here: no tokenizer)."""
    r_out = range_ratio if output_range_ratio is None else output_range_ratio
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("input_range_ratio must be in [0, 1).")
    if not 0.0 <= r_out < 1.0:
        raise ValueError("output_range_ratio must be in [0, 1).")
    real_input_len = max(0, int(input_len) - num_special_tokens)
    input_low = math.floor(real_input_len * (1 - range_ratio))
    input_high = math.ceil(real_input_len * (1 + range_ratio))
    output_low = max(math.floor(output_len * (1 - r_out)), 1)
    output_high = max(math.ceil(output_len * (1 + r_out)), 1)
    return input_low, input_high, output_low, output_high


def _length_chunks(seed: int, n: int, bounds: list[tuple[int, int]]) -> Iterator[np.ndarray]:
    """The last of ``len(bounds)`` successive ``default_rng(seed).integers(lo, hi + 1, size=n)``
    calls, in chunks (bounded-integer draws chunk without changing the stream; the earlier
    calls are replayed and discarded, so memory stays O(chunk))."""
    rng = np.random.default_rng(seed)
    for k, (low, high) in enumerate(bounds):
        for lo in range(0, n, CHUNK):
            x = rng.integers(low, high + 1, size=min(n, lo + CHUNK) - lo)
            if k == len(bounds) - 1:
                yield x


def random_requests(cfg: RandomWorkload, block_size: int) -> Iterator[RequestSpec]:
    """vLLM ``RandomDataset.sample`` + ``get_request``: ``num_prompts`` requests.

    ``np.random.default_rng(seed)`` draws all input lengths, then all output lengths, each
    uniform on the inclusive bounds of :func:`random_len_bounds`; prompt_len = prefix_len +
    input length (vLLM's ``total_input_len``). The ``prefix_len`` shared tokens are identical
    for every request, so their ``prefix_len // block_size`` full blocks get the same ids; a
    partial prefix block is unique per request (it also holds the request's own tokens)."""
    n = cfg.num_prompts
    r_in, r_out = cfg.range_ratios
    in_lo, in_hi, out_lo, out_hi = random_len_bounds(cfg.input_len, cfg.output_len, r_in,
                                                     output_range_ratio=r_out)
    if cfg.prefix_len + in_lo < 1:
        raise ValueError("prefix_len + minimum sampled input_len must be at least 1")
    shared = cfg.prefix_len // block_size
    prefix_ids = tuple(RANDOM_PREFIX_BASE + j for j in range(shared)) if shared else None
    ins = _length_chunks(cfg.seed, n, [(in_lo, in_hi)])
    outs = _length_chunks(cfg.seed, n, [(in_lo, in_hi), (out_lo, out_hi)])
    arr = vllm_arrival_times(n, cfg.request_rate, cfg.burstiness, cfg.seed,
                             cfg.ramp_up_strategy, cfg.ramp_up_start_rps, cfg.ramp_up_end_rps)
    i = 0
    for a, il, ol in zip(arr, ins, outs):
        for t, p, o in zip(a.tolist(), il.tolist(), ol.tolist()):
            yield RequestSpec(arrival_s=t, prompt_len=cfg.prefix_len + p, output_len=o,
                              request_id=str(i), prefix_block_ids=prefix_ids)
            i += 1


# --------------------------------------------------------------------------------------------
# Length distributions


class LengthSampler:
    """Draws from a config length distribution with its own Generator (tokens, rounded ≥ 1
    unless ``integer=False``, e.g. think times in seconds). Draws are clipped to MAX_TOKENS
    (integers) or MAX_ARRIVAL_S seconds (a lognormal tail of a huge sigma overflows)."""

    def __init__(self, dist, rng: np.random.Generator, integer: bool = True, minimum: int = 1):
        self.dist, self.rng, self.integer, self.minimum = dist, rng, integer, minimum
        self._values = None
        if isinstance(dist, EmpiricalDist):
            from servesim.workloads.importers import read_trace

            col = dist.column
            self._values = np.fromiter(
                (getattr(r, col) for r in read_trace(dist.path, dist.format)), dtype=np.int64
            )

    def sample(self, k: int) -> np.ndarray:
        d, rng = self.dist, self.rng
        if isinstance(d, FixedDist):
            x = np.full(k, float(d.value))
        elif isinstance(d, UniformDist):
            if self.integer:
                x = rng.integers(int(d.low), int(d.high) + 1, size=k).astype(float)
            else:
                x = rng.uniform(d.low, d.high, size=k)
        elif isinstance(d, LognormalDist):
            with np.errstate(over="ignore"):  # inf, clipped below
                x = np.exp(rng.normal(math.log(d.median), d.sigma, size=k))
            x = np.clip(x, d.min, d.max if d.max is not None else np.inf)
        elif isinstance(d, ExponentialDist):
            x = rng.exponential(d.mean, size=k)
        elif isinstance(d, EmpiricalDist):
            x = rng.choice(self._values, size=k).astype(float)
        else:  # pragma: no cover
            raise TypeError(d)
        if self.integer:
            return np.clip(np.rint(x), self.minimum, MAX_TOKENS).astype(np.int64)
        return np.minimum(x, MAX_ARRIVAL_S)


# --------------------------------------------------------------------------------------------
# Rate profiles


def _profile_segments(p: RateProfile, mean_rate: float) -> Iterator[tuple[float, float, float]]:
    """(start_s, end_s, rate) segments, forever (the last piecewise rate holds)."""
    if p.kind == "piecewise":
        pts = list(p.points)
        for (t0, r), (t1, _) in itertools.pairwise(pts):
            yield t0, t1, r
        yield pts[-1][0], math.inf, pts[-1][1]
        return
    if math.isinf(mean_rate):
        raise ValueError("a diurnal rate profile needs a finite request_rate (its mean)")
    t = 0.0
    while True:
        mid = t + p.resolution_s / 2
        r = mean_rate * (1 + p.amplitude * math.sin(2 * math.pi * mid / p.period_s + p.phase))
        yield t, t + p.resolution_s, r
        t += p.resolution_s


def profile_arrivals(n: int, p: RateProfile, mean_rate: float, burstiness: float,
                     seed: int) -> Iterator[np.ndarray]:
    """Arrival times of a Gamma renewal process with time-varying rate, by time rescaling:
    unit-rate event times u_i mapped through the inverse of Λ(t) = ∫₀ᵗ rate(s) ds."""
    rs = np.random.RandomState(seed)
    segs = _profile_segments(p, mean_rate)
    t0, t1, r = next(segs)
    lam0 = 0.0  # Λ at t0
    for u in gamma_renewal_unit(n, burstiness, rs):
        out = np.empty_like(u)
        i = 0
        while i < len(u):
            lam1 = lam0 + r * (t1 - t0) if r > 0 else lam0
            if r > 0:
                j = i + int(np.searchsorted(u[i:], lam1, side="left"))
                out[i:j] = t0 + (u[i:j] - lam0) / r
                i = j
            if i < len(u):
                lam0 = lam1
                t0, t1, r = next(segs)
        yield out


# --------------------------------------------------------------------------------------------
# kind: synthetic


def synthetic_requests(cfg: SyntheticWorkload, block_size: int) -> Iterator[RequestSpec]:
    """Requests with sampled lengths, optional shared-prefix groups (Zipf popularity) and
    Gamma arrivals (vLLM's, or time-varying through ``rate_profile``)."""
    n = cfg.num_prompts
    ss = np.random.SeedSequence(cfg.seed).spawn(3)
    ins = LengthSampler(cfg.input, np.random.default_rng(ss[0]))
    outs = LengthSampler(cfg.output, np.random.default_rng(ss[1]))
    grp_rng = np.random.default_rng(ss[2])
    g = cfg.prefix_groups
    if g is not None:
        glen = [g.lengths[k % len(g.lengths)] for k in range(g.num_groups)]
        w = 1.0 / np.arange(1, g.num_groups + 1) ** g.zipf_s
        w /= w.sum()
        gids = [
            tuple(SYNTHETIC_GROUP_BASE + (k << 24) + j for j in range(glen[k] // block_size))
            or None
            for k in range(g.num_groups)
        ]
    if cfg.rate_profile is None:
        arr = vllm_arrival_times(n, cfg.request_rate, cfg.burstiness, cfg.seed)
    else:
        arr = profile_arrivals(n, cfg.rate_profile, cfg.request_rate, cfg.burstiness, cfg.seed)
    i = 0
    for a in arr:
        k = len(a)
        il, ol = ins.sample(k).tolist(), outs.sample(k).tolist()
        if g is not None:
            use = (grp_rng.random(k) < g.fraction).tolist()
            grp = grp_rng.choice(g.num_groups, size=k, p=w).tolist()
        for m, t in enumerate(a.tolist()):
            p, ids = il[m], None
            if g is not None and use[m]:
                p += glen[grp[m]]
                ids = gids[grp[m]]
            yield RequestSpec(arrival_s=t, prompt_len=p, output_len=ol[m], request_id=str(i),
                              prefix_block_ids=ids)
            i += 1


# --------------------------------------------------------------------------------------------
# kind: sessions


def session_requests(cfg: SessionsWorkload, block_size: int,
                     max_model_len: int | None = None) -> Iterator[RequestSpec]:
    """Multi-turn sessions, all turns of a session yielded together at its start time.

    Turn 0: prompt = system_prompt_len + first_input. Turn k+1: prompt = prompt_k + output_k +
    user_input, sent ``think_time_s`` after turn k finishes (``parent_id``; the engine waits).
    ``prefix_block_ids`` of turn k cover the full blocks of prompt_k + output_k; turn k+1
    repeats them and adds fresh ids, so the engine finds turn k's prompt *and* output cached.
    A session ends early when a turn would exceed ``max_context_len`` (default max_model_len).
    """
    ss = np.random.SeedSequence(cfg.seed).spawn(5)
    turns = LengthSampler(cfg.turns, np.random.default_rng(ss[0]))
    first = LengthSampler(cfg.first_input, np.random.default_rng(ss[1]))
    user = LengthSampler(cfg.user_input, np.random.default_rng(ss[2]))
    outs = LengthSampler(cfg.output, np.random.default_rng(ss[3]))
    think = LengthSampler(cfg.think_time_s, np.random.default_rng(ss[4]), integer=False)
    limit = cfg.max_context_len or max_model_len
    sys_ids = [SESSION_SYSTEM_BASE + j for j in range(cfg.system_prompt_len // block_size)]
    next_id = SESSION_BASE
    s = 0
    for a in vllm_arrival_times(cfg.num_sessions, cfg.session_rate, cfg.burstiness, cfg.seed):
        for t in a.tolist():
            sid = f"s{s}"
            nt = int(turns.sample(1)[0])
            ids = list(sys_ids)
            prompt, parent = cfg.system_prompt_len + int(first.sample(1)[0]), None
            for k in range(nt):
                if k:
                    prompt += int(user.sample(1)[0])
                out = int(outs.sample(1)[0])
                if limit is not None and prompt + out > limit and k:
                    break
                full = (prompt + out) // block_size
                while len(ids) < full:
                    ids.append(next_id)
                    next_id += 1
                rid = f"{sid}-t{k}"
                yield RequestSpec(
                    arrival_s=t, prompt_len=prompt, output_len=out, request_id=rid,
                    prefix_block_ids=tuple(ids) or None, session_id=sid, turn=k,
                    parent_id=parent, think_time_s=float(think.sample(1)[0]) if k else 0.0,
                )
                parent = rid
                prompt += out
            s += 1
