"""The plan file (``configs/plans/*.yaml``) and the candidates its search space expands to.

A plan names a base experiment config, the traffic, the SLOs, the target request rate and a
search space: axis → values, where an axis is a config key path or an alias (``hardware``,
``tp``, ``max_num_seqs`` ...). Every combination is a *candidate* deployment, named for people
and folders (``h100-sxm_tp2``).
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    StrictInt,
    field_validator,
    model_validator,
)
from servesim.simulator.errors import ConfigError

# ---------------------------------------------------------------------------------------------
# Plan file schema


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PlanSLO(_Section):
    """Per-request SLO thresholds (ms) and how many requests must meet them.

    A rate *meets the SLO* when, for every threshold given, the ``percentile``-th percentile of
    that metric over the requests is ≤ the threshold, and (when ``min_goodput_pct`` is given)
    at least that percentage of all requests meet every threshold at once (vLLM's
    ``--goodput`` definition; TPOT of 1-token requests counts as 0).
    """

    ttft_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    tpot_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    e2el_ms: float | None = Field(None, gt=0, allow_inf_nan=False)
    percentile: float = Field(99.0, gt=0, le=100)
    min_goodput_pct: float | None = Field(None, gt=0, le=100)
    max_queue_growth: float | None = Field(
        0.1, gt=0, description="Stability: requests in the system may grow by at most this "
        "fraction of the arrivals over the second half of the arrival window (None: no check)")

    def describe(self) -> str:
        p = fmt_pct(self.percentile)
        parts = [f"P{p} {name.upper()} ≤ {fmt_num(v)} ms"
                 for name, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms),
                                 ("e2el", self.e2el_ms)) if v is not None]
        if self.min_goodput_pct is not None:
            parts.append(f"goodput ≥ {fmt_num(self.min_goodput_pct)}%")
        return ", ".join(parts) or "no SLO"


class PlanTolerance(_Section):
    rel_width: float = Field(0.05, gt=0, lt=1,
                             description="Stop bisecting when (hi - lo) / hi ≤ this")
    max_evals: PositiveInt = Field(14, description="Simulations per (candidate, seed) at most")
    first_guess_rps: float | None = Field(
        None, gt=0, allow_inf_nan=False,
        description="Start of the bracketing (default: an analytic roofline guess)")
    min_rps: float = Field(0.01, gt=0, allow_inf_nan=False,
                           description="Below this the SLO is deemed unreachable")
    max_rps: float = Field(1e5, gt=0, allow_inf_nan=False, description="Stop doubling above this")

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_rps >= self.max_rps:
            raise ValueError(f"min_rps {self.min_rps:g} must be below max_rps {self.max_rps:g}")
        return self


AXIS_ALIASES = {
    "hardware": "hardware.name",
    "gpu": "hardware.name",
    "tensor_parallel_size": "parallel.tensor_parallel_size",
    "tp": "parallel.tensor_parallel_size",
    "pipeline_parallel_size": "parallel.pipeline_parallel_size",
    "pp": "parallel.pipeline_parallel_size",
    "max_num_seqs": "scheduler.max_num_seqs",
    "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "policy": "scheduler.policy",
    "scheduler_policy": "scheduler.policy",
    "enable_prefix_caching": "cache.enable_prefix_caching",
    "gpu_memory_utilization": "cache.gpu_memory_utilization",
    "cache_dtype": "cache.cache_dtype",
    "quantization": "model.quantization",
    "async_scheduling": "scheduler.async_scheduling",
    # cluster shapes (simulator/cluster/): a whole ``cluster:`` section per value, named by
    # its ``name``; or the router policy of the base's cluster
    "cluster": "cluster",
    "router": "cluster.router.policy",
}

AXIS_SHORT = {
    "hardware.name": "", "parallel.tensor_parallel_size": "tp",
    "parallel.pipeline_parallel_size": "pp", "scheduler.max_num_seqs": "mns", "model.name": "",
    "scheduler.max_num_batched_tokens": "mbt", "scheduler.policy": "", "cluster": "",
    "cluster.router.policy": "",
}


class PlanSpec(_Section):
    """A capacity plan (``configs/plans/*.yaml``)."""

    name: str = "plan"
    base: str | dict | None = Field(
        None, description="Experiment config: a path (relative to the plan file) or a mapping")
    set: list[str] = Field(default_factory=list, description="--set overrides on the base")
    workload: dict | None = Field(None, description="Replaces the base's workload section")
    slo: PlanSLO
    target_request_rate: float = Field(gt=0, allow_inf_nan=False,
                                       description="Total traffic to serve, req/s")
    search: dict[str, list[Any]] = Field(
        default_factory=dict,
        description="Axis → values; axes are config key paths or aliases (hardware, "
        "tensor_parallel_size, pipeline_parallel_size, max_num_seqs, max_num_batched_tokens, "
        "policy ...). null keeps the base / vLLM default.")
    seeds: list[StrictInt] = Field(default_factory=lambda: [0, 1, 2])
    tolerance: PlanTolerance = PlanTolerance()
    min_duration_s: float | None = Field(
        60.0, gt=0, allow_inf_nan=False, description="Raise num_prompts (num_sessions) to rate × this, so every "
        "point offers a sustained load and not a short burst (random/synthetic/sessions)")
    max_prompts: PositiveInt = Field(20000, description="Cap of that raise")
    confirm: bool = Field(True, description="Simulate each candidate at its operating point")
    max_added_replicas: NonNegativeInt = Field(
        2, description="When the simulated operating point misses an SLO, add up to this many "
        "replicas beyond ceil(target / capacity), re-simulating each; still missing: the "
        "candidate does not fit")
    knee_warn: float = Field(0.85, gt=0, le=1,
                             description="Warn when operating rate / capacity exceeds this")
    prices: str | None = Field(None, description="Price file (default configs/prices.yaml)")

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v):
        if not v:
            raise ValueError("at least one seed is needed")
        for i, s in enumerate(v):
            if s < 0:
                raise ValueError(f"[{i}]: expected an integer >= 0, got {s}")
        if len(set(v)) != len(v):
            raise ValueError(f"duplicate seeds in {v}")
        return v

    @field_validator("search")
    @classmethod
    def _search(cls, v):
        seen: dict[str, str] = {}
        for k, vals in v.items():
            if not vals:
                raise ValueError(f"{k}: expected a non-empty list of values")
            key = AXIS_ALIASES.get(k, k)
            if key in ("workload.request_rate", "workload.session_rate", "workload.seed"):
                raise ValueError(f"{k}: the planner sets it (the search rate, seeds:); "
                                 "it cannot be an axis")
            if key in seen:
                raise ValueError(f"{k}: the same axis as {seen[key]} ({key})")
            seen[key] = k
        return v

    def axes(self) -> dict[str, list[Any]]:
        return {AXIS_ALIASES.get(k, k): list(v) for k, v in self.search.items()}


def load_plan(path: str | Path) -> tuple[PlanSpec, Path]:
    """Read and validate a plan YAML; return it and the folder relative paths resolve from."""
    from pydantic import ValidationError
    from servesim.simulator.config import load_yaml

    p = Path(path)
    tree = load_yaml(p)
    try:
        spec = PlanSpec.model_validate(tree)
    except ValidationError as e:
        err = e.errors()[0]
        loc = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"])[1:]
        msg = err["msg"].removeprefix("Value error, ")
        sep = "" if msg.startswith("[") or not loc else ": "
        raise ConfigError(f"{p}: {loc}{sep}{msg}") from None
    check_plan(spec, p.resolve().parent, str(p))
    return spec, p.resolve().parent


def check_plan(spec: PlanSpec, plan_dir: Path, source: str) -> None:
    """User errors fail up front, one line naming the plan file and key, before anything
    runs: the base config (``base`` + ``set`` + ``workload``) and every value of every search
    axis must be valid config (no unknown key), the files they read and the price file must
    exist. (What some candidates cannot run, e.g. a model larger than a GPU, skips those.)"""
    from servesim.simulator.config import validate_tree
    from servesim.simulator.errors import in_file
    from servesim.simulator.experiments.points import check_input_files
    from servesim.simulator.plan.cost import load_prices

    with in_file(source):
        tree = base_tree(spec, plan_dir)
    cfg = validate_tree(copy.deepcopy(tree), f"{source}: base/set/workload")
    check_input_files(cfg, source)
    for k, values in spec.search.items():
        for v in values:
            t = copy.deepcopy(tree)
            set_path(t, AXIS_ALIASES.get(k, k), v)
            validate_tree(t, f"{source}: search.{k}")
    with in_file(f"{source}: prices"):
        load_prices(prices_path(spec, plan_dir))


def prices_path(spec: PlanSpec, plan_dir: Path) -> Path | None:
    """The plan's price file (None: the shipped one); relative to the working directory when
    it is there, else to the plan file's folder."""
    if not spec.prices:
        return None
    q = Path(spec.prices)
    return q if q.is_absolute() or q.is_file() else plan_dir / q


# ---------------------------------------------------------------------------------------------
# Candidates


def fmt_num(v: float) -> str:
    return f"{v:g}"


def fmt_pct(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else f"{p:g}"


def set_path(tree: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in a raw config tree, creating sections; None removes the key (the base
    config's or vLLM's default applies)."""
    node = tree
    parts = dotted.split(".")
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = node[p] = {}
        node = nxt
    if value is None:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value


def get_path(tree: dict, dotted: str, default: Any = None) -> Any:
    """``a.b.c`` of a raw config tree, or ``default``."""
    node: Any = tree
    for p in dotted.split("."):
        if not isinstance(node, dict) or p not in node:
            return default
        node = node[p]
    return node


def candidate_name(assign: dict[str, Any]) -> str:
    """Short, file-safe name: ``h100-sxm_tp1_pp1_mns256``; null values are omitted."""
    parts = []
    for k, v in assign.items():
        if v is None:
            continue
        if isinstance(v, dict) and v.get("name"):  # a cluster shape: its own name
            v, k = v["name"], "cluster"
        short = AXIS_SHORT.get(k, k.split(".")[-1])
        s = f"{short}{v}" if short else str(v)
        parts.append("".join(c if c.isalnum() or c in "-." else "-" for c in s))
    return "_".join(parts) or "base"


def base_tree(spec: PlanSpec, plan_dir: Path) -> dict:
    """The experiment config tree every candidate starts from (base + set + workload)."""
    from servesim.simulator.config import apply_overrides, load_yaml

    if spec.base is None:
        tree: dict = {}
    elif isinstance(spec.base, dict):
        tree = copy.deepcopy(spec.base)
    else:
        p = Path(spec.base)
        if not p.is_absolute():
            cands = [plan_dir / p, Path.cwd() / p]
            p = next((c for c in cands if c.is_file()), cands[0])
        tree = load_yaml(p)
    if spec.set:
        tree = apply_overrides(tree, spec.set)
    if spec.workload is not None:
        tree["workload"] = copy.deepcopy(spec.workload)
    set_path(tree, "parallel.data_parallel_size", 1)  # capacity is per replica
    # plan SLO → config SLO (so result.json carries request_goodput)
    slo = {k: getattr(spec.slo, k) for k in ("ttft_ms", "tpot_ms", "e2el_ms")
           if getattr(spec.slo, k) is not None}
    if slo:
        tree["slo"] = {**(tree.get("slo") or {}), **slo}
    return tree


def expand_candidates(spec: PlanSpec, tree: dict) -> list[tuple[str, dict[str, Any], dict]]:
    """Cartesian product of the search axes → [(name, assignment, config tree)]."""
    axes = spec.axes()
    keys = list(axes)
    out = []
    seen = set()
    for values in itertools.product(*(axes[k] for k in keys)) if keys else [()]:
        assign = dict(zip(keys, values))
        t = copy.deepcopy(tree)
        for k, v in assign.items():
            set_path(t, k, v)
        name = candidate_name(assign)
        while name in seen:
            name += "_"
        seen.add(name)
        out.append((name, assign, t))
    return out

