"""The statistics of a ``vllm bench serve`` result: vLLM's mean / median / std (population) /
``np.percentile`` (linear) in ms, from exact samples, pooled ITL (value, count) pairs or a
DDSketch ``Distribution``, and the per-second peaks ``max_output_tokens_per_s`` and
``max_concurrent_requests`` (definitions: ``bench_result``'s module docstring)."""

from __future__ import annotations

import math

import numpy as np
from servesim.reports.bench_requests import COMPLETED_REASONS
from servesim.simulator.metrics import CHUNKS_COLUMN, Distribution, RunResult

MILLISECONDS_PER_SECOND = 1000.0
# Above this many pooled ITL samples, statistics are computed from (value, count) pairs
# instead of an np.repeat expansion (same definitions; avoids GBs of memory).
_ITL_EXPAND_LIMIT = 20_000_000


def percentile_word(p: float) -> str:
    """``99.0 → "99"``, ``99.9 → "99.9"`` (vLLM's ``p{P}_..._ms`` key spelling)."""
    return str(int(p)) if int(p) == p else str(p)


def _stats(values: np.ndarray, percentiles: list[float],
           scratch: bool = False) -> dict[str, float]:
    """mean/median/std/percentiles in ms of ``values`` (s), with vLLM's ``x or 0`` for empty.
    ``scratch``: ``values`` is a temporary the order statistics may partition in place (the
    same values: mean and std, whose sums depend on the order, are taken first)."""
    x = np.asarray(values, dtype=float) if len(values) else np.zeros(1)
    mean = float(np.mean(x)) * MILLISECONDS_PER_SECOND
    std = float(np.std(x)) * MILLISECONDS_PER_SECOND
    out = {
        "mean": mean,
        "median": float(np.median(x, overwrite_input=scratch)) * MILLISECONDS_PER_SECOND,
        "std": std,
    }
    for p in percentiles:
        out[f"p{percentile_word(p)}"] = float(
            np.percentile(x, p, overwrite_input=scratch)) * MILLISECONDS_PER_SECOND
    return out


def _weighted_percentile(values: np.ndarray, counts: np.ndarray, p: float) -> float:
    """``np.percentile(np.repeat(values, counts), p)`` (linear) without the expansion."""
    order = np.argsort(values, kind="stable")
    v, c = values[order], counts[order]
    cum = np.cumsum(c)
    n = int(cum[-1])
    rank = p / 100.0 * (n - 1)
    lo, hi = math.floor(rank), math.ceil(rank)
    x_lo = v[np.searchsorted(cum, lo, side="right")]
    x_hi = v[np.searchsorted(cum, hi, side="right")]
    return float(x_lo + (x_hi - x_lo) * (rank - lo))


def _itl_stats(values: np.ndarray, counts: np.ndarray, percentiles: list[float]) -> dict:
    values = np.asarray(values, dtype=float)
    counts = np.asarray(counts, dtype=np.int64)
    keep = counts > 0
    values, counts = values[keep], counts[keep]
    total = int(counts.sum()) if len(counts) else 0
    if total <= _ITL_EXPAND_LIMIT:
        return _stats(np.repeat(values, counts), percentiles, scratch=True)
    w = counts / total
    mean = float(np.sum(values * w))
    out = {
        "mean": mean * MILLISECONDS_PER_SECOND,
        "median": _weighted_percentile(values, counts, 50.0) * MILLISECONDS_PER_SECOND,
        "std": math.sqrt(float(np.sum(w * (values - mean) ** 2))) * MILLISECONDS_PER_SECOND,
    }
    for p in percentiles:
        key = f"p{percentile_word(p)}"
        out[key] = _weighted_percentile(values, counts, p) * MILLISECONDS_PER_SECOND
    return out


def _sketch_stats(dist: Distribution, percentiles: list[float]) -> dict[str, float]:
    """mean/median/std/percentiles in ms from a sketched Distribution (0 when empty)."""
    out = {"mean": dist.mean * MILLISECONDS_PER_SECOND,
           "median": dist.quantile(0.5) * MILLISECONDS_PER_SECOND,
           "std": dist.std() * MILLISECONDS_PER_SECOND}
    for p in percentiles:
        out[f"p{percentile_word(p)}"] = dist.quantile(p / 100.0) * MILLISECONDS_PER_SECOND
    return out


def _max_concurrent(start: np.ndarray, end: np.ndarray, t0: float,
                    presorted: bool = False) -> int:
    """vLLM 0.22.1's ``max_concurrent_requests``: requests are bucketed by whole seconds since
    ``t0`` (the first send), each counted in every bucket from ``int(start − t0)`` to
    ``int(end − t0)`` inclusive (active at any moment of that second); the peak bucket. The
    count only rises at a start bucket b, where it is #(start buckets ≤ b) − #(end buckets
    < b). Two sorts, no per-second array: 16 bytes per request."""
    if len(start) == 0:
        return 0
    s, e = (start, end) if presorted else (np.sort(start), np.sort(end))
    # bucket numbers, in place (``presorted`` arrays are the caller's to consume): sorted,
    # as a monotone map of sorted times
    sb = np.floor(np.subtract(s, t0, out=s), out=s)
    eb = np.floor(np.subtract(e, t0, out=e), out=e)
    best = 0
    for lo in range(0, len(sb), 1 << 20):
        blk = np.unique(sb[lo:lo + (1 << 20)])
        started = np.searchsorted(sb, blk, side="right")
        ended = np.searchsorted(eb, blk, side="left")
        best = max(best, int(np.max(started - ended)))
    return best


def _max_output_tokens_per_s(result: RunResult, first: np.ndarray | None, t0: float) -> float:
    """Peak 1-s bucket of generated tokens (see ``bench_result``'s module docstring for the
    approximation).

    ``first``: first-token times of the completed requests; None for a streamed run (then
    read window by window, keeping only per-bucket counts)."""
    tok = result.token_steps  # every step's, when ``steps`` are sampled
    steps = {} if tok is not None else result.steps or {}
    times = np.asarray(steps.get("time_s", []), dtype=float)
    if CHUNKS_COLUMN in steps:  # several tokens a chunk: vLLM counts chunks
        tokens = np.asarray(steps[CHUNKS_COLUMN], dtype=float)
        first, firsts = np.zeros(0), iter(())
    elif "num_generated_tokens" in steps:
        tokens = np.asarray(steps["num_generated_tokens"], dtype=float)
        first, firsts = np.zeros(0), iter(())
    elif "vllm:generation_tokens_total" in steps:
        cum = np.asarray(steps["vllm:generation_tokens_total"], dtype=float)
        tokens = np.diff(cum, prepend=0.0)
        first, firsts = np.zeros(0), iter(())
    else:
        tokens = np.asarray(steps.get("num_decode_reqs", np.zeros(len(times))), dtype=float)
        if first is not None:
            firsts = iter([first])
        else:
            firsts = (np.asarray(w["first_token_s"], dtype=float)[
                np.isin(np.asarray(w["finished_reason"]).astype(str), COMPLETED_REASONS)]
                for w in result.iter_requests())
    # tokens per occupied 1-s bucket (bucket numbers ``ids``, sorted): memory follows the
    # steps, not the run's span in seconds
    ids, counts = np.zeros(0, np.int64), np.zeros(0)

    def add(t: np.ndarray, k: np.ndarray) -> None:
        nonlocal ids, counts
        ok = np.isfinite(t) & np.isfinite(k) & (t >= t0)
        if ok.any():
            b = np.floor(t[ok] - t0).astype(np.int64)
            ids, at = np.unique(np.concatenate([ids, b]), return_inverse=True)
            counts = np.bincount(at, weights=np.concatenate([counts, k[ok]]))

    if tok is not None:
        for t, k in tok:
            add(t, np.asarray(k, dtype=float))
    elif first is not None:  # in memory: one bincount over steps + first tokens, as always
        first = first[np.isfinite(first)]
        add(np.concatenate([times, first]), np.concatenate([tokens, np.ones(len(first))]))
    else:
        add(times, tokens)
        for f in firsts:
            add(f, np.ones(len(f)))
    return float(np.max(counts)) if len(counts) else 0.0
