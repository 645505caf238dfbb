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

This module detects the client, dispatches to its reader and builds the workload; the readers
are ``profile_inference_perf.py``, ``profile_guidellm.py`` and ``profile_aiperf.py`` (AIPerf and
genai-perf), on the shape and helpers of ``profile_common.py``.

No tokenizer is loaded: prompt lengths are the token counts the profile asks for (inference-perf
and GuideLLM generate text that tokenizes to exactly that many tokens).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from servesim.simulator.errors import ConfigError
from servesim.workloads.profile_aiperf import _aiperf
from servesim.workloads.profile_common import ProfileSpec
from servesim.workloads.profile_guidellm import _guidellm
from servesim.workloads.profile_inference_perf import _inference_perf
from servesim.workloads.schema import RequestSpec

FORMATS = ("inference-perf", "guidellm", "aiperf", "genai-perf")


# ---------------------------------------------------------------------------------------------
# Reading and detection


def load_document(path: str | Path) -> Any:
    """A profile file (YAML or JSON) as Python data; one-line ConfigError on bad input."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such profile file")
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: invalid UTF-8 bytes: expected a UTF-8 text file") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the file ({e.strerror or e})") from None
    try:
        if p.suffix.lower() == ".json":
            return json.loads(text)
        return yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                          "nested too deeply") from None
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


# ---------------------------------------------------------------------------------------------
# The workload


def profile_workload(cfg, *, block_size: int, max_model_len: int | None, meta: dict,
                     limit: Callable):
    """``build_workload`` for ``kind: profile``: a staged Workload of the profile's requests.

    ``cfg.stages`` / ``cfg.warmup`` / ``cfg.max_concurrency`` (when set) replace the profile's;
    ``meta`` gains ``stages`` (the plan), ``warmup``, ``client`` (request_timeout_s, ...) and
    ``profile_format``."""
    from servesim.workloads import Workload, set_stage_meta
    from servesim.workloads.stages import StageControl, check_plan, stage_plan, staged_requests

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
    warm = cfg.warmup.model_dump(exclude_none=True) if cfg.warmup is not None else spec.warmup
    try:
        check_plan(plan, warm)
    except ValueError as e:
        raise ConfigError(f"{cfg.path}: {spec.format} profile: {e}") from None
    set_stage_meta(meta, plan)
    meta["dataset_name"] = spec.format
    meta["profile_format"] = spec.format
    meta["client"] = dict(spec.client)
    mc = cfg.max_concurrency if cfg.max_concurrency is not None else spec.max_concurrency
    if mc is not None and meta.get("max_concurrency") is None:
        meta["max_concurrency"] = mc
    meta["client_max_concurrency"] = mc
    if warm:
        meta["warmup"] = warm
    seed = cfg.seed

    def factory(meta: dict) -> Iterator[RequestSpec]:
        ctl = StageControl()
        meta["_stage_control"] = ctl
        return staged_requests(plan, seed, lambda k: spec.source(k, block_size), ctl)

    return Workload(limit(factory), meta)
