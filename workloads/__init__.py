"""Workloads: the canonical request schema, trace importers, synthetic generators, transforms.

Entry point for the simulator::

    wl = build_workload(cfg.workload, block_size=16, max_model_len=8192)
    wl.meta          # num_prompts, request_rate, burstiness, max_concurrency, dataset_name, ...
    for req in wl:   # RequestSpec in non-decreasing arrival_s (s from benchmark start)
        ...

Iteration is lazy (generators) and repeatable: each ``iter(wl)`` restarts from the file or the
seed and gives the same requests. Counters in ``meta`` (``too_long``, ``clamped``,
``rejected``, ``skipped_bad_rows``, ``dropped_failed``, ``num_requests``) are final once an
iteration has finished; a ``num_prompts`` unknown up front (traces, sessions) is filled in then.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from servesim.workloads.config import (
    ProfileWorkload,
    RandomWorkload,
    SessionsWorkload,
    SyntheticWorkload,
    TraceWorkload,
    WorkloadConfig,
)
from servesim.workloads.schema import RequestSpec

__all__ = ["RequestSpec", "Workload", "WorkloadConfig", "build_workload"]


class Workload:
    """Re-iterable stream of :class:`RequestSpec` plus ``meta`` (vLLM bench traffic fields)."""

    def __init__(self, factory: Callable[[dict], Iterator[RequestSpec]], meta: dict):
        self._factory = factory
        self.meta = meta

    def __iter__(self) -> Iterator[RequestSpec]:
        for k in ("too_long", "clamped", "rejected"):
            self.meta[k] = 0
        n = 0
        for r in self._factory(self.meta):
            n += 1
            yield r
        self.meta["num_requests"] = n
        if self.meta.get("num_prompts") is None:
            self.meta["num_prompts"] = n


def _limited(gen_factory, cfg, block_size, max_model_len):
    from servesim.workloads.transforms import limit_length

    def factory(meta: dict) -> Iterator[RequestSpec]:
        return limit_length(gen_factory(meta), max_model_len, cfg.long_requests, block_size,
                            meta)

    return factory


def build_workload(cfg: WorkloadConfig, *, block_size: int,
                   max_model_len: int | None = None) -> Workload:
    """Build the request stream for a ``workload`` config section.

    ``block_size`` (tokens) is the engine's KV block size: ``prefix_block_ids`` are computed at
    it. ``max_model_len`` only matters for ``long_requests: clamp|reject`` (and ends sessions
    early); by default long requests are kept and the engine rejects them, as vLLM does."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    meta: dict = {
        "num_prompts": None,
        "request_rate": math.inf,
        "burstiness": getattr(cfg, "burstiness", 1.0),
        "max_concurrency": cfg.max_concurrency,
        "dataset_name": cfg.kind,
        "long_requests": cfg.long_requests,
        "max_model_len": max_model_len,
    }
    if isinstance(cfg, RandomWorkload):
        from servesim.workloads.generators import random_requests

        meta.update(num_prompts=cfg.num_prompts, request_rate=cfg.request_rate,
                    random_input_len=cfg.input_len, random_output_len=cfg.output_len,
                    random_range_ratio=(cfg.range_ratio if isinstance(cfg.range_ratio, float)
                                        else cfg.range_ratio.model_dump()),
                    random_prefix_len=cfg.prefix_len)
        if cfg.ramp_up_strategy is not None:
            meta.update(ramp_up_strategy=cfg.ramp_up_strategy,
                        ramp_up_start_rps=cfg.ramp_up_start_rps,
                        ramp_up_end_rps=cfg.ramp_up_end_rps)
        gen = lambda meta: random_requests(cfg, block_size)
    elif isinstance(cfg, SyntheticWorkload):
        from servesim.workloads.generators import synthetic_requests

        meta.update(num_prompts=cfg.num_prompts, request_rate=cfg.request_rate)
        if cfg.rate_profile is not None:
            meta["rate_profile"] = cfg.rate_profile.kind
        gen = lambda meta: synthetic_requests(cfg, block_size)
    elif isinstance(cfg, SessionsWorkload):
        from servesim.workloads.generators import session_requests

        meta.update(num_sessions=cfg.num_sessions, request_rate=cfg.session_rate)
        gen = lambda meta: session_requests(cfg, block_size, max_model_len)
    elif isinstance(cfg, TraceWorkload):
        from servesim.workloads.importers import trace_workload

        gen = trace_workload(cfg, block_size, meta)
    elif isinstance(cfg, ProfileWorkload):
        from servesim.workloads.profiles import profile_workload

        return profile_workload(cfg, block_size=block_size, max_model_len=max_model_len,
                                meta=meta, limit=lambda g: _limited(g, cfg, block_size,
                                                                     max_model_len))
    else:  # pragma: no cover
        raise TypeError(f"unknown workload config {type(cfg).__name__}")
    if cfg.stages:
        gen = _staged(cfg, gen, block_size, meta)
    if cfg.warmup is not None:
        meta["warmup"] = cfg.warmup.model_dump(exclude_none=True)
    return Workload(_limited(gen, cfg, block_size, max_model_len), meta)


def _staged(cfg, gen, block_size: int, meta: dict):
    """Wrap a kind's request stream in ``cfg.stages`` (``workloads/stages.py``)."""
    from servesim.workloads.stages import StageControl, stage_plan, staged_requests

    if isinstance(cfg, SessionsWorkload):
        from servesim.simulator.errors import ConfigError

        raise ConfigError("workload.stages: not supported with kind: sessions (its turns are "
                          "sent after their parents finish, not by a load stage)")
    plan = stage_plan(cfg.stages)
    set_stage_meta(meta, plan)
    counts = [st["num_requests"] for st in plan]
    bounded = all(c is not None for c in counts)
    block = sum(counts) if bounded else getattr(cfg, "num_prompts", 1000)

    def source_for(k: int, meta: dict):
        if isinstance(cfg, (RandomWorkload, SyntheticWorkload)):
            from servesim.workloads import generators

            c = cfg.model_copy(update={"num_prompts": max(block, 1),
                                       "seed": (cfg.seed + k) % 2**32,
                                       "request_rate": math.inf})
            if isinstance(cfg, RandomWorkload):
                c = c.model_copy(update={"ramp_up_strategy": None})
                return generators.random_requests(c, block_size)
            c = c.model_copy(update={"rate_profile": None})
            return generators.synthetic_requests(c, block_size)
        return gen(meta)  # a trace: its rows in order

    def factory(meta: dict) -> Iterator[RequestSpec]:
        ctl = StageControl()
        meta["_stage_control"] = ctl
        return staged_requests(plan, cfg.seed, lambda k: source_for(k, meta), ctl)

    return factory


def set_stage_meta(meta: dict, plan: list[dict]) -> None:
    """``meta`` fields of a staged workload: the plan, and the bench traffic fields (the one
    measured stage's rate and concurrency, else inf / None; num_prompts when every stage has
    a request count)."""
    meta["stages"] = plan
    measured = [st for st in plan if not st["warmup"]] or plan
    counts = [st["num_requests"] for st in plan]
    meta["num_prompts"] = sum(counts) if all(c is not None for c in counts) else None
    one = measured[0] if len(measured) == 1 else None
    rate = one["rate"] if one is not None else None
    meta["request_rate"] = rate if rate is not None else math.inf
    meta["max_concurrency"] = one["concurrency"] if one is not None else None
    meta["burstiness"] = one["burstiness"] if one is not None else 1.0
