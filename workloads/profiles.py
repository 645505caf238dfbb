"""Benchmark-client load profiles as workloads (``workload.kind: profile``).

A profile is what a user hands their benchmark client: an inference-perf config YAML, a
GuideLLM scenario (JSON/YAML, or the ``config`` of its ``benchmarks.json``), an AIPerf config
(v2 YAML, or the ``input_config`` of ``profile_export_aiperf.json``) or a genai-perf config.
Each is read into the same shape: load stages (``workloads/stages.py``), warm-up, client
settings (request timeout) and a request source (lengths, shared prefixes), so the simulator
sends what the client would have sent, in the order it would have sent it. Which keys each
reader honours is listed in ``workloads/README.md`` ("kind: profile") and in each reader's
docstring; every other key is ignored with one warning naming them (endpoint, tokenizer,
storage and report keys silently: they do not change the load).

No tokenizer is loaded: prompt lengths are the token counts the profile asks for (inference-perf
and GuideLLM generate text that tokenizes to exactly that many tokens).
"""

from __future__ import annotations

import json
import math
import random as pyrandom
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from servesim.simulator.errors import ConfigError
from servesim.workloads.schema import RequestSpec

PROFILE_PREFIX_BASE = 6 << 56  # + (group << 24) + block: shared system prompts of profiles
FORMATS = ("inference-perf", "guidellm", "aiperf", "genai-perf")


@dataclass
class ProfileSpec:
    """A profile as the simulator runs it."""

    format: str
    stages: list[dict]  # Stage fields (workloads/config.py), in order
    source: Callable[[int, int], Iterator[RequestSpec]]  # (restart k, block_size) -> requests
    restart_data: bool = False  # every stage starts the request source afresh
    warmup: dict | None = None  # {num_requests | duration_s}, leading part of every stage
    client: dict = field(default_factory=dict)  # request_timeout_s, max_retries
    max_concurrency: int | None = None
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Reading and detection


def load_document(path: str | Path) -> Any:
    """A profile file (YAML or JSON) as Python data; one-line ConfigError on bad input."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such profile file")
    text = p.read_text(encoding="utf-8-sig")
    try:
        if p.suffix.lower() == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                          f"{str(e).splitlines()[0]}") from None


def detect_format(doc: Any) -> str | None:
    """Which client a profile document belongs to (None: not a profile we know)."""
    if not isinstance(doc, dict):
        return None
    if "input_config" in doc and isinstance(doc["input_config"], dict):  # AIPerf/genai-perf
        inner = detect_format(doc["input_config"])
        return inner or "aiperf"
    if "load" in doc and isinstance(doc["load"], dict) and ("data" in doc or "stages" in doc["load"]
                                                             or "type" in doc["load"]):
        return "inference-perf"
    if "benchmark" in doc or "schemaVersion" in doc or "phases" in doc:
        return "aiperf"
    if "perf_analyzer" in doc or "loadgen" in doc:
        return "genai-perf" if "perf_analyzer" in doc else "aiperf"
    if ("spec" in doc or "profile" in doc or "rate_type" in doc
            or ("config" in doc and isinstance(doc.get("benchmarks"), list))):
        return "guidellm"
    flat = {"synthetic_input_tokens_mean", "output_tokens_mean", "warmup_request_count",
            "request_count"}
    if flat & set(doc) and not {"completed", "input_lens", "date"} & set(doc):
        return "genai-perf"
    return None


def is_profile_file(path: str | Path) -> bool:
    """True for a small YAML/JSON file that :func:`detect_format` recognises (cheap: big
    files are traces, not profiles)."""
    p = Path(path)
    if p.suffix.lower() not in (".yaml", ".yml", ".json") or not p.is_file():
        return False
    if p.stat().st_size > 1 << 20:
        return False
    try:
        return detect_format(load_document(p)) is not None
    except ConfigError:
        return False


def read_profile(path: str | Path, fmt: str = "auto", *, seed: int | None = None,
                 benchmarks: list[int] | None = None,
                 sweep_rates: list[float] | None = None) -> ProfileSpec:
    """Parse a profile file into a :class:`ProfileSpec` (errors name the file and key)."""
    doc = load_document(path)
    found = detect_format(doc)
    if fmt == "auto":
        if found is None:
            raise ConfigError(f"{path}: not a known profile (expected an inference-perf config, "
                              "a GuideLLM scenario or an AIPerf / genai-perf config)")
        fmt = found
    if fmt not in FORMATS:
        raise ConfigError(f"{path}: format: {fmt!r} is not one of {', '.join(FORMATS)}")
    try:
        if fmt == "inference-perf":
            spec = _inference_perf(doc, seed)
        elif fmt == "guidellm":
            spec = _guidellm(doc, seed, benchmarks, sweep_rates)
        else:
            spec = _aiperf(doc, seed, fmt)
    except (KeyError, TypeError, ValueError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ConfigError(f"{path}: {fmt} profile: {msg}") from None
    if not spec.stages:
        raise ConfigError(f"{path}: {fmt} profile: no load stages")
    return spec


def _num(v: Any, where: str) -> float:
    """A number, also from AIPerf duration strings ("30s", "5m", "1h")."""
    if isinstance(v, bool):
        raise ValueError(f"{where}: expected a number, got {v!r}")  # noqa: TRY004 (a config error)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(ms|s|m|h)?\s*", v)
        if m:
            x = float(m.group(1))
            return x * {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}[m.group(2)]
        if v.strip().lower() in ("inf", "infinity"):
            return math.inf
    raise ValueError(f"{where}: expected a number, got {v!r}")


def _get(d: dict, *names: str, default=None):
    """The first of ``names`` (snake_case or camelCase) present in ``d``."""
    for n in names:
        for k in (n, _camel(n), n.replace("_", "-")):
            if k in d:
                return d[k]
    return default


def _camel(s: str) -> str:
    head, *rest = s.split("_")
    return head + "".join(w.title() for w in rest)


def _requests(lengths: Iterator[tuple[int, int, tuple | None]]) -> Iterator[RequestSpec]:
    for i, (p, o, ids) in enumerate(lengths):
        yield RequestSpec(arrival_s=0.0, prompt_len=max(int(p), 1), output_len=max(int(o), 1),
                          request_id=str(i), prefix_block_ids=ids)


def _group_ids(group: int, tokens: int, block_size: int) -> tuple[int, ...] | None:
    n = tokens // block_size
    return tuple(PROFILE_PREFIX_BASE + (group << 24) + j for j in range(n)) or None


# ---------------------------------------------------------------------------------------------
# inference-perf (kubernetes-sigs/inference-perf, config.yml)

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


def shared_prefix_table(sp: dict, block_size: int) -> list[tuple[int, int, tuple | None]]:
    """inference-perf ``SharedPrefixDataGenerator``: ``num_groups`` system prompts (one length
    each), ``num_prompts_per_group`` questions per group (lengths and output lengths drawn
    group by group), laid out group-major and then shuffled by a seeded permutation. Request
    ``i`` of a stage uses entry ``i mod (groups · prompts)``.

    The lengths are inference-perf's exactly (same numpy draws from ``default_rng(seed)``); the
    shuffle is a permutation of our own (``default_rng(seed)`` after the length draws):
    inference-perf draws its permutation after tokenizer-dependent token sampling, which
    cannot be replayed without the tokenizer."""
    groups = int(_get(sp, "num_groups", "num_unique_system_prompts", default=10))
    per = int(_get(sp, "num_prompts_per_group", "num_users_per_system_prompt", default=10))
    if groups < 1 or per < 1:
        raise ValueError("data.shared_prefix: num_groups and num_prompts_per_group must be >= 1")
    seed = sp.get("seed")
    rng = np.random.default_rng(seed if seed is not None else 0)
    sys_d = sp.get("system_prompt_len", 100)
    q_d = sp.get("question_len", 50)
    o_d = sp.get("output_len", 50)
    if not isinstance(q_d, dict) and sp.get("question_distribution") is not None:
        q_d = sp["question_distribution"]
    if not isinstance(o_d, dict) and sp.get("output_distribution") is not None:
        o_d = sp["output_distribution"]
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
    interval = float(load.get("interval", 1.0))
    stages = []
    for i, st in enumerate(load.get("stages") or []):
        where = f"load.stages[{i}]"
        gap = 0.0 if i == 0 else interval + 1.0  # sleep(interval), then the timer's 1-s head start
        if ltype == "concurrent":
            stages.append({"concurrency": int(st["concurrency_level"]),
                           "num_requests": int(st["num_requests"]), "gap_s": gap})
        else:
            rate, dur = _num(st["rate"], f"{where}.rate"), _num(st["duration"], f"{where}.duration")
            stages.append({"rate": rate, "duration_s": dur, "gap_s": gap,
                           "arrivals": "inference-perf" if ltype == "constant" else "poisson"})
    workers, per_worker = load.get("num_workers"), load.get("worker_max_concurrency")
    max_conc = None
    if ltype != "concurrent" and workers is not None:
        max_conc = int(workers) * int(per_worker if per_worker is not None else 100)
    client = {}
    if load.get("request_timeout") is not None:
        client["request_timeout_s"] = float(load["request_timeout"])
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

        def source(k: int, block_size: int) -> Iterator[RequestSpec]:
            return _requests(iter(shared_prefix_table(sp, block_size)))
    elif dtype in ("random", "synthetic"):
        if data.get("trace"):
            raise ValueError("data.trace: give the trace to a kind: trace workload instead")
        ind, outd = data.get("input_distribution"), data.get("output_distribution")
        if not isinstance(ind, dict) or not isinstance(outd, dict):
            raise ValueError(f"data: type {dtype} needs input_distribution and "
                             "output_distribution")
        n_in = int(ind.get("total_count") or 0)
        n_out = int(outd.get("total_count") or 0)
        if n_in < 1 or n_out < 1:
            raise ValueError("data.input_distribution / output_distribution: total_count is "
                             "required")

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


# ---------------------------------------------------------------------------------------------
# GuideLLM (vllm-project/guidellm scenarios; 0.8 "spec" layout and the earlier flat one)


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
    secs = reqs = None
    for c in b.get("constraints") or []:
        kind = c.get("kind")
        if kind == "max_duration":
            v = c.get("seconds")
            secs = float(v[0] if isinstance(v, list) else v)
        elif kind in ("max_requests", "min_requests"):
            v = c.get("count", c.get("value"))
            reqs = int(v[0] if isinstance(v, list) else v)
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
            one = [{"concurrency": int(s), "label": f"concurrent@{int(s)}"} for s in streams]
        elif kind == "throughput":
            one = [{"concurrency": int(mc or 512), "label": "throughput"}]
        elif kind in ("constant", "poisson", "async"):
            rates = p.get("rate")
            rates = rates if isinstance(rates, list) else [rates]
            arr = "poisson" if kind == "poisson" else "constant"
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
            stages.append({**st, **limit})
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
    buckets = d.get("prefix_buckets")
    if buckets is None and (d.get("prefix_count") or d.get("prefix_tokens")):
        buckets = [{"bucket_weight": 100, "prefix_count": int(d.get("prefix_count") or 1),
                    "prefix_tokens": int(d.get("prefix_tokens") or 0)}]

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


# ---------------------------------------------------------------------------------------------
# AIPerf (v2 YAML config; the 0.x ``input_config``) and genai-perf


def _aiperf_dist(v: Any, where: str) -> dict | None:
    """AIPerf distributions: a number (fixed), {mean, stddev} (normal, truncated at 0),
    {mean, median} (lognormal), {mean} (fixed)."""
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return {"mean": float(v), "stddev": 0.0}
    if isinstance(v, dict):
        if "median" in v:
            return {"mean": float(v["mean"]), "median": float(v["median"])}
        return {"mean": float(v.get("mean", 0)), "stddev": float(v.get("stddev", 0) or 0)}
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
    return np.maximum(np.rint(x), 1).astype(np.int64)


def _aiperf_phase(ph: dict, where: str) -> dict:
    ptype = str(_get(ph, "type", default="concurrency"))
    st: dict = {"label": str(_get(ph, "name", default=ptype))}
    reqs = _get(ph, "requests", "request_count")
    dur = _get(ph, "duration", "benchmark_duration")
    conc = _get(ph, "concurrency")
    if reqs is not None:
        st["num_requests"] = int(reqs)
    if dur is not None:
        st["duration_s"] = _num(dur, f"{where}.duration")
        grace = _get(ph, "grace_period", "benchmark_grace_period")
        st["grace_s"] = _num(grace, f"{where}.grace_period") if grace is not None else 30.0
    if conc is not None:
        st["concurrency"] = int(conc)
    if ptype == "concurrency":
        if conc is None:
            st["concurrency"] = 1
    elif ptype in ("poisson", "constant", "gamma", "request_rate"):
        rate = _get(ph, "rate", "request_rate")
        if rate is None:
            raise ValueError(f"{where}.rate: required for a {ptype} phase")
        st["rate"] = _num(rate, f"{where}.rate")
        st["arrivals"] = {"request_rate": "poisson"}.get(ptype, ptype)
        if ptype == "gamma":
            st["burstiness"] = float(_get(ph, "smoothness", default=1.0))
    else:
        raise ValueError(f"{where}.type: {ptype!r} is not supported (concurrency, poisson, "
                         "constant, gamma)")
    if _get(ph, "exclude_from_results", default=False) or st["label"] == "warmup":
        st["warmup"] = True
    if "num_requests" not in st and "duration_s" not in st:
        raise ValueError(f"{where}: needs requests or duration")
    return st


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
            client["request_timeout_s"] = _num(ep["timeout"], "benchmark.endpoint.timeout")
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
            prefix = (int(_get(pp, "pool_size", default=0) or 0), int(_get(pp, "length", default=0)))
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
            prefix = (int(_get(pfx, "pool_size", "num", default=0) or 0),
                      int(_get(pfx, "length", default=0) or 0))
        entries = _get(inp, "num_dataset_entries", "conversation_num", default=None)
        rseed = _get(inp, "random_seed", default=rseed)
        to = _get(doc.get("endpoint") or {}, "timeout_seconds", "timeout", default=None)
        if to is not None:
            client["request_timeout_s"] = float(to)
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
            prefix = (int(n_pfx), int(_get(doc, "prefix_prompt_length", default=100)))
        entries = _get(doc, "num_dataset_entries", "conversation_num", default=None)
        to = _get(doc, "request_timeout_seconds", "timeout", default=None)
        if to is not None:
            client["request_timeout_s"] = float(to)
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
    n_entries = int(entries) if entries else 0

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
    if rate is not None:
        base = {"rate": float(rate), "arrivals": "poisson"}
        if conc is not None:
            base["concurrency"] = int(conc)
    else:
        base = {"concurrency": int(conc or 1)}
    stages = []
    if warm:
        stages.append({**base, "num_requests": int(warm), "warmup": True, "label": "warmup"})
    prof = {**base, "label": "profiling"}
    if dur is not None:
        prof["duration_s"] = float(dur)
        prof["grace_s"] = float(grace) if grace is not None else 30.0
    if count is not None:
        prof["num_requests"] = int(count)
    if dur is None and count is None:
        prof["num_requests"] = max(10, 10 * int(conc or 1))
    stages.append(prof)
    return stages


# ---------------------------------------------------------------------------------------------
# The workload


def profile_workload(cfg, *, block_size: int, max_model_len: int | None, meta: dict,
                     limit: Callable):
    """``build_workload`` for ``kind: profile``: a staged Workload of the profile's requests.

    ``cfg.stages`` / ``cfg.warmup`` / ``cfg.max_concurrency`` (when set) replace the profile's;
    ``meta`` gains ``stages`` (the plan), ``warmup``, ``client`` (request_timeout_s, ...) and
    ``profile_format``."""
    from servesim.workloads import Workload, set_stage_meta
    from servesim.workloads.stages import StageControl, stage_plan, staged_requests

    spec = read_profile(cfg.path, cfg.format, seed=None, benchmarks=cfg.benchmarks,
                        sweep_rates=cfg.sweep_rates)
    quiet = {"api", "server", "tokenizer", "storage", "report", "metrics", "backend", "target",
             "model", "models", "endpoint", "output", "outputs", "artifacts"}
    shown = [k for k in spec.ignored if k.split(".")[0] not in quiet]
    if shown:
        warnings.warn(f"{cfg.path}: {spec.format} profile keys not simulated: "
                      f"{', '.join(sorted(set(shown)))}", stacklevel=2)
    for n in spec.notes:
        warnings.warn(f"{cfg.path}: {n}", stacklevel=2)
    stages = [s.model_dump() for s in cfg.stages] if cfg.stages else spec.stages
    plan = stage_plan(stages, restart_data=spec.restart_data and not cfg.stages)
    set_stage_meta(meta, plan)
    meta["dataset_name"] = spec.format
    meta["profile_format"] = spec.format
    meta["client"] = dict(spec.client)
    mc = cfg.max_concurrency if cfg.max_concurrency is not None else spec.max_concurrency
    if mc is not None and meta.get("max_concurrency") is None:
        meta["max_concurrency"] = mc
    meta["client_max_concurrency"] = mc
    warm = cfg.warmup.model_dump(exclude_none=True) if cfg.warmup is not None else spec.warmup
    if warm:
        meta["warmup"] = warm
    seed = cfg.seed

    def factory(meta: dict) -> Iterator[RequestSpec]:
        ctl = StageControl()
        meta["_stage_control"] = ctl
        return staged_requests(plan, seed, lambda k: spec.source(k, block_size), ctl)

    return Workload(limit(factory), meta)
