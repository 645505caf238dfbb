"""Staged load: a run as a sequence of load stages, the way benchmark clients send it.

``workload.stages: [{rate, duration_s} | {concurrency, duration_s | num_requests}, ...]``
(any kind but ``sessions``) replaces the kind's arrival process; the kind still supplies the
requests (lengths, shared prefixes), consumed in order across the stages (cycled when a trace
runs out). Stage k of the plan:

- **open loop** (``rate``): ``num_requests`` requests, or ``int(rate · duration_s)`` (what
  inference-perf sends), at offsets from the stage start drawn by ``arrivals``: ``poisson``
  (exponential gaps, first after one gap), ``constant`` (``i / rate``, first at 0, GuideLLM's
  constant), ``gamma`` (vLLM's Gamma gaps of shape ``burstiness``), ``inference-perf``
  (exponential gaps rescaled so the last request is sent exactly at ``duration_s``,
  inference-perf's ``ConstantLoadTimer``); ``rate: inf`` sends them all at once. With
  ``concurrency`` as well, requests beyond that many in flight wait in the client.
- **closed loop** (``concurrency`` only): ``concurrency`` requests in flight, the next sent
  as soon as one ends, until ``num_requests`` were sent or ``duration_s`` has passed.

A stage with ``barrier: true`` (default) starts when every request sent before it has ended,
plus ``gap_s``: inference-perf, GuideLLM and AIPerf all drain a stage before starting the next.
``grace_s`` cancels requests still in flight that long after ``duration_s`` (GuideLLM's
``max_duration`` cancels at once: 0; AIPerf's ``grace_period``); they count as failed with
``finished_reason`` ``cancelled``. ``warmup: true`` makes a whole stage warm-up.

Every :class:`RequestSpec` gets ``extra["stage"] = k``; its ``arrival_s`` is the stage's
*nominal* start (stages back to back, plus gaps) plus its offset. The engine's client
(``simulator/client.py``, ``Client``) re-bases each barrier stage to when it really starts and
gates closed-loop stages; requests it marks as warm-up get ``extra["warmup"] = True`` (top-level
``warmup: {num_requests | duration_s}``: the leading requests of every stage, or of the run).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

import numpy as np
from servesim.workloads.schema import MAX_ARRIVAL_S, RequestSpec


def stage_plan(stages, *, restart_data: bool = False) -> list[dict]:
    """Config ``Stage`` models (or dicts of their fields) → the plan the client follows: one
    dict per stage with ``index``, ``rate``, ``concurrency``, ``num_requests`` (None: until
    ``duration_s``), ``duration_s``, ``start_s`` (nominal), ``barrier``, ``gap_s``,
    ``grace_s``, ``warmup``, ``arrivals``, ``burstiness``, ``closed`` and ``label``."""
    plan = []
    t = 0.0
    for k, st in enumerate(stages):
        d = st if isinstance(st, dict) else st.model_dump()
        rate, conc = d.get("rate"), d.get("concurrency")
        n, dur = d.get("num_requests"), d.get("duration_s")
        closed = rate is None
        if not closed and n is None:
            n = int(rate * dur)  # inference-perf: int(rate * duration) requests
        t += d.get("gap_s", 0.0) or 0.0
        plan.append({
            "index": k, "rate": rate, "concurrency": conc, "num_requests": n,
            "duration_s": dur, "start_s": t, "barrier": d.get("barrier", True),
            "gap_s": d.get("gap_s", 0.0) or 0.0, "grace_s": d.get("grace_s"),
            "warmup": bool(d.get("warmup", False)), "arrivals": d.get("arrivals", "poisson"),
            "burstiness": d.get("burstiness", 1.0), "closed": closed,
            "label": d.get("label") or _label(rate, conc), "restart_data": restart_data,
        })
        if dur is not None:
            t += dur
        elif not closed and not math.isinf(rate):
            t += n / rate
    return plan


def _length(st: dict) -> float | None:
    """A planned stage's nominal sending time, s (None: a closed loop by count, unknown)."""
    if st["duration_s"] is not None:
        return st["duration_s"]
    if st["closed"]:
        return None
    return 0.0 if math.isinf(st["rate"]) else st["num_requests"] / st["rate"]


def check_plan(plan: list[dict], warmup: dict | None = None) -> None:
    """Refuse (one-line ValueError) a plan whose nominal span (gaps, durations, num_requests /
    rate) passes MAX_ARRIVAL_S, or where nothing would be measured: every stage is warm-up,
    or the top-level ``warmup`` covers every measured stage whole."""
    span = max((st["start_s"] + (_length(st) or 0.0) for st in plan), default=0.0)
    if span > MAX_ARRIVAL_S:
        raise ValueError(f"the stages span {span:.9g} s (gaps, durations, num_requests / rate), "
                         f"longer than the longest run ({MAX_ARRIVAL_S:g} s)")
    measured = [st for st in plan if not st["warmup"]]
    if plan and not measured:
        raise ValueError("every stage is warm-up (warmup: true): nothing would be measured")
    n, d = (warmup or {}).get("num_requests"), (warmup or {}).get("duration_s")

    def covered(st):
        if n is not None:
            return st["num_requests"] is not None and n >= st["num_requests"]
        length = _length(st)
        return d is not None and length is not None and d > length

    if measured and all(covered(st) for st in measured):
        what = f"num_requests: {n}" if n is not None else f"duration_s: {d:g}"
        raise ValueError(f"warmup {{{what}}} covers every measured stage whole (warm-up applies "
                         "to the leading requests of each stage): nothing would be measured")


def _label(rate, conc) -> str:
    if rate is None:
        return f"concurrency={conc}"
    r = "inf" if math.isinf(rate) else f"{rate:g}"
    return f"rate={r}" + (f",concurrency={conc}" if conc else "")


def stage_offsets(st: dict, rng: np.random.Generator) -> np.ndarray:
    """Send offsets (s from the stage start) of an open-loop stage's requests."""
    n, rate = st["num_requests"], st["rate"]
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate):
        return np.zeros(n)
    kind = st["arrivals"]
    if kind == "constant":
        return np.arange(n) / rate
    if kind == "gamma":
        b = st["burstiness"]
        gaps = (np.full(n, 1.0 / rate) if math.isinf(b) else
                rng.standard_gamma(b, size=n) / (rate * b))
        return np.cumsum(gaps)
    gaps = rng.exponential(1.0 / rate, size=n)
    if kind == "inference-perf" and st["duration_s"]:
        gaps *= st["duration_s"] / gaps.sum()
    return np.cumsum(gaps)


class StageControl:
    """Shared between the stream and the client: the client sets ``skip`` to a stage index to
    end that stage's (possibly endless, closed-loop) stream at the next request."""

    __slots__ = ("skip",)

    def __init__(self):
        self.skip = -1


def staged_requests(plan: list[dict], seed: int, source: Callable[[int], Iterator[RequestSpec]],
                    ctl: StageControl) -> Iterator[RequestSpec]:
    """The requests of a staged run, stage after stage (see module doc).

    ``source(k)`` gives the requests whose lengths / prefixes the stages use, from the start
    (``k`` counts restarts: a finite source is restarted when it runs out, and at every stage
    when ``restart_data``, as inference-perf's data generator is)."""
    restarts = itertools.count()
    src = source(next(restarts))
    n_total = 0

    def pull():
        nonlocal src
        for _ in range(2):
            r = next(src, None)
            if r is not None:
                return r
            src = source(next(restarts))
        raise ValueError("the workload's request source is empty")

    for st in plan:
        k = st["index"]
        if st.get("restart_data") and k > 0:
            src = source(next(restarts))
        rng = np.random.default_rng(np.random.SeedSequence([seed, 7919, k]))
        if st["closed"]:
            offsets = itertools.repeat(0.0, st["num_requests"]) \
                if st["num_requests"] is not None else itertools.repeat(0.0)
        else:
            offsets = iter(stage_offsets(st, rng).tolist())
        t0 = st["start_s"]
        for off in offsets:
            if ctl.skip == k:
                break
            r = pull()
            r.arrival_s = t0 + off
            r.request_id = str(n_total)
            r.extra["stage"] = k
            n_total += 1
            yield r
            if ctl.skip == k:
                break
