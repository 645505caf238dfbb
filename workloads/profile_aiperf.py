"""AIPerf (v2 YAML config; the 0.x ``input_config`` of ``profile_export_aiperf.json``) and
genai-perf configs: phases or one profiling stage after warm-up, synthetic ISL/OSL
distributions and prefix-prompt pools."""

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
    _pos,
    _requests,
    _stage,
    _tokens,
)
from servesim.workloads.schema import MAX_ARRIVAL_S, MAX_REQUESTS, MAX_TOKENS, RequestSpec


def _aiperf_dist(v: Any, where: str) -> dict | None:
    """AIPerf distributions: a number (fixed), {mean, stddev} (normal, truncated at 0),
    {mean, median} (lognormal), {mean} (fixed)."""
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return {"mean": float(_tokens(round(v) if math.isfinite(v) else v, where)),
                "stddev": 0.0}
    if isinstance(v, dict):
        mean = _pos(v.get("mean", 0), f"{where}.mean", zero=True, hi=MAX_TOKENS)
        if "median" in v:
            return {"mean": mean, "median": _pos(v["median"], f"{where}.median", hi=MAX_TOKENS)}
        return {"mean": mean, "stddev": _pos(v.get("stddev", 0) or 0, f"{where}.stddev",
                                             zero=True, hi=MAX_TOKENS)}
    raise ValueError(f"{where}: expected a number or {{mean, stddev}}, got {v!r}")


def _aiperf_sample(d: dict, n: int, rng: np.random.Generator) -> np.ndarray:
    if "median" in d:  # lognormal with this mean and median: mu = ln median, sigma² = 2 ln(mean/med)
        mu = math.log(d["median"])
        sigma = math.sqrt(max(2 * math.log(d["mean"] / d["median"]), 0.0))
        x = rng.lognormal(mu, sigma, size=n)
    elif d["stddev"] > 0:
        x = np.abs(rng.normal(d["mean"], d["stddev"], size=n))  # truncated at 0 (resampled ≈)
    else:
        x = np.full(n, d["mean"])
    return np.clip(np.rint(x), 1, MAX_TOKENS).astype(np.int64)


def _aiperf_phase(ph: dict, where: str) -> dict:
    ptype = str(_get(ph, "type", default="concurrency"))
    st: dict = {"label": str(_get(ph, "name", default=ptype))}
    reqs = _get(ph, "requests", "request_count")
    dur = _get(ph, "duration", "benchmark_duration")
    conc = _get(ph, "concurrency")
    if reqs is not None:
        st["num_requests"] = _pos(reqs, f"{where}.requests", integer=True, hi=MAX_REQUESTS)
    if dur is not None:
        st["duration_s"] = _pos(dur, f"{where}.duration", hi=MAX_ARRIVAL_S)
        grace = _get(ph, "grace_period", "benchmark_grace_period")
        st["grace_s"] = (_pos(grace, f"{where}.grace_period", zero=True, hi=MAX_ARRIVAL_S)
                         if grace is not None else 30.0)
    if conc is not None:
        st["concurrency"] = _pos(conc, f"{where}.concurrency", integer=True)
    if ptype == "concurrency":
        if conc is None:
            st["concurrency"] = 1
    elif ptype in ("poisson", "constant", "gamma", "request_rate"):
        rate = _get(ph, "rate", "request_rate")
        if rate is None:
            raise ValueError(f"{where}.rate: required for a {ptype} phase")
        st["rate"] = _pos(rate, f"{where}.rate")
        st["arrivals"] = {"request_rate": "poisson"}.get(ptype, ptype)
        if ptype == "gamma":
            st["burstiness"] = _pos(_get(ph, "smoothness", default=1.0), f"{where}.smoothness")
    else:
        raise ValueError(f"{where}.type: {ptype!r} is not supported (concurrency, poisson, "
                         "constant, gamma)")
    if _get(ph, "exclude_from_results", default=False) or st["label"] == "warmup":
        st["warmup"] = True
    if "num_requests" not in st and "duration_s" not in st:
        raise ValueError(f"{where}: needs requests or duration")
    return _stage(st, where)


def _aiperf(doc: dict, seed: int | None, fmt: str) -> ProfileSpec:
    if "input_config" in doc and isinstance(doc["input_config"], dict):
        doc = doc["input_config"]
    ignored: list[str] = []
    client: dict = {}
    stages: list[dict] = []
    isl = osl = prefix = None
    entries = None
    rseed = _get(doc, "random_seed", default=None)
    bench = doc.get("benchmark")
    if isinstance(bench, dict) or "phases" in doc:  # AIPerf v2
        b = bench if isinstance(bench, dict) else doc
        ep = b.get("endpoint") or {}
        if isinstance(ep, dict) and ep.get("timeout") is not None:
            client["request_timeout_s"] = _pos(ep["timeout"], "benchmark.endpoint.timeout")
        ds = b.get("dataset") if b.get("dataset") is not None else b.get("datasets")
        if isinstance(ds, list):
            ds = ds[0] if ds else {}
        ds = ds or {}
        if str(ds.get("type", "synthetic")) != "synthetic":
            raise ValueError("benchmark.dataset.type: only synthetic datasets are supported")
        prompts = ds.get("prompts") or {}
        isl = _aiperf_dist(_get(ds, "isl", default=prompts.get("isl")), "dataset.isl")
        osl = _aiperf_dist(_get(ds, "osl", default=prompts.get("osl")), "dataset.osl")
        pp = _get(ds, "prefix_prompts", default=None) or _get(prompts, "prefix_prompts") or {}
        if pp:
            prefix = (_pos(_get(pp, "pool_size", default=0) or 0, "prefix_prompts.pool_size",
                           integer=True, zero=True, hi=MAX_TABLE),
                      _tokens(_get(pp, "length", default=0), "prefix_prompts.length"))
        entries = _get(ds, "entries", default=None)
        phases = b.get("phases")
        if isinstance(phases, dict):
            phases = [{"name": k, **v} for k, v in phases.items()]
        if phases is None:
            phases = [{"name": k, **b[k]} for k in ("warmup", "profiling") if isinstance(b.get(k), dict)]
        for i, ph in enumerate(phases or []):
            stages.append(_aiperf_phase(ph, f"benchmark.phases[{i}]"))
        rseed = doc.get("randomSeed", doc.get("random_seed", rseed))
    elif "perf_analyzer" in doc or "input" in doc or "loadgen" in doc:  # genai-perf / AIPerf 0.x
        pa = doc.get("perf_analyzer") or {}
        lg = doc.get("loadgen") or {}
        inp = doc.get("input") or {}
        prm = inp.get("prompt") or {}
        stim = pa.get("stimulus") or {}
        conc = _get(lg, "concurrency", default=stim.get("concurrency"))
        rate = _get(lg, "request_rate", default=stim.get("request_rate"))
        count = _get(lg, "request_count", default=None)
        meas = pa.get("measurement") or {}
        if count is None and str(meas.get("mode", "request_count")).lower() == "request_count":
            count = meas.get("num")
        dur = _get(lg, "benchmark_duration", default=None)
        warm = _get(lg, "warmup_request_count", default=pa.get("warmup_request_count", 0))
        isl = _aiperf_dist(prm.get("input_tokens") or inp.get("synthetic_tokens"), "input tokens")
        osl = _aiperf_dist(prm.get("output_tokens") or inp.get("output_tokens"), "output tokens")
        pfx = prm.get("prefix_prompt") or inp.get("prefix_prompt") or {}
        if pfx:
            prefix = (_pos(_get(pfx, "pool_size", "num", default=0) or 0, "prefix_prompt.num",
                           integer=True, zero=True, hi=MAX_TABLE),
                      _tokens(_get(pfx, "length", default=0) or 0, "prefix_prompt.length"))
        entries = _get(inp, "num_dataset_entries", "conversation_num", default=None)
        rseed = _get(inp, "random_seed", default=rseed)
        to = _get(doc.get("endpoint") or {}, "timeout_seconds", "timeout", default=None)
        if to is not None:
            client["request_timeout_s"] = _pos(to, "endpoint.timeout")
        stages = _flat_stages(conc, rate, count, dur, warm, lg.get("benchmark_grace_period"))
    else:  # flat CLI options (genai-perf's input_config, AIPerf CLI flags as a mapping)
        isl = _aiperf_dist(_get(doc, "synthetic_input_tokens_mean", "isl") if not isinstance(
            doc.get("isl"), dict) else doc["isl"], "synthetic_input_tokens_mean")
        if isl is not None and _get(doc, "synthetic_input_tokens_stddev") is not None:
            isl["stddev"] = float(_get(doc, "synthetic_input_tokens_stddev"))
        osl = _aiperf_dist(_get(doc, "output_tokens_mean", "osl"), "output_tokens_mean")
        if osl is not None and _get(doc, "output_tokens_stddev") is not None:
            osl["stddev"] = float(_get(doc, "output_tokens_stddev"))
        n_pfx = _get(doc, "num_prefix_prompts", "prefix_prompt_pool_size", default=0)
        if n_pfx:
            prefix = (_pos(n_pfx, "num_prefix_prompts", integer=True, hi=MAX_TABLE),
                      _tokens(_get(doc, "prefix_prompt_length", default=100),
                              "prefix_prompt_length"))
        entries = _get(doc, "num_dataset_entries", "conversation_num", default=None)
        to = _get(doc, "request_timeout_seconds", "timeout", default=None)
        if to is not None:
            client["request_timeout_s"] = _pos(to, "endpoint.timeout")
        stages = _flat_stages(_get(doc, "concurrency"), _get(doc, "request_rate"),
                              _get(doc, "request_count"), _get(doc, "benchmark_duration"),
                              _get(doc, "warmup_request_count", default=0),
                              _get(doc, "benchmark_grace_period"))
    if isl is None:
        isl = {"mean": 550.0, "stddev": 0.0}  # genai-perf / AIPerf default ISL
    if osl is None:
        raise ValueError("output lengths: give osl / output_tokens_mean (without it the server "
                         "decides when to stop, which a simulation cannot know)")
    rs = int(seed if seed is not None else (rseed if rseed is not None else 0))
    n_entries = (_pos(entries, "dataset entries", integer=True, hi=MAX_TABLE)
                 if entries is not None else 0)

    def source(k: int, block_size: int) -> Iterator[RequestSpec]:
        rng = np.random.default_rng(np.random.SeedSequence([rs, 4242]))
        n = n_entries or 4096
        ins = _aiperf_sample(isl, n, rng).tolist()
        outs = _aiperf_sample(osl, n, rng).tolist()
        pick = rng.integers(0, prefix[0], size=n).tolist() if prefix and prefix[0] else None

        def lengths():
            i = 0
            while True:
                j = i % n
                p, ids = ins[j], None
                if pick is not None:
                    g = pick[j]
                    p += prefix[1]
                    ids = _group_ids(g, prefix[1], block_size)
                yield p, outs[j], ids
                i += 1
        return _requests(lengths())

    return ProfileSpec(fmt, stages, source, restart_data=False, client=client, ignored=ignored)


def _flat_stages(conc, rate, count, dur, warm, grace) -> list[dict]:
    """genai-perf / AIPerf 0.x: one profiling stage (concurrency or request rate, request
    count or benchmark duration), after ``warmup_request_count`` warm-up requests at the same
    load. perf_analyzer's default measurement: 10 requests per unit of concurrency (at least
    10)."""
    base: dict = {}
    if conc is not None:
        conc = _pos(conc, "concurrency", integer=True)
    if rate is not None:
        base = {"rate": _pos(rate, "request_rate"), "arrivals": "poisson"}
        if conc is not None:
            base["concurrency"] = conc
    else:
        base = {"concurrency": conc or 1}
    stages = []
    warm = _pos(warm or 0, "warmup_request_count", integer=True, zero=True, hi=MAX_REQUESTS)
    if warm:
        stages.append(_stage({**base, "num_requests": warm, "warmup": True, "label": "warmup"},
                             "warmup"))
    prof = {**base, "label": "profiling"}
    if dur is not None:
        prof["duration_s"] = _pos(dur, "benchmark_duration", hi=MAX_ARRIVAL_S)
        prof["grace_s"] = (_pos(grace, "benchmark_grace_period", zero=True, hi=MAX_ARRIVAL_S)
                           if grace is not None else 30.0)
    if count is not None:
        prof["num_requests"] = _pos(count, "request_count", integer=True, hi=MAX_REQUESTS)
    if dur is None and count is None:
        prof["num_requests"] = max(10, 10 * (conc or 1))
    stages.append(_stage(prof, "profiling"))
    return stages
