"""Arrival times exactly as ``vllm bench serve``'s ``get_request`` computes its send delays.

vLLM (``vllm/benchmarks/serve.py``) seeds the *global* legacy RNG (``np.random.seed(seed)``)
and, per request i, draws ``np.random.gamma(shape=burstiness, scale=1/(rate_i·burstiness))``
(rate_i = the ramp-up rate when a ramp-up is set, else ``request_rate``); a rate of inf gives a
delay of 0 and a burstiness of inf the constant ``1/rate_i`` (no draw in either case). Delays are
summed cumulatively; without a ramp-up, the cumulative delays are rescaled so the last one is
exactly ``N/request_rate``. The first request therefore goes out at ``delay[0] > 0``, not at 0.

We use a local ``np.random.RandomState(seed)``: same numbers, no global state. ``gamma(b, θ)``
is ``θ·standard_gamma(b)`` in the legacy generator, so drawing ``standard_gamma`` in chunks and
multiplying gives bit-identical delays; the sum is computed in two passes over the same stream
so N requests need O(chunk) memory, not O(N).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

CHUNK = 65536


def ramp_up_rate(
    strategy: str | None, start_rps: float | None, end_rps: float | None,
    index: np.ndarray, total: int, request_rate: float,
) -> np.ndarray:
    """vLLM ``_get_current_request_rate`` for an array of request indices (requests/s)."""
    if strategy and start_rps is not None and end_rps is not None:
        progress = index / max(total - 1, 1)
        if strategy == "linear":
            return start_rps + (end_rps - start_rps) * progress
        if strategy == "exponential":
            return start_rps * (end_rps / start_rps) ** progress
        raise ValueError(f"unknown ramp-up strategy {strategy!r}")
    return np.full(len(index), float(request_rate))


def _delay_chunks(
    n: int, request_rate: float, burstiness: float, seed: int,
    ramp_up_strategy: str | None, ramp_up_start_rps: float | None,
    ramp_up_end_rps: float | None,
) -> Iterator[np.ndarray]:
    """Per-request (non-cumulative) delays in seconds, in chunks."""
    rs = np.random.RandomState(seed)
    for lo in range(0, n, CHUNK):
        idx = np.arange(lo, min(n, lo + CHUNK))
        rates = ramp_up_rate(
            ramp_up_strategy, ramp_up_start_rps, ramp_up_end_rps, idx, n, request_rate
        )
        if math.isinf(request_rate) and not ramp_up_strategy:
            yield np.zeros(len(idx))
        elif math.isinf(burstiness):
            yield 1.0 / rates
        else:
            theta = 1.0 / (rates * burstiness)
            yield rs.standard_gamma(burstiness, size=len(idx)) * theta


def vllm_arrival_times(
    n: int, request_rate: float = math.inf, burstiness: float = 1.0, seed: int = 0,
    ramp_up_strategy: str | None = None, ramp_up_start_rps: float | None = None,
    ramp_up_end_rps: float | None = None,
) -> Iterator[np.ndarray]:
    """Cumulative send times (s from benchmark start) of ``n`` requests, in chunks.

    Identical to vLLM's ``delay_ts`` (see module doc)."""
    if n <= 0:
        return
    args = (n, request_rate, burstiness, seed, ramp_up_strategy, ramp_up_start_rps,
            ramp_up_end_rps)
    factor = 1.0
    if ramp_up_strategy is None:
        from servesim.simulator.progress import phase

        last = 0.0
        with phase("arrival times (normalising pass)", n) as tick:
            for k, d in enumerate(_delay_chunks(*args)):
                d[0] += last
                last = float(np.cumsum(d)[-1])
                tick(min(n, (k + 1) * CHUNK))
        if last != 0:
            factor = (n / request_rate) / last
    last = 0.0
    for d in _delay_chunks(*args):
        d[0] += last
        c = np.cumsum(d)
        last = float(c[-1])
        yield c * factor if factor != 1.0 else c


def gamma_renewal_unit(n: int, burstiness: float, rs: np.random.RandomState) -> Iterator[np.ndarray]:
    """Cumulative event times of a unit-rate Gamma renewal process (shape ``burstiness``)."""
    last = 0.0
    for lo in range(0, n, CHUNK):
        k = min(n, lo + CHUNK) - lo
        if math.isinf(burstiness):
            d = np.ones(k)
        else:
            d = rs.standard_gamma(burstiness, size=k) / burstiness
        d[0] += last
        c = np.cumsum(d)
        last = float(c[-1])
        yield c
