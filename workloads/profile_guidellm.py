"""GuideLLM scenarios (vllm-project/guidellm; the 0.8 ``spec`` layout, the earlier flat one,
the ``config`` of a ``benchmarks.json``): benchmark profiles, constraints, warm-up and
``synthetic_text`` data with GuideLLM's own length sampler."""

from __future__ import annotations

import math
import random as pyrandom
import re
from collections.abc import Iterator
from typing import Any

from servesim.workloads.profile_common import (
    MAX_TABLE,
    ProfileSpec,
    _group_ids,
    _pos,
    _requests,
    _stage,
    _tokens,
)
from servesim.workloads.schema import MAX_ARRIVAL_S, MAX_REQUESTS, RequestSpec


class IntegerRangeSampler:
    """GuideLLM's ``IntegerRangeSampler`` (``utils/random.py``): Python ``random.Random(seed)``;
    no stdev → ``randint(min, max)`` (or the average when min == max); else
    ``round(clip(gauss(average, stdev), min, max))``, min/max defaulting to average ∓ 5·stdev
    (min at least 1). Same numbers as GuideLLM for the same seed."""

    def __init__(self, average: int, stdev: int | None, lo: int | None, hi: int | None,
                 seed: int):
        self.rng = pyrandom.Random(seed)
        self.average, self.stdev = average, stdev
        self.lo = lo if lo is not None else max(1, average - 5 * stdev if stdev else average)
        self.hi = hi if hi is not None else (average + 5 * stdev if stdev else average)

    def __iter__(self) -> Iterator[int]:
        if self.lo == self.hi:
            while True:
                yield self.lo
        elif not self.stdev:
            while True:
                yield self.rng.randint(self.lo, self.hi)
        else:
            while True:
                x = self.rng.gauss(self.average, self.stdev)
                yield round(max(self.lo, min(self.hi, x)))


def _parse_kv(text: str) -> dict:
    """GuideLLM's ``key=value,key=value`` data strings."""
    out = {}
    for part in text.split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            v = v.strip()
            try:
                out[k.strip()] = int(v)
            except ValueError:
                try:
                    out[k.strip()] = float(v)
                except ValueError:
                    out[k.strip()] = v
    return out


def _set_path(tree: dict, key: str, value: Any) -> None:
    """GuideLLM benchmark overrides: ``profile.rate``, ``constraints[0].seconds``."""
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", key)
    node: Any = tree
    for i, p in enumerate(parts):
        last = i == len(parts) - 1
        if p.startswith("["):
            idx = int(p[1:-1])
            while len(node) <= idx:
                node.append({})
            if last:
                node[idx] = value
            else:
                node = node[idx]
        else:
            if last:
                node[p] = value
            else:
                nxt = parts[i + 1]
                node = node.setdefault(p, [] if nxt.startswith("[") else {})


def _guidellm_spec(doc: dict) -> tuple[list[dict], list[str]]:
    """Normalise a GuideLLM document to a list of benchmark specs (each with ``profile``,
    ``data``, ``constraints``, ``seed``), applying the ``benchmarks`` overrides."""
    import copy

    if "config" in doc and isinstance(doc["config"], dict):  # a benchmarks.json report
        doc = doc["config"]
    ignored: list[str] = []
    if "spec" in doc or isinstance(doc.get("benchmarks"), list):
        base = copy.deepcopy(doc.get("spec") or {})
        overrides = doc.get("benchmarks") or [None]
        out = []
        for ov in overrides:
            b = copy.deepcopy(base)
            for k, v in (ov or {}).items():
                _set_path(b, k, v)
            out.append(b)
        return out, ignored
    # the flat layout of GuideLLM <= 0.4 (CLI options as a scenario)
    prof = doc.get("profile", doc.get("rate_type", "sweep"))
    rate = doc.get("rate")
    kind = str(prof)
    profile: dict = {"kind": kind}
    if kind in ("constant", "poisson", "async") and rate is not None:
        profile["rate"] = rate
    elif kind == "concurrent" and rate is not None:
        profile["streams"] = rate
    elif kind == "sweep" and rate is not None:
        profile["sweep_size"] = rate[0] if isinstance(rate, list) else rate
    elif kind == "throughput" and doc.get("max_concurrency") is not None:
        profile["max_concurrency"] = doc["max_concurrency"]
    for src, dst in (("warmup_percent", "warmup"), ("warmup", "warmup"),
                     ("cooldown_percent", "cooldown"), ("cooldown", "cooldown"),
                     ("max_concurrency", "max_concurrency")):
        if doc.get(src) is not None:
            profile[dst] = doc[src]
    data = doc.get("data")
    if isinstance(data, str):
        data = _parse_kv(data) if "=" in data else {"path": data}
    if isinstance(data, dict):
        data = [{"kind": "synthetic_text", **data}]
    cons = []
    if doc.get("max_seconds") is not None:
        cons.append({"kind": "max_duration", "seconds": doc["max_seconds"]})
    if doc.get("max_requests") is not None:
        cons.append({"kind": "max_requests", "count": doc["max_requests"]})
    seed = doc.get("random_seed", 42)
    known = {"profile", "rate_type", "rate", "data", "max_seconds", "max_requests",
             "warmup_percent", "warmup", "cooldown_percent", "cooldown", "max_concurrency",
             "random_seed"}
    ignored = [k for k in doc if k not in known | {"target", "model", "backend", "backend_type",
                                                   "processor", "output_path", "outputs",
                                                   "tokenizer", "backend_kwargs"}]
    return [{"profile": profile, "data": data or [], "constraints": cons,
             "seed": {"kind": "static", "value": seed}}], ignored


def _guidellm_limits(b: dict) -> tuple[float | None, int | None]:
    """GuideLLM's max_duration seconds / max_requests count (both must be > 0 there)."""
    secs = reqs = None
    for i, c in enumerate(b.get("constraints") or []):
        kind = c.get("kind")
        if kind == "max_duration":
            v = c.get("seconds")
            secs = _pos(v[0] if isinstance(v, list) else v, f"constraints[{i}].seconds",
                        hi=MAX_ARRIVAL_S)
        elif kind in ("max_requests", "min_requests"):
            v = c.get("count", c.get("value"))
            reqs = _pos(v[0] if isinstance(v, list) else v, f"constraints[{i}].count",
                        integer=True, hi=MAX_REQUESTS)
    return secs, reqs


def _guidellm_warmup(p: dict, secs, reqs) -> dict | None:
    w = p.get("warmup")
    if w in (None, 0, 0.0):
        return None
    if isinstance(w, (int, float)):
        w = {"percent": w} if w < 1 else {"value": w}
    pct, val, mode = w.get("percent"), w.get("value"), w.get("mode", "prefer_duration")
    dur = n = None
    if mode != "requests" and secs is not None:
        dur = pct * secs if pct is not None else (float(val) if val is not None else None)
    if mode != "duration" and reqs is not None:
        n = int(pct * reqs) if pct is not None else (int(val) if val is not None else None)
    if mode == "prefer_duration" and dur is not None:
        n = None
    elif mode == "prefer_requests" and n is not None:
        dur = None
    if dur:
        return {"duration_s": dur}
    if n:
        return {"num_requests": n}
    return None


def _guidellm(doc: dict, seed: int | None, select: list[int] | None,
              sweep_rates: list[float] | None) -> ProfileSpec:
    benches, ignored = _guidellm_spec(doc)
    if select is not None and (not select or any(not 0 <= i < len(benches) for i in select)):
        raise ValueError(f"benchmarks: {select} selects no benchmark or one that does not exist "
                         f"(the profile has {len(benches)}: indices 0..{len(benches) - 1})")
    notes: list[str] = []
    stages: list[dict] = []
    warmup = None
    data_cfg = None
    seed_value = 42
    for bi, b in enumerate(benches):
        p = b.get("profile") or {"kind": "sweep"}
        if isinstance(p, str):
            p = {"kind": p}
        secs, reqs = _guidellm_limits(b)
        w = _guidellm_warmup(p, secs, reqs)
        if w is not None:
            warmup = w
        for k in ("cooldown", "rampup_duration"):
            if p.get(k):
                ignored.append(f"profile.{k}")
        limit = {}
        if secs is not None:
            limit["duration_s"] = secs
            limit["grace_s"] = 0.0  # max_duration cancels what is still in flight
        if reqs is not None:
            limit["num_requests"] = reqs
        if not limit:
            raise ValueError("constraints: a max_duration or max_requests constraint is needed "
                             "(GuideLLM would run forever)")
        kind = p.get("kind", "sweep")
        mc = p.get("max_concurrency")
        one: list[dict] = []
        if kind == "synchronous":
            one = [{"concurrency": 1, "label": "synchronous"}]
        elif kind == "concurrent":
            streams = p.get("streams")
            streams = streams if isinstance(streams, list) else [streams]
            streams = [_pos(s, "profile.streams", integer=True) for s in streams]
            one = [{"concurrency": s, "label": f"concurrent@{s}"} for s in streams]
        elif kind == "throughput":
            one = [{"concurrency": int(mc or 512), "label": "throughput"}]
        elif kind in ("constant", "poisson", "async"):
            rates = p.get("rate")
            rates = rates if isinstance(rates, list) else [rates]
            arr = "poisson" if kind == "poisson" else "constant"
            rates = [_pos(r, "profile.rate") for r in rates]
            one = [{"rate": float(r), "concurrency": mc, "arrivals": arr,
                    "label": f"{'poisson' if arr == 'poisson' else 'constant'}@{float(r):g}"}
                   for r in rates]
        elif kind == "sweep":
            size = int(p.get("sweep_size", 10))
            arr = str(p.get("strategy_type", "constant"))
            mc = mc if "max_concurrency" in p else 512
            one = [{"concurrency": 1, "label": "synchronous"},
                   {"concurrency": int(mc or 512), "label": "throughput"}]
            if sweep_rates:
                one += [{"rate": float(r), "concurrency": mc, "arrivals": arr,
                         "label": f"{arr}@{float(r):g}"} for r in sweep_rates]
            else:
                notes.append(f"profile sweep: its {size - 2} {arr}-rate benchmarks need the "
                             "measured synchronous and throughput rates; set workload."
                             "sweep_rates, or run simulate sweep with profile_sweep")
        else:
            raise ValueError(f"profile.kind: {kind!r} is not supported (synchronous, concurrent, "
                             "throughput, constant, poisson, sweep)")
        if select is not None and bi not in select:
            continue
        for st in one:
            if "concurrency" in st and st.get("rate") is None:
                st.pop("rate", None)
            if st.get("concurrency") is None:
                st.pop("concurrency", None)
            stages.append(_stage({**st, **limit}, f"benchmark {bi} ({st['label']})"))
        data = b.get("data") or []
        if isinstance(data, dict):
            data = [data]
        if isinstance(data, str):
            data = [{"kind": "synthetic_text", **_parse_kv(data)}]
        if data and data_cfg is None:
            data_cfg = data[0]
        sv = b.get("seed")
        if isinstance(sv, dict):
            seed_value = int(sv.get("value", 42))
        elif isinstance(sv, int):
            seed_value = sv
    if seed is not None:
        seed_value = seed
    if not isinstance(data_cfg, dict) or data_cfg.get("kind", "synthetic_text") != "synthetic_text":
        raise ValueError("data: only synthetic_text data is supported (prompt_tokens, "
                         "output_tokens, ...); a dataset's prompts need its tokenizer")
    d = data_cfg
    if int(d.get("turns", 1) or 1) > 1:
        ignored.append("data.turns")
    if "prompt_tokens" not in d:
        raise ValueError("data.prompt_tokens: required")
    for k in ("prompt_tokens", "prompt_tokens_stdev", "prompt_tokens_min", "prompt_tokens_max",
              "output_tokens", "output_tokens_stdev", "output_tokens_min", "output_tokens_max"):
        if d.get(k) is not None:
            _tokens(d[k], f"data.{k}")
    for k in ("prompt_tokens", "output_tokens"):
        if d.get(k):
            r = IntegerRangeSampler(int(d[k]), d.get(f"{k}_stdev"), d.get(f"{k}_min"),
                                    d.get(f"{k}_max"), 0)
            if r.lo > r.hi:
                raise ValueError(f"data.{k}_min {r.lo} > {k}_max {r.hi} (with {k} {d[k]} and "
                                 f"{k}_stdev {d.get(f'{k}_stdev')})")
    buckets = d.get("prefix_buckets")
    if buckets is None and (d.get("prefix_count") or d.get("prefix_tokens")):
        buckets = [{"bucket_weight": 100, "prefix_count": int(d.get("prefix_count") or 1),
                    "prefix_tokens": int(d.get("prefix_tokens") or 0)}]
    if buckets:
        for i, b in enumerate(buckets):
            _pos(b.get("prefix_count"), f"data.prefix_buckets[{i}].prefix_count", integer=True,
                 hi=MAX_TABLE)
            _pos(b.get("bucket_weight", 100), f"data.prefix_buckets[{i}].bucket_weight",
                 integer=True, hi=MAX_TABLE)
            _tokens(b.get("prefix_tokens", 0), f"data.prefix_buckets[{i}].prefix_tokens")
        lcm = math.lcm(*(int(b["prefix_count"]) for b in buckets))
        if lcm * sum(int(b.get("bucket_weight", 100)) for b in buckets) > MAX_TABLE:
            raise ValueError(f"data.prefix_buckets: the weighted prefix pool holds more than "
                             f"{MAX_TABLE:g} entries (lcm of prefix_count × bucket weights)")

    def source(k: int, block_size: int) -> Iterator[RequestSpec]:
        s = seed_value + k  # GuideLLM re-iterates its dataset per benchmark: seed + iteration
        pin = iter(IntegerRangeSampler(int(d["prompt_tokens"]), d.get("prompt_tokens_stdev"),
                                       d.get("prompt_tokens_min"), d.get("prompt_tokens_max"), s))
        out_mean = d.get("output_tokens")
        pout = (iter(IntegerRangeSampler(int(out_mean), d.get("output_tokens_stdev"),
                                         d.get("output_tokens_min"), d.get("output_tokens_max"),
                                         s + 1)) if out_mean else None)
        prefixes: list[tuple[int, int]] = []  # (group id, tokens)
        rand = pyrandom.Random(s + 3)
        if buckets:
            lcm = math.lcm(*(int(b["prefix_count"]) for b in buckets))
            g = 0
            for b in buckets:
                count = lcm * int(b.get("bucket_weight", 100)) // int(b["prefix_count"])
                group = [(g + j, int(b.get("prefix_tokens", 0))) for j in range(int(b["prefix_count"]))]
                g += int(b["prefix_count"])
                prefixes.extend(group * count)

        def lengths():
            while True:
                p = next(pin)
                o = next(pout) if pout is not None else 1
                ids = None
                if prefixes:
                    gid, toks = rand.choice(prefixes)
                    p += toks
                    ids = _group_ids(gid, toks, block_size)
                yield p, o, ids
        return _requests(lengths())

    known_data = {"kind", "prompt_tokens", "prompt_tokens_stdev", "prompt_tokens_min",
                  "prompt_tokens_max", "output_tokens", "output_tokens_stdev", "output_tokens_min",
                  "output_tokens_max", "prefix_count", "prefix_tokens", "prefix_buckets", "turns"}
    ignored += [f"data.{k}" for k in d if k not in known_data]
    return ProfileSpec("guidellm", stages, source, restart_data=True, warmup=warmup,
                       ignored=ignored, notes=notes)
