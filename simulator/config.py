"""Experiment configuration: YAML → validated, resolved :class:`ExperimentConfig`.

Sections and field names follow vLLM's own config (``VllmConfig``): ``model``, ``hardware``,
``parallel``, ``cache``, ``scheduler``, ``compilation``, ``workload``, ``slo``, ``output``,
``client`` (benchmark-client behaviour: request timeouts and retries).
Every section forbids unknown keys. ``--set a.b=value`` overrides are applied to the YAML tree
*before* validation, so they are typed by the schema and may switch ``workload.kind``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator
from servesim.costmodels.config import (
    AUTO_MAX_MODEL_LEN,
    Bytes,
    HardwareConfig,
    HumanInt,
    ModelConfig,
)
from servesim.simulator.cluster.config import MAX_ENGINES, ClusterConfig, KVOffloadConfig
from servesim.simulator.errors import ConfigError, one_line, path_is_file, short_repr
from servesim.simulator.lora import LoRAConfig
from servesim.simulator.spec_decode import SpeculativeConfig
from servesim.workloads.config import RandomWorkload, WorkloadConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ParallelConfig(_Section):
    tensor_parallel_size: PositiveInt = 1
    pipeline_parallel_size: PositiveInt = 1
    data_parallel_size: int = Field(1, ge=1, le=MAX_ENGINES)


# Keys added after configs were first hashed, left out of dumps (and so of the config hash)
# while at these values (their defaults), per section ("" = top level); ``dump_tree`` and the
# cluster groups' resolved sections read it.
OMITTED_AT_DEFAULT: dict[str, dict[str, Any]] = {
    "": {"optimization_level": 2, "performance_mode": "balanced", "cpu_offload_gb": 0.0},
    "cache": {"kv_offload": None, "kv_cache_memory_bytes": None,
              "memory_profiler_estimate_cudagraphs": True},
    "scheduler": {"max_num_partial_prefills": 1, "max_long_partial_prefills": 1,
                  "stream_interval": 1},
    "frontend": {"stream_chunk_s": None},
    "output": {"metadata": {}},
}


def omit_defaults(section: dict, name: str) -> dict:
    """``section`` (a dump of config section ``name``) without the keys of
    :data:`OMITTED_AT_DEFAULT` that hold their default (in place; returned)."""
    for k, v in OMITTED_AT_DEFAULT.get(name, {}).items():
        if k in section and section[k] == v:
            del section[k]
    return section


class CacheConfig(_Section):
    block_size: PositiveInt | None = Field(
        None, description="Tokens per KV block; null = vLLM's: 16, or what an MLA model's "
        "attention backend takes (32 on Blackwell, 64 on Hopper with an fp8 KV cache; "
        "costmodels.engine_defaults.kv_block_size)")
    gpu_memory_utilization: float = Field(
        0.92, gt=0, le=1, description="vLLM --gpu-memory-utilization (0.92: vLLM 0.22.1's default; "
        "older releases: 0.9)")
    enable_prefix_caching: bool = True
    cache_dtype: Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="vLLM --kv-cache-dtype: auto (the model's dtype), float16 and "
        "bfloat16 (2 bytes), fp8 / fp8_e4m3 / fp8_e5m2 (1 byte)")
    num_gpu_blocks_override: PositiveInt | None = None
    kv_cache_memory_bytes: Bytes | None = Field(
        None, ge=1, le=2**63 - 1, description="vLLM --kv-cache-memory-bytes: KV cache per GPU "
        "(bytes, '16G' = 16 GiB, '16g' = 16e9, or '16GiB'), instead of what "
        "gpu_memory_utilization leaves")
    memory_profiler_estimate_cudagraphs: bool = Field(
        True, description="vLLM's VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS (1 by default since "
        "vLLM 0.21): the profiler's CUDA-graph memory estimate comes out of the KV budget; "
        "false (=0): the graphs live in the (1 - gpu_memory_utilization) headroom")
    allocator: str = Field("paged", description="KV allocator policy (registry name)")
    kv_offload: KVOffloadConfig | None = Field(
        None, description="CPU KV-offload tier (vLLM OffloadingConnector); omitted when null")


class SchedulerConfig(_Section):
    policy: str = Field("fcfs", description="fcfs | priority | any registered policy")
    max_num_seqs: PositiveInt | None = Field(
        None, description="Default as vLLM picks it: 1024 on >=70 GiB non-A100 GPUs, else 256"
    )
    max_num_batched_tokens: HumanInt | None = Field(
        None, ge=1,
        description="Per-step token budget ('16k' = 16,000, '16K' = 16,384); default 8192 on "
        ">=70 GiB non-A100 GPUs, else 2048")
    long_prefill_token_threshold: int = Field(0, ge=0)
    max_num_partial_prefills: PositiveInt = Field(
        1, description="vLLM --max-num-partial-prefills: only 1 (vLLM 0.22.1 refuses others)")
    max_long_partial_prefills: PositiveInt = Field(
        1, description="vLLM --max-long-partial-prefills: only 1 (vLLM 0.22.1 refuses others)")
    enable_chunked_prefill: bool = True
    async_scheduling: bool | None = Field(
        None, description="vLLM's async scheduling (two batches in flight, host work hidden "
        "behind the GPU); null = on, as vLLM resolves it for generation models"
    )
    reserve_full_isl: bool = Field(
        True, description="vLLM scheduler_reserve_full_isl: admit a request only when free KV "
        "blocks cover its whole prompt, not only its first chunk"
    )
    stream_interval: PositiveInt = Field(
        1, description="vLLM --stream-interval: the API server sends a request's tokens every "
        "N tokens (its first token and its last at once); the client's ITL is per chunk"
    )


class CompilationConfig(_Section):
    cudagraph_mode: Literal[
        "NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"
    ] | None = Field(
        None, description="null = as optimization_level sets it (FULL_AND_PIECEWISE at -O2, "
        "vLLM's default; PIECEWISE at -O1; NONE at -O0)")
    max_cudagraph_capture_size: int | None = Field(
        None, ge=0, description="Default min(2*max_num_seqs*(1+k), 512, max_num_batched_tokens); "
        "0 when no CUDA graph is used (cudagraph_mode NONE, enforce_eager), as vLLM resolves it")
    cudagraph_capture_sizes: list[PositiveInt] | None = None


class FrontendConfig(_Section):
    """``frontend``: the API-server processes in front of the engine (simulator/frontend.py).

    The costs default to the calibration file's ``frontend:`` section (``simulate fit``
    writes it), else to documented priors; a value here overrides both."""

    enable: bool = Field(True, description="Model the API server (false: the client talks "
                         "to the engine core directly, TTFT = engine-side TTFT)")
    api_server_count: int | None = Field(
        None, ge=1, le=MAX_ENGINES,
        description="vLLM --api-server-count; default data_parallel_size, as vLLM")
    request_s: float | None = Field(None, ge=0, description="asyncio-thread CPU per request, s")
    tokenize_per_token_s: float | None = Field(None, ge=0, description="per prompt token, s")
    ipc_s: float | None = Field(None, ge=0, description="one-way API server <-> engine hop, s")
    detokenize_per_token_s: float | None = Field(
        None, ge=0, description="detokenize + SSE per output token, s")
    stream_chunk_s: float | None = Field(
        None, ge=0, description="the SSE-chunk share of detokenize_per_token_s, s: paid per "
        "chunk, not per token, when scheduler.stream_interval > 1")
    tokenizer_batch_wait_s: float | None = Field(
        None, ge=0, description="tokenizer micro-batch window, s (vLLM: 0.002)")
    tokenizer_max_batch: PositiveInt | None = Field(
        None, description="prompts per tokenizer call (vLLM: 32)")


class SLOConfig(_Section):
    """Per-request SLOs for goodput, as ``vllm bench serve --goodput ttft:MS tpot:MS e2el:MS``."""

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)
    e2el_ms: float | None = Field(None, gt=0)


class ClientConfig(_Section):
    """How the benchmark client treats a slow server (``simulator/client.py``).

    ``request_timeout_s``: a request still unfinished this long after it was sent is given up
    by the client and aborted in the engine (vLLM's abort path: removed from the queues, its
    KV blocks freed); it counts as failed with ``finished_reason`` ``timeout``. With
    ``max_retries`` > 0 it is sent again (a fresh request) up to that many times first.
    Unset keys take the value a ``kind: profile`` workload's profile gives, else none."""

    request_timeout_s: float | None = Field(None, gt=0, description="Client timeout per attempt, s")
    max_retries: int | None = Field(None, ge=0, le=100, description="Re-sends after a timeout")


PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")  # vllm bench --percentile-metrics


class OutputConfig(_Section):
    percentile_metrics: str = Field(
        "ttft,tpot,itl,e2el", description="vllm bench --percentile-metrics"
    )
    metric_percentiles: str = Field("99", description="vllm bench --metric-percentiles")
    save_detailed: bool = Field(False, description="vllm bench --save-detailed arrays")
    timeseries_interval_s: float | None = Field(
        None, ge=1e-6, le=1e8, description="Sample timeseries.csv every N s, 1 µs to 1e8 s "
        "(default: every engine step, or 1 s for runs of more than 200k steps)"
    )
    label: str | None = None
    metadata: dict[str, str] = Field(
        default_factory=dict, description="vllm bench --metadata KEY=VALUE: string keys "
        "written into result.json right after num_prompts")

    @field_validator("percentile_metrics", mode="before")
    @classmethod
    def _percentile_metrics(cls, v):
        """vllm bench --percentile-metrics: a comma list of ttft, tpot, itl, e2el (vLLM
        ignores other names silently; a typo here would drop a metric)."""
        if not isinstance(v, str):
            return v
        names = [x.strip() for x in v.split(",")]
        bad = [x for x in names if x not in PERCENTILE_METRICS]
        if bad or not names:
            raise ValueError(f"expected a comma list of {', '.join(PERCENTILE_METRICS)}")
        return ",".join(names)

    @field_validator("metric_percentiles", mode="before")
    @classmethod
    def _metric_percentiles(cls, v):
        """vllm bench --metric-percentiles: a comma list of percentiles in [0, 100] (YAML
        numbers and lists are taken too: 99, [50, 99])."""
        if isinstance(v, bool):
            return v
        items = v if isinstance(v, list) else str(v).split(",") if isinstance(
            v, (str, int, float)) else None
        if items is None:
            return v
        out = []
        for x in items:
            try:
                p = float(str(x).strip())
            except ValueError:
                p = math.nan
            if not 0 <= p <= 100:  # (NaN fails too)
                raise ValueError("expected a comma list of percentiles from 0 to 100")
            out.append(f"{p:g}")
        return ",".join(out)

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata(cls, v):
        """vLLM splits each KEY=VALUE at its first '=' and strips both sides: strings."""
        if not isinstance(v, dict):
            return v
        out = {}
        for k, x in v.items():
            if isinstance(x, (dict, list)) or x is None:
                raise ValueError(f"{k}: expected a single value (vLLM writes it as a string)")
            key = str(k).strip()
            if not key:
                raise ValueError("expected non-empty keys")
            out[key] = str(x).lower() if isinstance(x, bool) else str(x).strip()
        return out


class ExperimentConfig(_Section):
    model: ModelConfig = ModelConfig()
    hardware: HardwareConfig = HardwareConfig()
    parallel: ParallelConfig = ParallelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    compilation: CompilationConfig = CompilationConfig()
    # VllmConfig-level engine flags: -O / --optimization-level, --performance-mode
    optimization_level: int = Field(
        2, ge=0, le=3, description="vLLM -O: 0 no compilation and no CUDA graphs, 1 piecewise "
        "graphs, 2 (default) and 3 full and piecewise graphs (when cudagraph_mode is unset)")
    performance_mode: Literal["balanced", "interactivity", "throughput"] = Field(
        "balanced", description="vLLM --performance-mode: throughput doubles the default "
        "max_num_seqs and max_num_batched_tokens; interactivity captures every CUDA-graph "
        "size from 1 to 32")
    cpu_offload_gb: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="vLLM --cpu-offload-gb: GiB of "
        "decoder-layer weights per GPU kept in pinned CPU memory (UVA) and read over the host "
        "link (hardware.pcie_bw_gbps) in every forward pass, from the first layer on")
    # vLLM's speculative_config (None: off) and LoRAConfig: simulator/spec_decode.py, lora.py
    speculative_config: SpeculativeConfig | None = None
    lora: LoRAConfig = LoRAConfig()
    frontend: FrontendConfig = FrontendConfig()
    workload: WorkloadConfig = RandomWorkload()
    slo: SLOConfig = SLOConfig()
    output: OutputConfig = OutputConfig()
    client: ClientConfig = ClientConfig()
    # Several instances behind a router, P/D disaggregation (simulator/cluster/); omitted from
    # dumps and the hash when null, so single-engine configs keep their hash and files.
    cluster: ClusterConfig | None = None

    def dump_tree(self, mode: str = "python") -> dict:
        """``model_dump`` without the optional extension keys while unused (``cluster``, a
        default ``client``, null ``workload.stages``/``warmup``, ``speculative_config``,
        ``lora`` with ``enable_lora: false``, the keys of :data:`OMITTED_AT_DEFAULT` at their
        defaults): a config that does not use them dumps and hashes as before they existed."""
        d = self.model_dump(mode=mode)
        omit_defaults(d, "")
        for name in ("cache", "scheduler", "frontend", "output"):
            omit_defaults(d[name], name)
        if d.get("cluster") is None:
            d.pop("cluster", None)
        if d.get("client") == ClientConfig().model_dump(mode=mode):
            d.pop("client")
        if d.get("speculative_config", 0) is None:
            d.pop("speculative_config")
        if not d.get("lora", {}).get("enable_lora", True):
            d.pop("lora")
        wl = d.get("workload") or {}
        for k in ("stages", "warmup"):
            if k in wl and wl[k] is None:
                wl.pop(k)
        return d

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of the resolved config (first 16 hex digits)."""
        blob = json.dumps(self.dump_tree(mode="json"), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_yaml(self) -> str:
        return yaml.safe_dump(_jsonable(self.dump_tree(mode="python")), sort_keys=False)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return x


# ---------------------------------------------------------------------------------------------
# Loading


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"scheduler.max_num_seqs=128"`` → (["scheduler", "max_num_seqs"], 128).

    The value is parsed as YAML (so ``true``, ``1e3``, ``[1, 2]`` work); the schema types it.
    """
    if "=" not in item:
        raise ConfigError(f"--set {one_line(item, 80)}: expected section.key=value")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"--set {one_line(item, 80)}: expected section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except (yaml.YAMLError, RecursionError):
        value = raw
    if _expanded_size(value, MAX_YAML_VALUES) > MAX_YAML_VALUES:
        raise ConfigError(f"--set {one_line(key, 80)}: more than {MAX_YAML_VALUES:,} values "
                          "once YAML aliases are expanded")
    return path, value


def set_path(tree: dict, key: str | list[str], value: Any, *, where: str = "") -> None:
    """Set ``section.key`` in a raw config tree (in place), creating sections as needed.

    Switching ``workload.kind`` (e.g. from the file's ``random`` to ``trace``) starts the
    workload section afresh (keeping only ``seed``): the old kind's keys mean nothing to the new.
    """
    path = [p for p in key.split(".") if p] if isinstance(key, str) else list(key)
    where = where or ".".join(path)
    if path == ["workload", "kind"]:
        old = tree.get("workload") if isinstance(tree.get("workload"), dict) else {}
        if old.get("kind", "random") != value:
            tree["workload"] = {k: v for k, v in old.items() if k == "seed"}
    node = tree
    for p in path[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        elif not isinstance(nxt, dict):
            raise ConfigError(f"{where}: {p} is not a section")
        node = nxt
    node[path[-1]] = copy.deepcopy(value)


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply ``--set`` items to (a copy of) a raw YAML tree."""
    tree = copy.deepcopy(tree)
    for item in overrides:
        path, value = parse_override(item)
        set_path(tree, path, value, where=f"--set {one_line(item, 80)}")
    return tree


def _error_path(err: dict) -> str:
    """An error's key path, without the branch names pydantic puts in the path of a plain
    union (a class or a constrained type)."""
    return ".".join(str(p) for p in err["loc"]
                    if not (isinstance(p, str) and (p[:1].isupper() or "-" in p)))


def _describe_error(err: dict) -> str:
    loc = _error_path(err)
    for kind in ("random", "trace", "synthetic", "sessions", "profile"):  # drop the union tag from paths
        loc = loc.replace(f"workload.{kind}.", "workload.")
        if loc == f"workload.{kind}":
            loc = "workload"
    typ = err["type"]
    inp = err.get("input")
    if typ == "extra_forbidden":
        return f"{loc}: unknown key (not a field of this section)"
    if typ == "missing":
        return f"{loc}: required field is missing"
    if typ == "union_tag_invalid":
        ctx = err.get("ctx", {})
        return (f"{loc}.{ctx.get('discriminator', 'kind').strip(chr(39))}: "
                f"{short_repr(ctx.get('tag'))} is not one of {ctx.get('expected_tags')}")
    msg = err["msg"]
    if typ == "value_error":  # our validators' own message: without pydantic's prefix
        msg = msg.removeprefix("Value error, ")
    msg = one_line(msg, 200)
    if typ == "value_error" and isinstance(inp, dict):  # a section's own check: its message
        return f"{loc}: {msg}"  # names the keys (the whole section is no useful "got")
    if typ.endswith(("_parsing", "_type")):
        return f"{loc}: {msg[0].lower() + msg[1:]}, got {short_repr(inp)}"
    return f"{loc}: {msg[0].lower() + msg[1:]} (got {short_repr(inp)})"


def validate_tree(tree: dict, source: str) -> ExperimentConfig:
    """Validate a raw YAML tree; raise :class:`ConfigError` naming file and key path."""
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    wl = tree.get("workload")
    if isinstance(wl, dict) and "kind" not in wl:
        tree = {**tree, "workload": {"kind": "random", **wl}}
    try:
        return ExperimentConfig.model_validate(tree)
    except ValidationError as e:
        errors = e.errors()
        # a value that fits one branch of a union in type but not in range: say what is wrong
        # with it there, not that it is not of the other branches' types
        key = _error_path(errors[0])
        first = next((x for x in errors if x["type"] == "extra_forbidden"), None) or next(
            (x for x in errors if (_error_path(x) + ".").startswith(key + ".")
             and not x["type"].endswith(("_type", "_parsing"))), errors[0])
        # (an unknown key first: a misspelt key also leaves the field it meant missing)
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ConfigError(f"{source}: {one_line(_describe_error(first), 400)}{more}") from None


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses duplicate keys in a mapping (YAML says keys are
    unique; PyYAML silently keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                dup = key in seen
            except TypeError:  # unhashable key: let PyYAML report it
                dup = False
            if dup:
                mark = key_node.start_mark
                raise ConfigError(
                    f"{self.name}:{mark.line + 1}:{mark.column + 1}: duplicate key "
                    f"{short_repr(key)} (first at line {seen[key] + 1}); each key may appear "
                    "once per section")
            if not dup:
                try:
                    seen[key] = key_node.start_mark.line
                except TypeError:
                    pass
        return super().construct_mapping(node, deep=deep)


MAX_YAML_VALUES = 1_000_000  # values of a config after expanding YAML aliases


def _expanded_size(tree: Any, limit: int) -> int:
    """Number of values in ``tree`` with aliases expanded, counted with memoisation (a
    billion-laughs alias bomb is measured in linear time); stops past ``limit``."""
    memo: dict[int, int] = {}

    def size(x: Any) -> int:
        if isinstance(x, (dict, list, tuple)):
            k = id(x)
            if k in memo:
                return memo[k]
            memo[k] = 0  # a recursive alias counts once
            items = list(x.keys()) + list(x.values()) if isinstance(x, dict) else x
            n = 1
            for v in items:
                n += size(v)
                if n > limit:
                    break
            memo[k] = n
            return n
        return 1

    return size(tree)


def load_yaml(path: str | Path) -> dict:
    """A config file as a dict: UTF-8 YAML with a mapping at the top; empty files, duplicate
    keys and alias bombs are one-line :class:`ConfigError` naming file and line."""
    p = Path(path)
    if not path_is_file(p):
        raise ConfigError(f"{p}: no such config file")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(f"{p}:{line}: invalid UTF-8 bytes (a config is UTF-8 text)") from None
    try:
        loader = _StrictLoader(text)
        loader.name = str(p)
        try:
            tree = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{p}{where}: invalid YAML: {one_line(problem)}") from None
    except RecursionError:
        raise ConfigError(f"{p}: YAML nested too deeply") from None
    if tree is None:
        raise ConfigError(f"{p}: empty config (expected sections such as model:, hardware:, "
                          "workload:)")
    if _expanded_size(tree, MAX_YAML_VALUES) > MAX_YAML_VALUES:
        raise ConfigError(f"{p}: more than {MAX_YAML_VALUES:,} values once YAML aliases are "
                          "expanded (an alias bomb?)")
    return tree


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load YAML (or defaults when ``path`` is None), apply ``--set`` overrides, validate."""
    tree = load_yaml(path) if path is not None else {}
    source = str(path) if path is not None else "<defaults>"
    if overrides:
        tree = apply_overrides(tree, overrides)
        source += " (with --set overrides)"
    return validate_tree(tree, source)


# ---------------------------------------------------------------------------------------------
# Resolution: vLLM's hardware- and model-dependent defaults


def _scheduled_token_budget(c: ExperimentConfig) -> int:
    """The scheduler's token budget (vLLM ``VllmConfig._set_max_num_scheduled_tokens``):
    max_num_batched_tokens less one drafting slot per seat for a draft model
    (``Scheduler.enable_spec_decode`` applies it); refused when nothing is left."""
    from servesim.costmodels.spec_decode import max_num_scheduled_tokens

    s, sc = c.scheduler, c.speculative_config
    budget = max_num_scheduled_tokens(sc.method if sc is not None else None,
                                      s.max_num_batched_tokens, s.max_num_seqs)
    if budget <= 0:
        raise ConfigError(
            f"scheduler.max_num_batched_tokens: max_num_scheduled_tokens is set to {budget} "
            "based on the speculative decoding settings, which does not allow any tokens to "
            "be scheduled. Increase max_num_batched_tokens to accommodate the additional "
            "draft token slots, or decrease num_speculative_tokens or max_num_seqs (vLLM)")
    return budget


def _check_stream_interval(c: ExperimentConfig) -> None:
    """``scheduler.stream_interval`` > 1 is the API server's (vLLM's output processor sends a
    request's tokens in chunks): it needs the frontend model, which cluster runs (and runs
    with a KV offload tier, which take the cluster engine) leave out."""
    intervals = [c.scheduler.stream_interval]
    if c.cluster is not None:
        intervals += [(g.scheduler or {}).get("stream_interval", 1) for g in c.cluster.instances]
    n = max(intervals)
    if n == 1:
        return
    what = cluster_engine(c)
    if what is not None:
        raise ConfigError(
            f"scheduler.stream_interval: {n}: {what} leave the API server out, and its "
            "output processor is what sends tokens in chunks (set 1)")
    if not c.frontend.enable:
        raise ConfigError(
            f"scheduler.stream_interval: {n} needs the API-server model (frontend.enable: "
            "true): its output processor is what sends tokens in chunks")


def cluster_engine(c) -> str | None:
    """How messages name the cluster engine ``c`` runs on (cluster runs, and runs with
    ``cache.kv_offload``); None: the single-engine path."""
    if getattr(c, "cluster", None) is not None:
        return "cluster runs"
    if c.cache.kv_offload is not None:
        return "runs with cache.kv_offload (the cluster engine)"
    return None


def check_cluster_engine_features(c, engine: str | None = None) -> None:
    """The cluster engine schedules without speculative decoding or multi-LoRA: refused, not
    silently dropped (the drafter's cost and memory would be charged without its tokens).
    ``engine``: :func:`cluster_engine` of the run (default: of ``c``; None: nothing to
    check)."""
    engine = engine or cluster_engine(c)
    if engine is None:
        return
    if getattr(c, "speculative_config", None) is not None:
        raise ConfigError(f"speculative_config: {engine} do not model speculative decoding "
                          "(the drafter's cost without its tokens would be wrong); leave it "
                          "out")
    if c.lora.enable_lora:
        raise ConfigError(f"lora.enable_lora: {engine} do not model multi-LoRA; leave it off")


def _check_partial_prefills(s: SchedulerConfig) -> None:
    """vLLM 0.22.1 ``EngineArgs._check_feature_supported``: any max_num_partial_prefills or
    max_long_partial_prefills other than 1 stops the engine at start-up ("Concurrent Partial
    Prefill is not supported"); its V1 scheduler has no concurrent partial prefills."""
    for key in ("max_num_partial_prefills", "max_long_partial_prefills"):
        if getattr(s, key) != 1:
            raise ConfigError(
                f"scheduler.{key}: {getattr(s, key)}: vLLM 0.22.1 refuses to start with it "
                "(Concurrent Partial Prefill is not supported; remove it, or cap each "
                "request's chunk with scheduler.long_prefill_token_threshold)")


def resolve_config(cfg: ExperimentConfig) -> ExperimentConfig:
    """Fill the defaults vLLM derives at start-up; return a new, fully concrete config.

    - ``model.max_model_len``: what vLLM derives from the config.json (``max_position_embeddings``
      and the other length keys, RoPE scaling: ``costmodels.specs.derive_max_len``); a
      larger value is refused, like vLLM without ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``.
    - ``scheduler.max_num_seqs`` / ``max_num_batched_tokens``: ``vllm serve`` defaults — 1024 /
      8192 on GPUs with >= 70 GiB that are not A100s (H100, H200, MI300X, B200), else 256 / 2048
      (ecosystem-formats.md §3), adjusted as vLLM's ``arg_utils`` does
      (:func:`~servesim.costmodels.engine_defaults.batch_limits`).
    - ``cache.block_size``: null → 16, or an MLA backend's preferred size
      (:func:`~servesim.costmodels.engine_defaults.kv_block_size`).
    - ``scheduler.async_scheduling``: null → true (vLLM ``VllmConfig``: on for generation
      models on the default executors).
    - ``compilation``: the CUDA-graph mode (unset: as ``optimization_level`` sets it; none at
      -O0) and the capture sizes and their maximum as vLLM computes them (with
      ``performance_mode``).
    """
    from servesim.costmodels import load_hardware_spec, load_model_spec
    from servesim.costmodels.engine_defaults import (
        batch_limits,
        cudagraph_mode,
        cudagraph_sizes,
        kv_block_size,
    )
    from servesim.costmodels.quant import check_checkpoint_quantization

    hw = load_hardware_spec(cfg.hardware)
    spec = load_model_spec(cfg.model)
    check_checkpoint_quantization(cfg.model, spec)
    c = cfg.model_copy(deep=True)
    lim = spec.max_len
    auto = c.model.max_model_len == AUTO_MAX_MODEL_LEN
    if c.model.max_model_len is None or auto:  # (auto: the derived length until the KV fit)
        c.model.max_model_len = lim.default
    else:
        lim.check(c.model.max_model_len, "model.max_model_len")
    if c.cache.block_size is None:
        c.cache.block_size = kv_block_size(spec, hw, c.cache.cache_dtype)
    s = c.scheduler
    s.max_num_seqs, s.max_num_batched_tokens = batch_limits(
        hw, s.max_num_seqs, s.max_num_batched_tokens, c.model.max_model_len,
        s.enable_chunked_prefill, c.performance_mode)
    _resolve_spec_decode_and_lora(c)
    _check_partial_prefills(s)
    if s.async_scheduling is None:
        s.async_scheduling = True
    if s.max_num_batched_tokens < s.max_num_seqs:
        raise ConfigError(
            f"scheduler.max_num_batched_tokens ({s.max_num_batched_tokens}) must be greater "
            f"than or equal to max_num_seqs ({s.max_num_seqs})")
    budget = _scheduled_token_budget(c)
    if not s.enable_chunked_prefill and budget < c.model.max_model_len:
        drafts = (f" less {s.max_num_batched_tokens - budget} draft-model drafting slots"
                  if budget < s.max_num_batched_tokens else "")
        raise ConfigError(
            f"scheduler.max_num_batched_tokens ({s.max_num_batched_tokens}{drafts}) is smaller "
            f"than max_model_len ({c.model.max_model_len}) while enable_chunked_prefill is "
            "false: a long prompt could never be scheduled")
    heads = spec.num_attention_heads
    tp = c.parallel.tensor_parallel_size
    if heads % tp:
        raise ConfigError(
            f"parallel.tensor_parallel_size: {tp} does not divide the model's "
            f"num_attention_heads ({heads})")
    if spec.num_hidden_layers < c.parallel.pipeline_parallel_size:
        raise ConfigError(
            f"parallel.pipeline_parallel_size: {c.parallel.pipeline_parallel_size} is larger "
            f"than the number of layers ({spec.num_hidden_layers})")
    comp = c.compilation
    comp.cudagraph_mode = cudagraph_mode(comp.cudagraph_mode, c.optimization_level)
    if comp.cudagraph_mode != "NONE" and not c.model.enforce_eager:
        # VllmConfig._set_cudagraph_sizes (checks on the sizes before the spec-decode rounding
        # that the model runner applies later)
        if comp.max_cudagraph_capture_size == 0:
            raise ConfigError(
                "compilation.max_cudagraph_capture_size: Maximum cudagraph size should be "
                "greater than or equal to 1 when using cuda graph (vLLM)")
        if comp.cudagraph_capture_sizes is not None and not comp.cudagraph_capture_sizes:
            raise ConfigError(
                "compilation.cudagraph_capture_sizes: cudagraph_capture_sizes should contain "
                "at least one element when using cuda graph (vLLM)")
        sizes = cudagraph_sizes(c, s.max_num_seqs, s.max_num_batched_tokens)
        if comp.cudagraph_capture_sizes is not None and comp.max_cudagraph_capture_size is not None:
            valid = cudagraph_sizes(c, s.max_num_seqs, s.max_num_batched_tokens,
                                    spec_rounding=False)
            if comp.max_cudagraph_capture_size != (valid[-1] if valid else 0):
                raise ConfigError(
                    f"compilation.max_cudagraph_capture_size ({comp.max_cudagraph_capture_size}) "
                    "should be consistent with the max value of cudagraph_capture_sizes "
                    f"({valid[-1] if valid else 0})")
        comp.cudagraph_capture_sizes = sizes
        comp.max_cudagraph_capture_size = sizes[-1] if sizes else 0
    else:  # vLLM _set_cudagraph_sizes: no CUDA graph in use (--enforce-eager: mode NONE too)
        if c.model.enforce_eager:
            comp.cudagraph_mode = "NONE"
        comp.max_cudagraph_capture_size = 0
        comp.cudagraph_capture_sizes = []
    if c.cluster is not None:  # each instance group with vLLM's defaults for its own GPU
        from servesim.simulator.cluster.config import resolve_cluster

        resolve_cluster(cfg, c)
        if auto:  # each group fitted its own length (equal in every group): the top-level
            # section need not run on its own GPU
            c.model._auto_fit_from = c.model.max_model_len
            c.model.max_model_len = c.cluster.instances[0].model.max_model_len
    elif auto:  # vLLM get_kv_cache_configs → _auto_fit_max_model_len, after memory profiling
        from servesim.costmodels.memory import plan_memory_for

        c.model._auto_fit_from = c.model.max_model_len
        c.model.max_model_len = plan_memory_for(
            c, spec, hw, fit_from=c.model.max_model_len).max_model_len
    prefix_len = getattr(c.workload, "prefix_len", 0)
    if prefix_len > c.model.max_model_len:
        raise ConfigError(
            f"workload.prefix_len: {prefix_len} is longer than model.max_model_len "
            f"({c.model.max_model_len}): vLLM would refuse every prompt")
    if c.frontend.api_server_count is None:  # vLLM: internal DP load balancing
        c.frontend.api_server_count = c.parallel.data_parallel_size
    _check_stream_interval(c)
    check_cluster_engine_features(c)
    dp = c.parallel.data_parallel_size
    if spec.num_experts > 1 and dp > 1:
        import warnings

        warnings.warn(
            f"{spec.name} is a mixture-of-experts model: at data_parallel_size {dp} vLLM shards "
            f"its experts over all DP x TP = {dp * tp} GPUs and steps the DP ranks in lockstep "
            "(idle ranks run dummy batches); servesim runs the DP ranks as independent engines "
            f"with the experts sharded over TP = {tp} only, so its memory plan and step times "
            "for this config are approximate", stacklevel=2)
    return c


def _resolve_spec_decode_and_lora(c: ExperimentConfig) -> None:
    """vLLM's start-up rules for ``speculative_config`` and ``lora`` (in place):

    - ``scheduler.async_scheduling`` (``VllmConfig.__post_init__``): null stays on only for
      EAGLE/EAGLE-3/MTP and ``ngram_gpu`` and turns off (with vLLM's warning) for other
      methods; explicitly true is refused for methods other than those and ``draft_model``.
    - ``draft_model`` needs ``draft_tensor_parallel_size`` equal to the target's TP.
    - pipeline parallelism with speculative decoding is not modelled (refused).
    - LoRA with speculative decoding needs max_num_batched_tokens ≥ max_num_seqs · (k + 1).
    - ``lora.max_cpu_loras``: null → ``max_loras``.
    """
    import warnings

    from servesim.costmodels.spec_decode import ASYNC_ALLOWED_METHODS, ASYNC_DEFAULT_METHODS

    sc, s = c.speculative_config, c.scheduler
    if sc is not None:
        m = sc.method
        if c.parallel.pipeline_parallel_size > 1:
            raise ConfigError("speculative_config: speculative decoding with "
                              "pipeline_parallel_size > 1 is not modelled")
        if s.async_scheduling is None and m not in ASYNC_DEFAULT_METHODS:
            warnings.warn(f"Async scheduling not supported with {m}-based speculative "
                          "decoding and will be disabled (vLLM).", stacklevel=3)
            s.async_scheduling = False
        elif s.async_scheduling and m not in ASYNC_ALLOWED_METHODS:
            raise ConfigError(
                "scheduler.async_scheduling: Currently, async scheduling is only supported "
                f"with EAGLE/MTP/Draft Model/NGram GPU kind of speculative decoding, not "
                f"{m} (vLLM)")
        tp = c.parallel.tensor_parallel_size
        if (m == "draft_model" and sc.draft_tensor_parallel_size is not None
                and sc.draft_tensor_parallel_size != tp):
            raise ConfigError(
                f"speculative_config.draft_tensor_parallel_size: Currently, "
                f"'draft_tensor_parallel_size' and 'tensor_parallel_size' must be the same. "
                f"Got {sc.draft_tensor_parallel_size} and {tp}.")
    lc = c.lora
    if (lc.enable_lora and sc is not None
            and s.max_num_batched_tokens < s.max_num_seqs * (sc.num_speculative_tokens + 1)):
        raise ConfigError(  # (EngineArgs.create_engine_config)
            f"scheduler.max_num_batched_tokens: {s.max_num_batched_tokens} < max_num_seqs "
            f"({s.max_num_seqs}) x (num_speculative_tokens + 1) with LoRA and speculative "
            "decoding: consider increasing max_num_batched_tokens or decreasing "
            "num_speculative_tokens (vLLM)")
    if lc.enable_lora and lc.max_cpu_loras is None:
        lc.max_cpu_loras = lc.max_loras
