"""Parameter sweeps and A/B experiments: spec, point runner, ``vllm bench sweep`` layout, resume.

A sweep file (YAML)::

    base: ../llama8b_a100.yaml          # path (relative to this file, else cwd) or inline mapping
    experiment_name: ab_scheduler       # default: the sweep file's stem
    overrides: {workload.num_prompts: 200}             # applied to every point
    arms:                                              # name -> overrides (mapping or "k=v" list)
      fcfs: {scheduler.policy: fcfs}
      sarathi: [scheduler.policy=sarathi]
    grid: {scheduler.max_num_seqs: [64, 256]}          # Cartesian product (crossed with arms)
    seeds: [0, 1, 2]                                   # or num_seeds: 3  (-> 0, 1, 2)
    request_rates: [2, 4, inf]                         # sets workload.request_rate
    baseline: fcfs                                     # A/B baseline; default: the first arm
    profile_sweep: {sweep_size: 10, strategy: constant, max_concurrency: 512}   # GuideLLM sweep

``profile_sweep`` (instead of ``request_rates``) sweeps load the way GuideLLM's ``sweep``
profile does, per arm: a ``synchronous`` point (one request at a time: ``max_concurrency: 1``,
rate inf), a ``throughput`` point (rate inf, ``max_concurrency``), then ``sweep_size − 2``
points at the rates ``linspace(sync, throughput, sweep_size − 1)[1:]`` between the two
measured request throughputs (mean over seeds), ``constant`` (``burstiness: inf``) or
``poisson`` arrivals, capped at ``max_concurrency``. One point (folder) per rate:
``BENCH-synchronous``, ``BENCH-throughput``, ``BENCH-<rate>``.

Points = arms × rates × seeds. Every arm of a seed gets ``workload.seed = seed``, so all arms
replay the same request stream (common random numbers) and A/B differences are paired.
Override order: base ← ``overrides`` ← arm/grid ← rate ← seed.

Output (``vllm bench sweep`` layout)::

    DIR/<experiment_name>/SERVE-<arm>-BENCH-<rate>/run=<seed>.json      bench dict + extras
    DIR/<experiment_name>/SERVE-<arm>-BENCH-<rate>/run=<seed>.failure.json
    DIR/<experiment_name>/SERVE-<arm>-BENCH-<rate>/summary.json         list of runs
    DIR/<experiment_name>/summary.csv                                   one row per run
    DIR/<experiment_name>/ab.csv                                        paired A/B statistics
    DIR/<experiment_name>/experiment.json                               which sweep wrote it

A sweep is a grid of points on the experiment core (``simulator/experiments``): each finished
point is written atomically by the driver process as soon as it finishes; ``resume=True`` skips
points whose run file exists and was produced by the same point definition
(``sweep_point_hash``), and refuses a folder another sweep file of another content wrote
(``experiment.json``: its path and :func:`definition_hash`). Summaries are rebuilt from the run files at the end in a fixed order, so
resumed and uninterrupted sweeps give identical ``summary.csv``.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servesim.simulator import config
from servesim.simulator.errors import ConfigError, ServesimError, path_is_file
from servesim.simulator.experiments import ExperimentRun, Point, PointStore, content_hash, fmt_rate
from servesim.simulator.experiments.points import inputs_hash
from servesim.simulator.experiments.store import (
    HOST_TIMING_KEYS,
    LEADING_COLUMNS,
    atomic_write_text,
    check_definition,
    make_folder,
    remove_stale_temps,
    write_definition,
)

SPEC_KEYS = (
    "base", "experiment_name", "description", "arms", "grid", "seeds", "num_seeds",
    "request_rates", "overrides", "baseline", "profile_sweep",
)
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.=,+-]*$")

PointFn = Callable[[dict, list, int, float | None], dict]


# ---------------------------------------------------------------------------------------------
# Spec


@dataclass(frozen=True)
class Arm:
    """One configuration under test: a name and its ``section.key -> value`` overrides."""

    name: str
    overrides: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class SweepPoint(Point):
    """One simulation: an arm at one request rate (None: the base config's) with one seed."""

    arm_index: int = 0
    overrides: tuple[tuple[str, Any], ...] = ()  # global + arm overrides, in application order
    arm_overrides: tuple[tuple[str, Any], ...] = ()

    def sort_key(self) -> tuple:
        rate = math.inf if self.rate is None else self.rate
        return (self.arm_index, rate, self.rate_label, self.seed)


@dataclass
class SweepSpec:
    """A validated sweep file."""

    source: str
    experiment_name: str
    base_tree: dict
    base_source: str
    arms: list[Arm]
    seeds: list[int]
    rates: list[float | None]
    overrides: tuple[tuple[str, Any], ...] = ()
    baseline: str | None = None
    description: str = ""
    rate_labels: dict[tuple[str, float | None], str] = field(default_factory=dict)
    profile_sweep: dict | None = None  # GuideLLM-style sweep (see module doc)
    profile_rates: dict[str, list[float]] = field(default_factory=dict)  # arm -> derived rates
    _hashes: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def override_keys(self) -> list[str]:
        """Every key an arm overrides, in first-seen order (recorded in each run)."""
        keys: list[str] = []
        for arm in self.arms:
            for k, _ in arm.overrides:
                if k not in keys:
                    keys.append(k)
        return keys

    def points(self) -> list[SweepPoint]:
        """All points, in the canonical order (arm, rate, seed)."""
        if self.profile_sweep is not None:
            return self.sweep_points(1) + self.sweep_points(2)
        out = []
        for i, arm in enumerate(self.arms):
            for rate in self.rates:
                for seed in self.seeds:
                    out.append(SweepPoint(
                        arm=arm.name, arm_index=i, rate=rate,
                        rate_label=self.rate_labels.get((arm.name, rate), fmt_rate(rate)),
                        seed=seed, overrides=self.overrides + arm.overrides,
                        arm_overrides=arm.overrides,
                    ))
        return sorted(out, key=SweepPoint.sort_key)

    def sweep_points(self, phase: int) -> list[SweepPoint]:
        """``profile_sweep`` points: phase 1 synchronous + throughput, phase 2 the rates
        between (for arms whose rates are known)."""
        ps = self.profile_sweep or {}
        mc = ps.get("max_concurrency")
        out = []
        for i, arm in enumerate(self.arms):
            base = self.overrides + arm.overrides
            if phase == 1:
                todo = [("synchronous", (("workload.request_rate", "inf"),
                                         ("workload.max_concurrency", 1))),
                        ("throughput", (("workload.request_rate", "inf"),
                                        ("workload.max_concurrency", mc)))]
                for seed in self.seeds:
                    for label, extra in todo:
                        out.append(SweepPoint(arm=arm.name, arm_index=i, rate=None,
                                              rate_label=label, seed=seed,
                                              overrides=base + extra,
                                              arm_overrides=arm.overrides))
                continue
            extra: tuple = (("workload.max_concurrency", mc),)
            if ps.get("strategy", "constant") == "constant":
                extra += (("workload.burstiness", "inf"),)
            for r in self.profile_rates.get(arm.name, []):
                for seed in self.seeds:
                    out.append(SweepPoint(arm=arm.name, arm_index=i, rate=r,
                                          rate_label=fmt_rate(r), seed=seed,
                                          overrides=base + extra, arm_overrides=arm.overrides))
        return sorted(out, key=SweepPoint.sort_key)

    def point_hash(self, p: SweepPoint) -> str:
        """Hash of everything that defines the point: base tree, overrides, rate, seed and
        :func:`inputs_hash` of its tree (the code, defaults, specs and files it resolves to)."""
        raw = content_hash(self.base_tree, [list(o) for o in p.overrides], p.rate, p.seed)
        if raw not in self._hashes:  # (resolving takes ~1 ms; summaries ask again)
            tree = build_tree(self.base_tree, p.overrides, p.seed, p.rate)
            self._hashes[raw] = content_hash(raw, inputs_hash(tree))
        return self._hashes[raw]


def _parse_rate(v: Any, where: str) -> float:
    if isinstance(v, str) and v.strip().lower() in ("inf", "+inf", "infinity", ".inf"):
        return math.inf
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ConfigError(f"{where}: expected a positive number or 'inf', got {v!r}")
    return float(v)


def _parse_override_item(item: Any, where: str) -> tuple[str, Any]:
    if isinstance(item, str):
        if "=" not in item:
            raise ConfigError(f"{where}: expected 'section.key=value', got {item!r}")
        import yaml

        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        return _check_key(key.strip(), where), value
    if isinstance(item, dict) and len(item) == 1:
        (k, v), = item.items()
        return _check_key(k, where), v
    raise ConfigError(f"{where}: expected 'section.key=value' or a one-key mapping, got {item!r}")


def _check_key(key: Any, where: str) -> str:
    """A dotted path 'section.key', or a top-level engine flag (``optimization_level``,
    ``performance_mode``, ``cpu_offload_gb``)."""
    if isinstance(key, str) and key.strip() in config.OMITTED_AT_DEFAULT[""]:
        return key.strip()
    if not isinstance(key, str) or len([p for p in key.split(".") if p]) < 2:
        raise ConfigError(f"{where}: override key {key!r} must be a dotted path 'section.key' "
                          f"or one of {', '.join(config.OMITTED_AT_DEFAULT[''])}")
    return key


def _parse_overrides(node: Any, where: str) -> tuple[tuple[str, Any], ...]:
    """``{k: v}`` or ``["k=v", {k: v}, ...]`` → ((k, v), ...)."""
    if node is None:
        return ()
    if isinstance(node, dict):
        return tuple((_check_key(k, f"{where}.{k}"), v) for k, v in node.items())
    if isinstance(node, list):
        return tuple(_parse_override_item(x, f"{where}[{i}]") for i, x in enumerate(node))
    raise ConfigError(f"{where}: expected a mapping of section.key: value (or a list of "
                      f"'section.key=value'), got {type(node).__name__}")


def build_tree(base_tree: dict, overrides: Iterable[tuple[str, Any]], seed: int | None,
               rate: float | None) -> dict:
    """The raw config tree of one point: base ← overrides ← rate ← seed."""
    tree = copy.deepcopy(base_tree)
    for k, v in overrides:
        config.set_path(tree, k, v)
    if rate is not None:
        config.set_path(tree, "workload.request_rate", "inf" if math.isinf(rate) else rate)
    if seed is not None:
        config.set_path(tree, "workload.seed", seed)
    return tree


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return fmt_rate(v) if v > 0 else repr(v)
    return str(v)


def _grid_arms(grid: Any, where: str) -> list[Arm]:
    if not isinstance(grid, dict) or not grid:
        raise ConfigError(f"{where}: expected a non-empty mapping section.key: [values]")
    keys, lists = [], []
    for k, vals in grid.items():
        _check_key(k, f"{where}.{k}")
        if not isinstance(vals, list) or not vals:
            raise ConfigError(f"{where}.{k}: expected a non-empty list of values, got {vals!r}")
        keys.append(k)
        lists.append(vals)
    arms = []
    for combo in itertools.product(*lists):
        name = ",".join(f"{k.split('.')[-1]}={_fmt_value(v)}" for k, v in zip(keys, combo))
        arms.append(Arm(name, tuple(zip(keys, combo))))
    return arms


def _resolve_base(base: Any, sweep_path: Path | None, where: str) -> tuple[dict, str]:
    from servesim.simulator.config import load_yaml

    if isinstance(base, dict):
        return copy.deepcopy(base), f"{where} (inline)"
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{where}: expected a config file path or an inline config mapping")
    cands = []
    if sweep_path is not None and not Path(base).is_absolute():
        cands.append(sweep_path.parent / base)
    cands.append(Path(base))
    for c in cands:
        if c.is_file():
            return load_yaml(c), str(c)
    raise ConfigError(f"{where}: config file {base!r} not found (looked in "
                      f"{', '.join(str(c) for c in cands)})")


def parse_spec(raw: Any, source: str = "<sweep>", sweep_path: Path | None = None,
               *, check_configs: bool = True) -> SweepSpec:
    """Validate a raw sweep mapping; every error is one line naming ``source`` and the key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level")
    unknown = [k for k in raw if k not in SPEC_KEYS]
    if unknown:
        raise ConfigError(f"{source}: {unknown[0]}: unknown key (expected one of "
                          f"{', '.join(SPEC_KEYS)})")
    if "base" not in raw:
        raise ConfigError(f"{source}: base: required (a config file path or inline mapping)")
    base_tree, base_source = _resolve_base(raw["base"], sweep_path, f"{source}: base")
    if not isinstance(base_tree, dict):
        raise ConfigError(f"{base_source}: expected a mapping of sections at the top level")

    name = raw.get("experiment_name")
    if name is None:
        name = sweep_path.stem if sweep_path is not None else "sweep"
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(f"{source}: experiment_name: expected a file-name-safe string "
                          f"(letters, digits, _ . = , + -), got {name!r}")

    overrides = _parse_overrides(raw.get("overrides"), f"{source}: overrides")

    arms: list[Arm] = []
    arms_node = raw.get("arms")
    if arms_node is not None:
        if not isinstance(arms_node, dict) or not arms_node:
            raise ConfigError(f"{source}: arms: expected a non-empty mapping name -> overrides")
        for aname, node in arms_node.items():
            aname = str(aname)
            if not _NAME_RE.match(aname):
                raise ConfigError(f"{source}: arms.{aname}: arm names must be file-name-safe "
                                  "(letters, digits, _ . = , + -)")
            arms.append(Arm(aname, _parse_overrides(node, f"{source}: arms.{aname}")))
    if raw.get("grid") is not None:
        garms = _grid_arms(raw["grid"], f"{source}: grid")
        if arms:
            arms = [Arm(f"{a.name},{g.name}", a.overrides + g.overrides)
                    for a in arms for g in garms]
        else:
            arms = garms
    if not arms:
        arms = [Arm("base", ())]
    seen: set[str] = set()
    for a in arms:
        if a.name in seen:
            raise ConfigError(f"{source}: arms: duplicate arm name {a.name!r}")
        seen.add(a.name)

    if "seeds" in raw and "num_seeds" in raw:
        raise ConfigError(f"{source}: seeds: give either seeds or num_seeds, not both")
    if "num_seeds" in raw:
        n = raw["num_seeds"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"{source}: num_seeds: expected a positive integer, got {n!r}")
        seeds = list(range(n))
    elif "seeds" in raw:
        seeds = raw["seeds"]
        if (not isinstance(seeds, list) or not seeds
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
            raise ConfigError(f"{source}: seeds: expected a non-empty list of integers, "
                              f"got {seeds!r}")
        neg = next((i for i, s in enumerate(seeds) if s < 0), None)
        if neg is not None:
            raise ConfigError(f"{source}: seeds[{neg}]: expected an integer >= 0, "
                              f"got {seeds[neg]}")
        if len(set(seeds)) != len(seeds):
            raise ConfigError(f"{source}: seeds: duplicate seeds in {seeds!r}")
    else:
        seeds = [0]

    rates: list[float | None] = [None]
    if raw.get("request_rates") is not None:
        rnode = raw["request_rates"]
        if not isinstance(rnode, list) or not rnode:
            raise ConfigError(f"{source}: request_rates: expected a non-empty list, got {rnode!r}")
        rates = [_parse_rate(v, f"{source}: request_rates[{i}]") for i, v in enumerate(rnode)]
        if len(set(rates)) != len(rates):
            raise ConfigError(f"{source}: request_rates: duplicate rates in {rnode!r}")

    for where, items in [("overrides", overrides)] + [(f"arms.{a.name}", a.overrides)
                                                      for a in arms]:
        for k, _ in items:
            if k == "workload.seed":
                raise ConfigError(f"{source}: {where}.{k}: the sweep sets workload.seed from "
                                  "seeds (common random numbers); use seeds/num_seeds")
            if k == "workload.request_rate" and raw.get("request_rates") is not None:
                raise ConfigError(f"{source}: {where}.{k}: conflicts with request_rates")

    psw = raw.get("profile_sweep")
    if psw is not None:
        if not isinstance(psw, dict):
            raise ConfigError(f"{source}: profile_sweep: expected a mapping {{sweep_size, "
                              "strategy, max_concurrency}}")
        bad = [k for k in psw if k not in ("sweep_size", "strategy", "max_concurrency")]
        if bad:
            raise ConfigError(f"{source}: profile_sweep.{bad[0]}: unknown key (expected "
                              "sweep_size, strategy, max_concurrency)")
        size = psw.get("sweep_size", 10)
        if isinstance(size, bool) or not isinstance(size, int) or size < 3:
            raise ConfigError(f"{source}: profile_sweep.sweep_size: expected an integer >= 3, "
                              f"got {size!r}")
        if psw.get("strategy", "constant") not in ("constant", "poisson"):
            raise ConfigError(f"{source}: profile_sweep.strategy: expected constant or poisson")
        if raw.get("request_rates") is not None:
            raise ConfigError(f"{source}: profile_sweep: conflicts with request_rates (the "
                              "sweep derives its rates)")
        mc = psw.get("max_concurrency", 512)
        if mc is not None and (isinstance(mc, bool) or not isinstance(mc, int) or mc < 1):
            raise ConfigError(f"{source}: profile_sweep.max_concurrency: expected a positive "
                              f"integer (or null: no cap), got {mc!r}")
        psw = {"sweep_size": size, "strategy": psw.get("strategy", "constant"),
               "max_concurrency": mc}

    baseline = raw.get("baseline")
    if baseline is not None and str(baseline) not in seen:
        raise ConfigError(f"{source}: baseline: {baseline!r} is not an arm "
                          f"(arms: {', '.join(a.name for a in arms)})")
    if baseline is not None:  # the baseline goes first: it is arm A of every comparison
        arms = sorted(arms, key=lambda a: a.name != str(baseline))

    spec = SweepSpec(source=source, experiment_name=name, base_tree=base_tree,
                     base_source=base_source, arms=arms, seeds=list(seeds), rates=rates,
                     overrides=overrides, baseline=str(baseline) if baseline else arms[0].name,
                     description=str(raw.get("description") or ""), profile_sweep=psw)
    if check_configs:
        validate_configs(spec)
    return spec


def validate_configs(spec: SweepSpec) -> None:
    """Validate the base config and every (arm, rate) config up front, before any simulation.

    Also fills ``spec.rate_labels`` for points that keep the base config's rate.
    """
    from servesim.simulator.config import validate_tree

    validate_tree(copy.deepcopy(spec.base_tree), spec.base_source)
    if spec.overrides:
        validate_tree(build_tree(spec.base_tree, spec.overrides, None, None),
                      f"{spec.source}: overrides")
    for arm in spec.arms:
        for rate in spec.rates:
            tree = build_tree(spec.base_tree, spec.overrides + arm.overrides, spec.seeds[0], rate)
            where = f"{spec.source}: arms.{arm.name}" + (
                f" at request_rate {fmt_rate(rate)}" if rate is not None else "")
            cfg = validate_tree(tree, where)
            resolved = _check_registered(cfg, where)
            if rate == spec.rates[0]:  # (what fits and the files read do not depend on it)
                _check_runnable(resolved, f"{spec.source}: arms.{arm.name}")
            if rate is None:
                r = getattr(cfg.workload, "request_rate", None)
                spec.rate_labels[(arm.name, None)] = fmt_rate(r) if r is not None else "base"
    labels = {}
    for arm in spec.arms:  # two base-rate arms must not collide with explicit rates
        for rate in spec.rates:
            lab = spec.rate_labels.get((arm.name, rate), fmt_rate(rate))
            if (arm.name, lab) in labels and labels[(arm.name, lab)] != rate:
                raise ConfigError(f"{spec.source}: request_rates: two rates of arm {arm.name} "
                                  f"map to the same folder BENCH-{lab}")
            labels[(arm.name, lab)] = rate


def _check_registered(cfg: Any, where: str) -> Any:
    """Unknown scheduler policy / KV allocator names and configs vLLM would refuse at start-up
    (``resolve_config``) fail up front, before any point runs; returns the resolved config."""
    from servesim.simulator import config as config_mod
    from servesim.simulator import registry

    for get, section, key in ((registry.get_scheduler, "scheduler", "policy"),
                              (registry.get_kv_allocator, "cache", "allocator")):
        try:
            get(getattr(getattr(cfg, section), key))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    resolve = getattr(config_mod, "resolve_config", None)
    if resolve is not None:
        try:
            return resolve(cfg)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    return cfg


def _check_runnable(cfg: Any, where: str) -> None:
    """The model fits the GPU (``plan_memory``, as ``simulate validate`` checks) and the
    calibration and workload files the config reads exist, so a point cannot fail on them
    after other arms have run."""
    from servesim.costmodels import plan_memory
    from servesim.simulator.experiments.points import check_input_files

    if getattr(cfg, "cluster", None) is None:
        try:
            plan_memory(cfg)
        except ServesimError as e:
            e.args = (f"{where}: {e}",)
            raise
    for g in [cfg] + list(cfg.cluster.instances if getattr(cfg, "cluster", None) else []):
        cal = str(getattr(getattr(g, "hardware", None), "calibration", None) or "auto").strip()
        if cal.lower() not in ("auto", "none") and not path_is_file(Path(cal).expanduser()):
            raise ConfigError(f"{where}: hardware.calibration: no such calibration file {cal}")
    check_input_files(cfg, where)


def load_spec(path: str | Path, *, check_configs: bool = True) -> SweepSpec:
    """Read and validate a sweep YAML file."""
    from servesim.simulator.config import load_yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: no such sweep file")
    return parse_spec(load_yaml(p), str(p), p, check_configs=check_configs)


# ---------------------------------------------------------------------------------------------
# Evaluating one point (the same function on every backend)


def evaluate_point(base_tree: dict, overrides: list, seed: int, rate: float | None) -> dict:
    """Run one point and return its vLLM bench dict: a pure function of its arguments."""
    from servesim.reports import compute_bench_result
    from servesim.simulator import config as config_mod
    from servesim.simulator.runner import run_experiment

    tree = build_tree(base_tree, overrides, seed, rate)
    cfg = config_mod.validate_tree(tree, f"sweep point seed={seed} rate={fmt_rate(rate)}")
    return compute_bench_result(run_experiment(cfg))


def run_record(spec: SweepSpec, p: SweepPoint, bench: dict) -> dict:
    """The bench dict of a run plus ``run_number``, the arm, seed and the override keys."""
    rec = {k: v for k, v in bench.items() if k not in HOST_TIMING_KEYS}
    rec["run_number"] = p.seed
    rec["arm"] = p.arm
    rec["seed"] = p.seed
    if p.rate is not None and "request_rate" not in rec:
        rec["request_rate"] = "inf" if math.isinf(p.rate) else p.rate
    for k, v in p.arm_overrides:
        rec[k] = v
    rec["sweep_point_hash"] = spec.point_hash(p)
    return rec


def _store(spec: SweepSpec, outdir: str | Path) -> PointStore:
    return PointStore(Path(outdir) / spec.experiment_name, "sweep_point_hash")


def write_summaries(spec: SweepSpec, exp_dir: Path) -> list[dict]:
    """Rebuild every ``summary.json`` and ``summary.csv`` from this spec's run files (stale
    files excluded), in canonical order; return the rows."""
    store = PointStore(exp_dir, "sweep_point_hash")
    found = store.collect((p, spec.point_hash(p)) for p in spec.points())
    return store.write_summaries(found, LEADING_COLUMNS + tuple(spec.override_keys))


# ---------------------------------------------------------------------------------------------
# Running a sweep


@dataclass
class SweepOutcome:
    exp_dir: Path
    num_points: int
    num_skipped: int
    num_run: int
    num_failed: int
    failures: list[tuple[str, str]]  # (run file path, error)
    rows: list[dict]
    ab_rows: list[dict]
    wall_seconds: float
    ab_note: str = ""  # why there is no A/B comparison (e.g. the baseline arm has no run)


def run_sweep(
    spec: SweepSpec,
    outdir: str | Path,
    *,
    jobs: int | None = None,
    backend: str = "local",
    ray_address: str | None = None,
    resume: bool = False,
    progress: bool = False,
    point_fn: PointFn | None = None,
    max_points: int | None = None,
    ab_method: str = "t",
) -> SweepOutcome:
    """Run every point not yet done, writing each as it finishes; rebuild summaries and A/B
    (``ab_method``: ``t`` or ``bootstrap`` intervals, see ``reports.ab``).

    ``max_points`` stops after that many new points (for tests of interruption/resume).
    Ctrl-C raises :class:`~servesim.simulator.experiments.Interrupted` (points kept so far).
    """
    from servesim.simulator.experiments.executors import check_options

    t0 = time.perf_counter()
    jobs = check_options(backend, jobs)
    point_fn = point_fn or evaluate_point
    store = _store(spec, outdir)
    if spec.profile_sweep is not None:
        return _run_profile_sweep(spec, store, t0, jobs=jobs, backend=backend,
                                  ray_address=ray_address, resume=resume, progress=progress,
                                  point_fn=point_fn, ab_method=ab_method)
    _prepare_folder(spec, store, Path(outdir), resume)
    points = spec.points()
    todo = [p for p in points if not (resume and store.load(p, spec.point_hash(p)))]
    skipped = len(points) - len(todo)
    if max_points is not None:
        todo = todo[:max_points]
    if backend == "local":  # no more workers than points (one point runs inline)
        jobs = min(jobs, max(1, len(todo)))
    run = ExperimentRun(store, label=f"sweep {spec.experiment_name}", total=len(points),
                        kept=skipped, backend=backend, jobs=jobs, ray_address=ray_address,
                        progress=progress)
    failures: list[tuple[str, str]] = []
    with run:
        for p in todo:
            run.submit(p, point_fn, spec.base_tree, list(p.overrides), p.seed, p.rate)
        for p, out in run.as_completed():
            if out.error is None:
                run.save(p, run_record(spec, p, out.value))
                continue
            fail = {"error": out.error, "arm": p.arm, "seed": p.seed, "run_number": p.seed,
                    "request_rate": p.rate_label, **dict(p.arm_overrides)}
            failures.append((str(run.save_failure(p, fail)), out.error))

    rows = write_summaries(spec, store.root)
    ab_rows, note = _write_ab(spec, store.root, rows, ab_method)
    return SweepOutcome(exp_dir=store.root, num_points=len(points), num_skipped=skipped,
                        num_run=len(todo), num_failed=len(failures), failures=failures,
                        rows=rows, ab_rows=ab_rows, wall_seconds=time.perf_counter() - t0,
                        ab_note=note)


def definition_hash(spec: SweepSpec) -> str:
    """Hash of the sweep file as resolved (base config, overrides, arms, seeds, rates):
    recorded in the folder, so that another sweep is not resumed into it."""
    return content_hash(spec.experiment_name, spec.base_tree, [list(o) for o in spec.overrides],
                        [[a.name, [list(o) for o in a.overrides]] for a in spec.arms],
                        spec.seeds, spec.rates, spec.profile_sweep, spec.baseline)


def _prepare_folder(spec: SweepSpec, store: PointStore, outdir: Path, resume: bool) -> None:
    """Create the experiment folder (one-line error when it cannot be one); refuse one that
    holds results, unless ``resume`` continues the same sweep (see ``check_definition``)."""
    make_folder(outdir, "sweep output")
    source, digest = str(Path(spec.source).resolve()), definition_hash(spec)
    if store.holds_points():
        check_definition(store.root, "sweep", source, digest, resume)
        if not resume:
            raise ConfigError(f"{store.root}: already holds sweep results; pass --resume to "
                              "continue that sweep, or choose another -o")
    make_folder(store.root, "sweep output")
    remove_stale_temps(store.root)
    write_definition(store.root, "sweep", source, digest)


def _write_ab(spec: SweepSpec, root: Path, rows: list[dict], method: str
              ) -> tuple[list[dict], str]:
    """Paired A/B rows of every arm against the baseline, written to ``ab.csv``; none (and
    why) when the baseline arm has no successful run."""
    if len(spec.arms) < 2 or not rows:
        return [], ""
    from servesim.reports.ab import ab_csv_text, paired_ab

    if not any(str(r.get("arm")) == spec.baseline for r in rows):
        (root / "ab.csv").unlink(missing_ok=True)
        return [], (f"no A/B comparison (ab.csv): baseline arm {spec.baseline} has no "
                    "successful run")
    ab_rows = paired_ab(rows, baseline=spec.baseline, method=method)
    atomic_write_text(root / "ab.csv", ab_csv_text(ab_rows))
    return ab_rows, ""


def _run_profile_sweep(spec: SweepSpec, store: PointStore, t0: float, *, jobs, backend,
                       ray_address, resume, progress, point_fn, ab_method) -> SweepOutcome:
    """GuideLLM-style sweep: synchronous and throughput points first, then the rates between
    their measured request throughputs (see the module doc)."""
    import numpy as np

    _prepare_folder(spec, store, store.root.parent, resume)
    failures: list[tuple[str, str]] = []
    num_run = skipped = 0
    records: dict[tuple[str, str, int], dict] = {}
    for phase in (1, 2):
        if phase == 2:
            size = spec.profile_sweep["sweep_size"]
            for arm in spec.arms:
                def thr(label, arm=arm):
                    v = [records[(arm.name, label, s)].get("request_throughput")
                         for s in spec.seeds if (arm.name, label, s) in records]
                    v = [x for x in v if isinstance(x, (int, float)) and x > 0]
                    return float(np.mean(v)) if v else None
                lo, hi = thr("synchronous"), thr("throughput")
                if lo is None or hi is None:
                    continue
                spec.profile_rates[arm.name] = [
                    float(f"{r:.4g}") for r in np.linspace(lo, hi, size - 1)[1:] if r > 0]
        points = spec.sweep_points(phase)
        todo = []
        for p in points:
            rec = store.load(p, spec.point_hash(p)) if resume else None
            if rec is not None:
                records[(p.arm, p.rate_label, p.seed)] = rec
                skipped += 1
            else:
                todo.append(p)
        n_jobs = min(jobs, max(1, len(todo))) if backend == "local" else jobs
        run = ExperimentRun(store, label=f"sweep {spec.experiment_name} (phase {phase})",
                            total=len(points), kept=len(points) - len(todo), backend=backend,
                            jobs=n_jobs, ray_address=ray_address, progress=progress)
        with run:
            for p in todo:
                run.submit(p, point_fn, spec.base_tree, list(p.overrides), p.seed, p.rate)
            for p, out in run.as_completed():
                num_run += 1
                if out.error is None:
                    rec = run_record(spec, p, out.value)
                    run.save(p, rec)
                    records[(p.arm, p.rate_label, p.seed)] = rec
                    continue
                fail = {"error": out.error, "arm": p.arm, "seed": p.seed, "run_number": p.seed,
                        "request_rate": p.rate_label, **dict(p.arm_overrides)}
                failures.append((str(run.save_failure(p, fail)), out.error))
    rows = write_summaries(spec, store.root)
    ab_rows, note = _write_ab(spec, store.root, rows, ab_method)
    return SweepOutcome(exp_dir=store.root, num_points=len(spec.points()), num_skipped=skipped,
                        num_run=num_run, num_failed=len(failures), failures=failures,
                        rows=rows, ab_rows=ab_rows, wall_seconds=time.perf_counter() - t0,
                        ab_note=note)
