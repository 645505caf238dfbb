"""The plan driver: an adaptive search over points on the experiment core.

For every candidate deployment of the search space:

1. check it fits (``resolve_config`` + ``costmodels.plan_memory``; a ``CapacityError`` or
   ``ConfigError`` skips it with the reason);
2. per seed, search the highest request rate one replica sustains within the SLO
   (:class:`~servesim.simulator.plan.search.RateSearch`); each seed's next probe is submitted
   as soon as its previous one comes back, so all candidates and seeds search in parallel;
3. size it: replicas = ceil(target / capacity), and (``confirm``) simulate the operating point
   target / replicas; while that misses an SLO, add a replica (at most ``max_added_replicas``)
   and simulate again. A candidate *fits* only if its simulated operating point meets every SLO;
4. summarize (:mod:`.summary`): cost, ranking, Pareto set, warnings.

Every simulated point is kept as ``DIR/points/SERVE-<candidate>-BENCH-<rate>/run=<seed>.json``
(the ``vllm bench sweep`` layout) and reused by ``--resume`` when its definition (config tree,
rate, seed, SLO) is unchanged; ``DIR/experiment.json`` records which plan file wrote DIR, and
``--resume`` refuses a folder another plan file of another content wrote.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servesim.simulator.errors import ServesimError
from servesim.simulator.experiments import ExperimentRun, Point, PointStore, content_hash, fmt_rate
from servesim.simulator.experiments.store import (
    check_definition,
    make_folder,
    remove_stale_temps,
    write_definition,
)
from servesim.simulator.plan.cost import load_prices, replicas_for
from servesim.simulator.plan.point import evaluate_point, point_hash, resolve_tree, sustained_tree
from servesim.simulator.plan.search import (
    RateSearch,
    first_guess_rps,
    new_search,
    round_rate,
    summarize_searches,
)
from servesim.simulator.plan.slo import slo_passed, slo_ratio
from servesim.simulator.plan.spec import (
    PlanSpec,
    base_tree,
    expand_candidates,
    get_path,
    prices_path,
)


@dataclass
class Candidate:
    """One deployment under search, and what the plan learnt about it."""

    name: str
    assign: dict[str, Any]
    tree: dict
    fits: bool = False
    reason: str = ""
    hardware: str = ""
    tp: int = 1
    pp: int = 1
    num_gpu_blocks: float = math.nan
    rate0: float = 1.0
    searches: dict[int, RateSearch] = field(default_factory=dict)
    points: list[dict] = field(default_factory=list)  # search points' metrics
    confirms: list[dict] = field(default_factory=list)  # operating points, one per replica count
    gpus_per_replica: int = 0  # 0: tp · pp; a cluster shape: all its instances' GPUs
    usd_per_replica_hour: float = math.nan  # a cluster shape: Σ GPUs × their price
    cluster_gpus: dict = field(default_factory=dict)  # GPU kind -> count per replica
    min_replicas: int = 0  # ceil(target / capacity)
    replicas: int = 0  # the replica count of the last simulated operating point
    in_flight: int = 0

    @property
    def confirm(self) -> dict | None:
        """The last simulated operating point (None: not simulated)."""
        return self.confirms[-1] if self.confirms else None


def run_plan(spec: PlanSpec, plan_dir: Path, outdir: str | Path, *, jobs: int = 1,
             backend: str = "local", ray_address: str | None = None, resume: bool = False,
             quiet: bool = False, evaluate: Callable[..., dict] | None = None,
             fit_check: Callable | None = None, write_report: bool = True,
             log: Callable[[str], None] | None = None, source: str | None = None
             ) -> dict[str, Any]:
    """Run a capacity plan; write plan.csv, plan.json, points/, report.md, report.html.

    ``evaluate`` (default :func:`~servesim.simulator.plan.point.evaluate_point`) maps
    (tree, rate, seed, slo dict, candidate name) → a point record with ``plan_point`` metrics;
    ``fit_check`` (default :func:`~servesim.simulator.plan.point.resolve_tree`) maps
    (tree, source) → (cfg, memory plan) or raises; tests inject fast synthetic ones.
    ``source``: the plan file (default: the plan's name), recorded in ``outdir`` so that
    ``resume`` refuses a folder another plan wrote. Returns the plan.json dict. Ctrl-C raises
    :class:`~servesim.simulator.experiments.Interrupted` (points kept so far).
    """
    from servesim.simulator.plan.summary import summarize_plan, write_plan_outputs

    outdir = Path(outdir)
    wall0 = time.perf_counter()
    tree = base_tree(spec, plan_dir)
    prices = load_prices(prices_path(spec, plan_dir))
    source = str(Path(source).resolve()) if source else spec.name
    digest = content_hash(spec.model_dump(mode="json"), tree)
    if resume:
        check_definition(outdir, "plan", source, digest, resume)
    make_folder(outdir, "plan output")
    remove_stale_temps(outdir)
    write_definition(outdir, "plan", source, digest)
    evaluate = evaluate or evaluate_point
    log = log or (lambda s: None)
    slo_d = spec.slo.model_dump()

    cands = [Candidate(n, a, t) for n, a, t in expand_candidates(spec, tree)]
    for c in cands:
        _check_fit(c, spec, fit_check or resolve_tree)
        if not c.fits:
            log(f"skip {c.name}: {c.reason}")
            continue
        c.searches = {s: new_search(c.rate0, spec.tolerance) for s in spec.seeds}

    store = PointStore(outdir / "points", "plan_point_hash")
    run = ExperimentRun(store, label="plan: simulated points", backend=backend, jobs=jobs,
                        ray_address=ray_address, resume=resume, progress=not quiet)
    kept: dict[Point, dict] = {}

    def probe(c: Candidate, seed: int, r: float, confirm: bool) -> None:
        """Simulate (or, on --resume, reuse) candidate ``c`` at rate ``r`` with ``seed``."""
        t = sustained_tree(c.tree, r, spec.min_duration_s, spec.max_prompts)
        p, h = Point(c.name, r, fmt_rate(r), seed), point_hash(t, r, seed, slo_d)
        rec = run.load(p, h)
        if rec is not None:
            arrived(c, p, rec, confirm)
        else:
            c.in_flight += 1
            run.submit((c, p, h, confirm), evaluate, t, r, seed, slo_d, c.name)

    def arrived(c: Candidate, p: Point, rec: dict, confirm: bool) -> None:
        kept[p] = rec
        m = dict(rec["plan_point"])
        m["passed"] = slo_passed(m, spec.slo)
        m.update(request_rate=p.rate, seed=p.seed, candidate=c.name)
        if confirm:
            c.confirms.append(m)
            next_confirm(c)
            return
        m["slo_ratio"] = slo_ratio(m, spec.slo)
        c.points.append(m)
        c.searches[p.seed].update(p.rate, bool(m["passed"]), m["slo_ratio"])
        next_probe(c, p.seed)

    def next_probe(c: Candidate, seed: int) -> None:
        r = c.searches[seed].propose()
        if r is not None:
            probe(c, seed, r, confirm=False)
        elif c.in_flight == 0 and all(s.done for s in c.searches.values()):
            next_confirm(c)

    def next_confirm(c: Candidate) -> None:
        """Simulate the operating point; add a replica while it misses the SLO (bounded)."""
        if not spec.confirm:
            return
        if c.confirm is None:
            cap = summarize_searches(c.searches)["capacity_rps"]
            if not cap > 0:
                return
            c.min_replicas = c.replicas = replicas_for(spec.target_request_rate, cap)
        elif c.confirm["passed"] or c.replicas >= c.min_replicas + spec.max_added_replicas:
            return
        else:
            c.replicas += 1
        probe(c, spec.seeds[0], round_rate(spec.target_request_rate / c.replicas), confirm=True)

    with run:
        for c in cands:
            for seed in c.searches:
                next_probe(c, seed)
        for (c, p, h, confirm), out in run.as_completed():
            c.in_flight -= 1
            if out.error is None:
                rec = {k: v for k, v in out.value.items() if k != "plan_point"}
                rec.update(arm=c.name, seed=p.seed, run_number=p.seed, plan_candidate=c.name,
                           plan_point_hash=h, plan_point=out.value["plan_point"])
                run.save(p, rec)
                arrived(c, p, rec, confirm)
            elif out.user_error:  # e.g. the engine refuses the config at run time
                c.fits, c.reason = False, f"{out.kind}: {out.error}"
                log(f"skip {c.name}: {c.reason}")
                for s in c.searches.values():
                    s.max_evals = len(s.history)
            else:
                raise RuntimeError(f"plan point {p.dirname}/{p.run_name}: {out.error}")
            run.progress(*_progress(cands, run.pending))

    result = summarize_plan(spec, cands, prices)
    result.update(wall_seconds=time.perf_counter() - wall0, jobs=jobs, backend=backend)
    write_plan_outputs(result, outdir)
    if kept:
        store.write_summaries(sorted(kept.items(), key=lambda kv: (kv[0].arm, kv[0].rate,
                                                                  kv[0].seed)))
    if write_report:
        from servesim.reports.render import write_report as _write_report

        _write_report(outdir)
    return result


def _progress(cands: list[Candidate], pending: int) -> tuple[int, int]:
    """(points done, estimated total): about 3 more probes per unfinished search."""
    done = sum(len(s.history) for c in cands for s in c.searches.values())
    left = sum(0 if s.done else 3 for c in cands for s in c.searches.values())
    return done, done + left + pending


def _check_fit(c: Candidate, spec: PlanSpec, fit_check: Callable) -> None:
    c.hardware = str(get_path(c.tree, "hardware.name", "a100-sxm4-80gb"))
    c.tp = int(get_path(c.tree, "parallel.tensor_parallel_size", 1) or 1)
    c.pp = int(get_path(c.tree, "parallel.pipeline_parallel_size", 1) or 1)
    try:
        cfg, mem = fit_check(c.tree, f"plan candidate {c.name}")
    except ServesimError as e:
        c.fits, c.reason = False, f"{type(e).__name__}: {e}"
        return
    if cfg is not None:
        c.hardware = str(cfg.hardware.name)
        c.tp = int(cfg.parallel.tensor_parallel_size)
        c.pp = int(cfg.parallel.pipeline_parallel_size)
        if getattr(cfg, "cluster", None) is not None:  # one "replica" = the whole cluster
            gpus: dict[str, int] = {}
            for g in cfg.cluster.instances:
                par = g.parallel or {}
                n = (int(par.get("tensor_parallel_size", 1))
                     * int(par.get("pipeline_parallel_size", 1)) * g.replicas)
                gpus[g.hardware.name] = gpus.get(g.hardware.name, 0) + n
            c.hardware = "+".join(sorted(gpus))
            c.gpus_per_replica = sum(gpus.values())
            c.cluster_gpus = gpus
    c.num_gpu_blocks = float(getattr(mem, "num_gpu_blocks", math.nan) or math.nan)
    c.fits, c.reason = True, ""
    c.rate0 = float(spec.tolerance.first_guess_rps or first_guess_rps(cfg, mem))
    if cfg is not None and getattr(cfg, "cluster", None) is not None and not \
            spec.tolerance.first_guess_rps:
        c.rate0 *= max(1, cfg.cluster.num_instances // (2 if cfg.cluster.disaggregated else 1))
