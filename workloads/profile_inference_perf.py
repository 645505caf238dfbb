"""inference-perf load profiles (kubernetes-sigs/inference-perf ``config.yml``): load stages
(constant, poisson, concurrent) and ``shared_prefix`` / ``random`` / ``synthetic`` data, with
inference-perf's own length draws."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
from servesim.workloads.profile_common import (
    MAX_TABLE,
    ProfileSpec,
    _get,
    _group_ids,
    _num,
    _pos,
    _requests,
    _stage,
    _tokens,
)
from servesim.workloads.schema import MAX_ARRIVAL_S, RequestSpec

_IP_QUIET = {"api", "server", "tokenizer", "storage", "report", "metrics", "circuit_breakers",
             "type"}


def _ip_lengths(dist: Any, count: int, rng: np.random.Generator, *, legacy: bool) -> np.ndarray:
    """inference-perf's length sampling: ``sample_from_distribution`` (shared_prefix) or
    ``generate_distribution`` (random/synthetic, ``legacy``) — same numpy calls, same draws
    for the same seed. ``dist`` is an int (fixed) or a Distribution mapping."""
    if not isinstance(dist, dict):
        return np.full(count, int(dist))
    lo, hi = int(dist.get("min", 10)), int(dist.get("max", 1024))
    mean = float(dist.get("mean", 512))
    std = float(dist.get("std_dev", 200) if dist.get("variance") is None
                else math.sqrt(float(dist["variance"])))
    kind = str(dist.get("type", "normal"))
    if kind == "fixed":
        return np.full(count, int(mean))
    if kind == "normal":
        x = rng.normal(loc=mean, scale=std, size=count)
    elif kind == "uniform":
        x = rng.uniform(low=lo, high=hi if legacy else hi + 1, size=count)
    elif kind == "lognormal":
        if legacy:
            shifted = mean - lo if mean - lo > 0 else 1.0
            s2 = math.log(1 + (std / shifted) ** 2)
            x = rng.lognormal(mean=math.log(shifted) - s2 / 2, sigma=math.sqrt(s2),
                              size=count) + lo
        elif std <= 0:
            x = np.full(count, mean)
        else:
            s2 = math.log(1 + (std / mean) ** 2)
            x = rng.lognormal(mean=math.log(mean) - s2 / 2, sigma=math.sqrt(s2), size=count)
    elif kind == "poisson":
        x = rng.poisson(lam=mean if mean > 0 else 1.0, size=count).astype(float)
    elif kind == "skew_normal":
        skew = float(dist.get("skew", 0.0))
        delta = skew / math.sqrt(1 + skew * skew)
        u0, v = rng.standard_normal(count), rng.standard_normal(count)
        u1 = delta * u0 + math.sqrt(1 - delta * delta) * v
        x = mean + std * np.where(u0 >= 0, u1, -u1)
    else:
        raise ValueError(f"distribution type {kind!r} is not supported")
    return np.clip(np.round(np.clip(x, lo, hi)).astype(np.int64), lo, hi)


def _check_dist(dist: Any, where: str) -> None:
    """A length: a token count, or a Distribution whose min / max / mean are token counts
    (the draws are clipped to [min, max]) and std_dev / variance / skew finite numbers."""
    if not isinstance(dist, dict):
        _tokens(dist, where)
        return
    for k in ("min", "max", "mean"):
        if dist.get(k) is not None:
            _tokens(dist[k], f"{where}.{k}")
    for k in ("std_dev", "variance"):
        if dist.get(k) is not None:
            _pos(dist[k], f"{where}.{k}", zero=True)
    if dist.get("skew") is not None and not math.isfinite(_num(dist["skew"], f"{where}.skew")):
        raise ValueError(f"{where}.skew: expected a finite number, got {dist['skew']!r}")
    if int(dist.get("min", 10)) > int(dist.get("max", 1024)):
        raise ValueError(f"{where}: min {dist.get('min', 10)} > max {dist.get('max', 1024)}")


def shared_prefix_table(sp: dict, block_size: int) -> list[tuple[int, int, tuple | None]]:
    """inference-perf ``SharedPrefixDataGenerator``: ``num_groups`` system prompts (one length
    each), ``num_prompts_per_group`` questions per group (lengths and output lengths drawn
    group by group), laid out group-major and then shuffled by a seeded permutation. Request
    ``i`` of a stage uses entry ``i mod (groups · prompts)``.

    The lengths are inference-perf's exactly (same numpy draws from ``default_rng(seed)``); the
    shuffle is a permutation of our own (``default_rng(seed)`` after the length draws):
    inference-perf draws its permutation after tokenizer-dependent token sampling, which
    cannot be replayed without the tokenizer."""
    groups = _pos(_get(sp, "num_groups", "num_unique_system_prompts", default=10),
                  "data.shared_prefix.num_groups", integer=True)
    per = _pos(_get(sp, "num_prompts_per_group", "num_users_per_system_prompt", default=10),
               "data.shared_prefix.num_prompts_per_group", integer=True)
    if groups * per > MAX_TABLE:
        raise ValueError(f"data.shared_prefix: num_groups × num_prompts_per_group = "
                         f"{groups * per:g} prompts, more than {MAX_TABLE:g}")
    seed = sp.get("seed")
    rng = np.random.default_rng(seed if seed is not None else 0)
    sys_d = sp.get("system_prompt_len", 100)
    q_d = sp.get("question_len", 50)
    o_d = sp.get("output_len", 50)
    if not isinstance(q_d, dict) and sp.get("question_distribution") is not None:
        q_d = sp["question_distribution"]
    if not isinstance(o_d, dict) and sp.get("output_distribution") is not None:
        o_d = sp["output_distribution"]
    for d, k in ((sys_d, "system_prompt_len"), (q_d, "question_len"), (o_d, "output_len")):
        _check_dist(d, f"data.shared_prefix.{k}")
    sys_lens = _ip_lengths(sys_d, groups, rng, legacy=False).tolist()
    q, o = [], []
    for _ in range(groups):
        q.append(_ip_lengths(q_d, per, rng, legacy=False).tolist())
        o.append(_ip_lengths(o_d, per, rng, legacy=False).tolist())
    table = [(sys_lens[g] + q[g][p], o[g][p], _group_ids(g, sys_lens[g], block_size))
             for g in range(groups) for p in range(per)]
    perm = rng.permutation(len(table))
    return [table[i] for i in perm.tolist()]


def _inference_perf(doc: dict, seed: int | None) -> ProfileSpec:
    load = doc.get("load") or {}
    data = doc.get("data") or {}
    ltype = str(load.get("type", "constant"))
    if ltype not in ("constant", "poisson", "concurrent"):
        raise ValueError(f"load.type: {ltype!r} is not supported (constant, poisson, concurrent)")
    if load.get("sweep"):
        raise ValueError("load.sweep: the saturation probe is not replayed; list the stages "
                         "(load.stages) or use simulate sweep")
    interval = _pos(load.get("interval", 1.0), "load.interval", zero=True, hi=MAX_ARRIVAL_S)
    stages = []
    for i, st in enumerate(load.get("stages") or []):
        where = f"load.stages[{i}]"
        gap = 0.0 if i == 0 else interval + 1.0  # sleep(interval), then the timer's 1-s head start
        if ltype == "concurrent":
            stages.append(_stage({
                "concurrency": _pos(st["concurrency_level"], f"{where}.concurrency_level",
                                    integer=True),
                "num_requests": _pos(st["num_requests"], f"{where}.num_requests", integer=True),
                "gap_s": gap}, where))
        else:
            rate = _pos(st["rate"], f"{where}.rate")
            dur = _pos(st["duration"], f"{where}.duration", hi=MAX_ARRIVAL_S)
            stages.append(_stage({"rate": rate, "duration_s": dur, "gap_s": gap, "arrivals":
                                  "inference-perf" if ltype == "constant" else "poisson"}, where))
    workers, per_worker = load.get("num_workers"), load.get("worker_max_concurrency")
    max_conc = None
    if ltype != "concurrent" and workers is not None:
        max_conc = _pos(workers, "load.num_workers", integer=True) * _pos(
            per_worker if per_worker is not None else 100, "load.worker_max_concurrency",
            integer=True)
    client = {}
    if load.get("request_timeout") is not None:
        client["request_timeout_s"] = _pos(load["request_timeout"], "load.request_timeout")
    base_seed = load.get("base_seed", seed if seed is not None else 0)
    dtype = str(data.get("type", "mock"))
    ignored = [f"load.{k}" for k in load if k not in {
        "type", "interval", "stages", "num_workers", "worker_max_concurrency", "request_timeout",
        "base_seed", "request_retries", "request_retry_backoff_sec",
        "stage_teardown_grace_seconds", "circuit_breakers"}]
    notes = []
    if load.get("request_retries"):
        notes.append("load.request_retries: retries cover connection faults only (never "
                     "timeouts), which a simulated server does not have")

    if dtype == "shared_prefix":
        sp = data.get("shared_prefix") or {}
        if sp.get("enable_multi_turn_chat"):
            ignored.append("data.shared_prefix.enable_multi_turn_chat")
        if sp.get("multimodal"):
            ignored.append("data.shared_prefix.multimodal")

        shared_prefix_table(sp, 16)  # its errors now, not when the run starts

        def source(k: int, block_size: int) -> Iterator[RequestSpec]:
            return _requests(iter(shared_prefix_table(sp, block_size)))
    elif dtype in ("random", "synthetic"):
        if data.get("trace"):
            raise ValueError("data.trace: give the trace to a kind: trace workload instead")
        ind, outd = data.get("input_distribution"), data.get("output_distribution")
        if not isinstance(ind, dict) or not isinstance(outd, dict):
            raise ValueError(f"data: type {dtype} needs input_distribution and "
                             "output_distribution")
        if not ind.get("total_count") or not outd.get("total_count"):
            raise ValueError("data.input_distribution / output_distribution: total_count is "
                             "required")
        n_in = _pos(ind["total_count"], "data.input_distribution.total_count", integer=True,
                    hi=MAX_TABLE)
        n_out = _pos(outd["total_count"], "data.output_distribution.total_count", integer=True,
                     hi=MAX_TABLE)
        _check_dist(ind, "data.input_distribution")
        _check_dist(outd, "data.output_distribution")

        def source(k: int, block_size: int) -> Iterator[RequestSpec]:
            rng = np.random.default_rng(base_seed)
            ins = _ip_lengths(ind, n_in, rng, legacy=True)
            outs = _ip_lengths(outd, n_out, rng, legacy=True)
            n = min(n_in, n_out)
            return _requests(iter(zip(ins[:n].tolist(), outs[:n].tolist(), [None] * n)))
    else:
        raise ValueError(f"data.type: {dtype!r} is not supported (shared_prefix, random, "
                         "synthetic); its prompts come from a dataset or tokenizer")
    ignored += [f"data.{k}" for k in data if k not in {
        "type", "shared_prefix", "input_distribution", "output_distribution", "path",
        "corpus_file_path"}]
    ignored += [k for k in doc if k not in {"load", "data"} | _IP_QUIET]
    return ProfileSpec("inference-perf", stages, source, restart_data=True, client=client,
                       max_concurrency=max_conc, ignored=ignored, notes=notes)
