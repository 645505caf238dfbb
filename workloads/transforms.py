"""Streaming transforms over iterators of :class:`RequestSpec` (all O(1) memory unless noted).

Counters (dropped, clamped, ...) go into a ``stats`` dict the caller passes, which
:func:`servesim.workloads.build_workload` exposes as ``Workload.meta``: nothing is dropped
silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np
from servesim.workloads.schema import RequestSpec


def shift_to_zero(reqs: Iterable[RequestSpec]) -> Iterator[RequestSpec]:
    """Subtract the first request's arrival_s from every request (first arrives at 0)."""
    t0 = None
    for r in reqs:
        if t0 is None:
            t0 = r.arrival_s
        r.arrival_s -= t0
        yield r


def time_window(reqs: Iterable[RequestSpec], start_s: float | None,
                end_s: float | None) -> Iterator[RequestSpec]:
    """Keep requests with start_s <= arrival_s < end_s (s; either bound may be None)."""
    for r in reqs:
        if start_s is not None and r.arrival_s < start_s:
            continue
        if end_s is not None and r.arrival_s >= end_s:
            return
        yield r


def take(reqs: Iterable[RequestSpec], n: int | None) -> Iterator[RequestSpec]:
    """The first ``n`` requests (all when n is None)."""
    if n is None:
        yield from reqs
        return
    if n <= 0:
        return
    for i, r in enumerate(reqs):
        yield r
        if i + 1 >= n:
            return


def sample_indices(total: int, n: int, seed: int) -> np.ndarray:
    """Sorted indices of ``min(n, total)`` requests chosen uniformly without replacement."""
    rng = np.random.default_rng(seed)
    if n >= total:
        return np.arange(total)
    return np.sort(rng.choice(total, size=n, replace=False))


def select(reqs: Iterable[RequestSpec], indices: np.ndarray) -> Iterator[RequestSpec]:
    """Keep the requests at the given sorted positions (O(len(indices)) memory)."""
    idx = iter(indices.tolist())
    want = next(idx, None)
    for i, r in enumerate(reqs):
        if want is None:
            return
        if i == want:
            yield r
            want = next(idx, None)


def scale_time(reqs: Iterable[RequestSpec], factor: float) -> Iterator[RequestSpec]:
    """Multiply arrival_s by ``factor`` (2.0 = twice as long, half the rate)."""
    for r in reqs:
        if factor != 1.0:
            r.arrival_s *= factor
        yield r


def mean_rate(count: int, first_s: float, last_s: float) -> float:
    """Mean request rate (requests/s) = 1 / mean inter-arrival gap = (N−1)/(last − first);
    inf when all requests arrive at once."""
    span = last_s - first_s
    if count < 2 or span <= 0:
        return float("inf")
    return (count - 1) / span


def limit_length(reqs: Iterable[RequestSpec], max_model_len: int | None, mode: str,
                 block_size: int, stats: dict) -> Iterator[RequestSpec]:
    """Apply ``long_requests`` to requests with prompt_len + output_len > max_model_len.

    ``keep``: pass through (the engine rejects them, like vLLM's 400 "maximum context length")
    but count them in ``stats["too_long"]``. ``clamp``: shorten the output to fit, and the prompt
    to max_model_len − 1 when it alone does not fit (prefix ids trimmed to the new full blocks),
    counted in ``stats["clamped"]``. ``reject``: drop, counted in ``stats["rejected"]``."""
    stats.setdefault("too_long", 0)
    stats.setdefault("clamped", 0)
    stats.setdefault("rejected", 0)
    for r in reqs:
        if max_model_len is None or r.prompt_len + r.output_len <= max_model_len:
            yield r
            continue
        stats["too_long"] += 1
        if mode == "reject":
            stats["rejected"] += 1
            continue
        if mode == "clamp":
            stats["clamped"] += 1
            p = min(r.prompt_len, max_model_len - 1)
            o = max(1, min(r.output_len, max_model_len - p))
            ids = r.prefix_block_ids
            if ids is not None:
                ids = ids[: (p + o) // block_size] or None
            r = dataclasses.replace(r, prompt_len=p, output_len=o, prefix_block_ids=ids)
        yield r
