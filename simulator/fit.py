"""``simulate fit``: fit the host and API-server parameters to a deployment's own runs.

Inputs: an experiment config (model, hardware, parallelism, engine settings of the measured
server) and one or more ``vllm bench serve --save-result --save-detailed`` files. Each file is
replayed request for request (its ``input_lens``, ``output_lens`` and ``start_times``; a run
with ``--max-concurrency`` and ``--request-rate inf`` as the same closed loop), and the
simulated per-request TTFT and TPOT are compared with the measured ones:

- a lightly loaded open-loop run (requests rarely overlap) request by request, matched by
  index, so each TTFT meets its own prompt length (tokenization per token, fixed terms);
- a busy run or a closed loop as distributions (sorted against sorted; a closed loop without
  its first wave): which request lands just after an engine step starts is a matter of phase;
- TPOT as distributions.

Each per-request relative error goes through a soft-L1 loss (:func:`_robust`: quadratic up to
~1%, linear beyond, so a request that lands one engine step later does not steer the fit),
each run weighs the same, and a weak prior term (``PRIOR_WEIGHT``, σ = one decade, in
log θ) pins what the runs cannot see. The parameters (:data:`PARAMS`): the frontend's
``request_s``, ``tokenize_per_token_s``, ``ipc_s``, ``detokenize_per_token_s`` and the engine
host's ``per_step_s``, ``per_request_s`` (``costmodels.step.HostOverhead``); ``--fix`` keeps
some at their prior; ``--scales gemm,attention,...`` adds one time factor per op family
(``StepCostModel.set_scales``; written as ``scales:``), fitted with the host terms.

Search (simulated latencies are step functions of the parameters: staircases with a downhill
trend, valleys where parameters trade off), in :mod:`.fit_search`: staged coordinate sweeps
over log grids (``search``), then a wide-difference Gauss–Newton polish in plain coordinates
with jumps along the valley floor (``polish``). The report flags each parameter the runs do
not determine (data curvature below 100× the prior's) as prior-dominated.

Which runs determine what (the README's recipe): a lightly loaded run with a wide range of
prompt lengths (tokenization per token, the fixed terms), a ``--request-rate inf`` burst of
tiny requests (the API server's request work, serialised on its event loop), a busy open-loop
stream with long outputs (output work per token; per-request host cost at large batches).

Held-out discipline: ``--holdout FRACTION`` (or ``--holdout-file``) keeps runs out of the
fit and reports the error on them before and after.

Output (``-o FILE``): a calibration file with ``frontend:``, ``host:`` (``scales:``), the fit's
provenance under ``fit:`` (files, date, residual error before and after, held-out error, the
kernel tables' source per family: ``scales`` are factors on those tables) and
``layer_over: auto`` (kernel tables come from what ``hardware.calibration: auto`` selects),
merged into FILE when it exists (its tables kept). Use it with ``hardware.calibration: FILE``
or put it in the user calibration directory as ``<gpu>.yaml``.
"""

from __future__ import annotations

import copy
import csv
import json
import math
import tempfile
import warnings
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from servesim.reports.ab import _num  # a JSON/CSV cell as a float (inf-aware, NaN if not)
from servesim.simulator.errors import ConfigError, ServesimError, short_repr
from servesim.simulator.fit_search import polish, search

# (name, where): fitted parameters, in report order
PARAMS = (
    ("request_s", "frontend"),
    ("tokenize_per_token_s", "frontend"),
    ("ipc_s", "frontend"),
    ("detokenize_per_token_s", "frontend"),
    ("per_step_s", "host"),
    ("per_request_s", "host"),
)
SCALE_FAMILIES = ("gemm", "attention", "elementwise", "comm", "moe")
PRIOR_WEIGHT = 1e-3  # weight of the prior term relative to one run's mean squared rel. error
PRIOR_DECADES = 1.0  # σ of the prior in decades (log10)
BOUNDS_DECADES = 3.0  # parameters stay within 10^±3 of their prior
DIFF_STEP = 0.03  # finite-difference step: 3% of each parameter
ROBUST_C = 0.01  # per-request relative error where the loss turns from quadratic to linear
TABLE_METRICS = ("ttft", "tpot", "itl", "e2el")
TABLE_STATS = ("mean", "p50", "p90", "p99")


# --------------------------------------------------------------------------------------------
# measured runs


@dataclass
class MeasuredRun:
    """One ``vllm bench serve --save-detailed`` file, per request (seconds)."""

    path: Path
    index: np.ndarray  # request index in the file (sim request_id)
    input_lens: np.ndarray
    output_lens: np.ndarray
    start: np.ndarray
    ttft: np.ndarray
    tpot: np.ndarray  # NaN for output_len <= 1
    e2el: np.ndarray
    itls: np.ndarray | None  # pooled inter-token gaps, None when the file has none
    request_rate: float
    max_concurrency: int | None
    trace: Path | None = None

    @property
    def name(self) -> str:
        return self.path.name if self.path.name != "result.json" else self.path.parent.name

    @property
    def overlap(self) -> float:
        """Fraction of requests in flight together with another one (0: the server served
        them one at a time)."""
        end = self.start + np.where(np.isfinite(self.e2el), self.e2el, self.ttft)
        order = np.argsort(self.start, kind="stable")
        s, e = self.start[order], end[order]
        prev_end = np.maximum.accumulate(e)
        alone = np.ones(len(s), dtype=bool)
        alone[1:] &= s[1:] >= prev_end[:-1]
        alone[:-1] &= e[:-1] <= s[1:]
        return float(1.0 - alone.mean()) if len(s) else 0.0

    @property
    def one_to_one(self) -> bool:
        """Compare TTFTs request by request: sends at the measured times and a server that
        was mostly idle (then each TTFT is the request's own, not a matter of which engine
        step it happened to land in)."""
        return self.open_loop and self.overlap < 0.25

    @property
    def open_loop(self) -> bool:
        """No concurrency cap: the replay sends each request when the real client did (a
        ``--request-rate inf`` burst: all at once, in order), so requests compare one to
        one."""
        return self.max_concurrency is None


def load_measured(path: str | Path) -> MeasuredRun:
    """Read a detailed vllm bench result; failed requests are left out (they are replayed
    by nobody: vLLM's client never got their first token)."""
    p = Path(path)
    if p.is_dir():
        p = p / "result.json"
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise ServesimError(f"{p}: cannot read ({e.strerror})") from None
    except ValueError as e:
        raise ServesimError(f"{p}: not valid JSON ({e})") from None
    if isinstance(d, list) and d and isinstance(d[-1], dict):
        d = d[-1]
    need = ("input_lens", "output_lens", "ttfts")
    if not isinstance(d, dict) or any(not isinstance(d.get(k), list) for k in need):
        raise ServesimError(f"{p}: expected a `vllm bench serve --save-result --save-detailed` "
                            "file (per-request input_lens, output_lens, ttfts)")
    n = len(d["input_lens"])
    if n == 0:
        raise ServesimError(f"{p}: no requests (input_lens is empty)")
    for k in ("output_lens", "ttfts", "itls", "start_times", "errors", "latencies"):
        v = d.get(k)
        if v is not None and len(v) != n:
            raise ServesimError(f"{p}: {k} has {len(v)} entries, input_lens {n}")
    ins = np.asarray([_num(x) for x in d["input_lens"]])
    outs = np.asarray([_num(x) for x in d["output_lens"]])
    ttft = np.asarray([_num(x) for x in d["ttfts"]])
    errs = d.get("errors") or [""] * n
    itls = d.get("itls")
    lat = d.get("latencies")
    starts = d.get("start_times")
    start = (np.asarray([_num(x) for x in starts]) if starts is not None else np.zeros(n))
    e2el = np.full(n, np.nan)
    pooled: list[float] = []
    have_itls = itls is not None and any(isinstance(x, list) for x in itls)
    for i in range(n):
        if have_itls and isinstance(itls[i], list):
            gaps = [_gap(g, p, i, j) for j, g in enumerate(itls[i]) if g is not None]
            pooled.extend(gaps)
            e2el[i] = ttft[i] + sum(gaps)
        elif lat is not None:
            e2el[i] = _num(lat[i])
    ok = np.array([not errs[i] for i in range(n)]) & (outs > 0) & np.isfinite(ttft) & \
        (ttft > 0) & np.isfinite(ins) & (ins > 0) & np.isfinite(start)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(outs > 1, (e2el - ttft) / (outs - 1), np.nan)
    idx = np.nonzero(ok)[0]
    if not len(idx):
        raise ServesimError(f"{p}: no successful requests to fit to")
    mc = d.get("max_concurrency")
    return MeasuredRun(
        path=p, index=idx, input_lens=ins[idx].astype(np.int64),
        output_lens=outs[idx].astype(np.int64), start=start[idx] - np.min(start[idx]),
        ttft=ttft[idx], tpot=tpot[idx], e2el=e2el[idx],
        itls=np.asarray(pooled) if have_itls else None,
        request_rate=_num(d.get("request_rate", "inf")),
        max_concurrency=int(mc) if isinstance(mc, (int, float)) and mc else None)


def _gap(g: Any, p: Path, i: int, j: int) -> float:
    """One inter-token gap of the file (seconds)."""
    try:
        if isinstance(g, bool):
            raise TypeError
        return float(g)
    except (TypeError, ValueError):
        raise ServesimError(f"{p}: itls[{i}][{j}]: expected a number (seconds), got "
                            f"{short_repr(g)}") from None


def check_replayable(runs: list[MeasuredRun], max_model_len: int, config: str | Path) -> None:
    """Every measured request fits ``max_model_len`` of the config (prompt + output tokens,
    vLLM's context-length check): the replay would refuse the others, and the fit would
    silently lose them (or the whole run), so the config is not the measured server's."""
    for r in runs:
        long = int(np.sum(r.input_lens + r.output_lens > max_model_len))
        if long:
            raise ConfigError(
                f"{r.path}: {long} of {len(r.input_lens)} requests are longer (prompt + output "
                f"tokens) than max_model_len {max_model_len} of {config}, so they cannot be "
                "replayed: is it the measured server's config? (--set model.max_model_len=N)")


def check_calibration_doc(doc: Any, where: str) -> dict:
    """An existing calibration file ``-o`` merges into: a mapping whose ``frontend``,
    ``host``, ``scales`` and ``fit`` sections (when present) are mappings."""
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: expected a calibration mapping (gpu:, frontend:, host: "
                          f"...) to merge the fit into, got a {type(doc).__name__}")
    for k in ("frontend", "host", "scales", "fit"):
        if doc.get(k) is not None and not isinstance(doc[k], dict):
            raise ConfigError(f"{where}: {k}: expected a mapping, got "
                              f"{type(doc[k]).__name__} {short_repr(doc[k])}")
    return doc


def write_trace(run: MeasuredRun, folder: Path, block_size: int, prefix_len: int) -> Path:
    """The run's requests as a canonical trace (arrival, lengths, shared-prefix block ids,
    the file's request index as request_id). Arrivals: the measured send times, or all at 0
    for a ``--request-rate inf --max-concurrency N`` closed loop (vllm bench's own)."""
    out = folder / f"{len(list(folder.iterdir()))}-{run.path.stem}.csv"
    closed = run.max_concurrency is not None and math.isinf(run.request_rate)
    n_blocks = prefix_len // block_size
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arrival_s", "prompt_len", "output_len", "prefix_block_ids", "request_id"])
        for k in range(len(run.index)):
            p = int(run.input_lens[k])
            nb = min(n_blocks, p // block_size)
            ids = " ".join(str(1_000_000 + j) for j in range(nb))
            t = 0.0 if closed else float(run.start[k])
            w.writerow([repr(t), p, int(run.output_lens[k]), ids, str(int(run.index[k]))])
    run.trace = out
    return out


# --------------------------------------------------------------------------------------------
# replay


@dataclass
class SimRun:
    ttft: np.ndarray  # per measured request (NaN where the simulation did not complete it)
    tpot: np.ndarray
    e2el: np.ndarray
    itl_values: np.ndarray
    itl_counts: np.ndarray


@dataclass
class Replayer:
    """Simulates the measured runs under given parameters (one cost model, host varied)."""

    tree: dict
    source: str
    runs: list[MeasuredRun]
    scale_families: tuple[str, ...] = ()
    cfgs: list = field(default_factory=list)
    cost: Any = None
    base_host: Any = None
    base_frontend: Any = None

    def __post_init__(self):
        from servesim.costmodels import build_cost_model, plan_memory
        from servesim.simulator.config import resolve_config, set_path, validate_tree
        from servesim.simulator.errors import in_file
        from servesim.simulator.frontend import FrontendParams, resolve_frontend

        for run in self.runs:
            t = json.loads(json.dumps(self.tree))  # a deep copy of plain YAML data
            wl = {"kind": "trace", "path": str(run.trace), "format": "canonical"}
            if run.max_concurrency:
                wl["max_concurrency"] = int(run.max_concurrency)
            t["workload"] = wl
            set_path(t, "frontend.enable", True)
            with in_file(self.source):
                cfg = resolve_config(validate_tree(t, self.source))
                # Speed: a KV cache larger than every request of the run together never
                # evicts (allocations take never-used blocks first) nor preempts, so such a
                # cache of just that size makes the same decisions (and is built far faster);
                # at least one max_model_len request's blocks, as vLLM checks an override.
                bs = cfg.cache.block_size
                need = int(np.sum(-(-(run.input_lens + run.output_lens) // bs))) + 2
                mem = plan_memory(cfg)
                need = max(need, mem.blocks_per_request)
                if cfg.cache.num_gpu_blocks_override is None and need < mem.num_gpu_blocks:
                    cfg.cache.num_gpu_blocks_override = need
                self.cfgs.append(cfg)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.cost = build_cost_model(self.cfgs[0])
        self.base_host = self.cost.host
        fe, _, _ = resolve_frontend(self.cfgs[0], self.cost.calibration)
        self.base_frontend = fe or FrontendParams()

    def prior(self) -> dict[str, float]:
        out = {}
        for name, where in PARAMS:
            src = self.base_frontend if where == "frontend" else self.base_host
            out[name] = float(getattr(src, name))
        for fam in self.scale_families:
            out[f"scale_{fam}"] = 1.0
        return out

    def simulate(self, theta: dict[str, float]) -> list[SimRun]:
        from servesim.simulator.runner import run_experiment

        host = replace(self.base_host, **{k: theta[k] for k, w in PARAMS
                                           if w == "host" and k in theta})
        self.cost.host = host
        if self.scale_families:
            self.cost.set_scales({f: theta.get(f"scale_{f}", 1.0) for f in self.scale_families})
        out = []
        for run, cfg in zip(self.runs, self.cfgs):
            c = cfg.model_copy(deep=True)
            for k, w in PARAMS:
                if w == "frontend" and k in theta:
                    setattr(c.frontend, k, float(theta[k]))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = run_experiment(c, resolved=True, cost_model=self.cost)
            q = res.requests
            pos = {int(r): i for i, r in enumerate(q["request_id"])}
            rows = np.array([pos.get(int(i), -1) for i in run.index])
            ok = rows >= 0

            def col(name, rows=rows, ok=ok, q=q):
                v = np.full(len(rows), np.nan)
                v[ok] = np.asarray(q[name], dtype=float)[rows[ok]]
                return v

            out.append(SimRun(col("ttft_s"), col("tpot_s"), col("e2el_s"),
                              np.asarray(res.itl_values), np.asarray(res.itl_counts)))
            res.close()
        return out


# --------------------------------------------------------------------------------------------
# errors and the fit


def _robust(e: np.ndarray) -> np.ndarray:
    """Relative errors → residuals whose squares are the soft-L1 loss ``2c²(√(1 + (e/c)²) −
    1)`` (c = :data:`ROBUST_C`): quadratic for small errors, linear for the step-sized jumps
    of single requests, so a request that lands one engine step later does not steer the
    fit. Not completed in the simulation: a miss of 100%."""
    e = np.where(np.isfinite(e), e, 1.0)
    c = ROBUST_C
    return np.sign(e) * np.sqrt(2 * c * c * (np.sqrt(1 + (e / c) ** 2) - 1))


def _run_residuals(run: MeasuredRun, sim: SimRun, parts: tuple[str, ...] = ("ttft", "tpot")
                   ) -> np.ndarray:
    """Per-request relative TTFT and TPOT errors of one run, robustified (:func:`_robust`),
    each run weighing the same (÷ √n).

    TTFT: a lightly loaded open-loop run compares request by request (TTFT against its own
    prompt length: the tokenization and fixed terms); a busy run compares its sorted TTFTs
    (which request lands just after an engine step starts is a matter of phase there, the
    distribution is not), a closed loop without its first wave (a burst whose TTFTs are set by
    how the engine splits it into steps). TPOT: sorted against sorted."""
    out = []
    if "ttft" in parts:
        if run.one_to_one:
            e = sim.ttft / run.ttft - 1.0
        else:
            n = len(run.ttft)
            keep = np.ones(n, dtype=bool)
            mc = run.max_concurrency
            if mc and n > 2 * mc:
                keep[np.argsort(run.start, kind="stable")[:mc]] = False
            a = np.sort(np.where(np.isfinite(sim.ttft[keep]), sim.ttft[keep], np.inf))
            e = a / np.sort(run.ttft[keep]) - 1.0
        out.append(_robust(e) / math.sqrt(len(e)))
    ok = np.isfinite(run.tpot)
    if "tpot" in parts and ok.any():
        a = np.sort(np.where(np.isfinite(sim.tpot[ok]), sim.tpot[ok], np.inf))
        e = a / np.sort(run.tpot[ok]) - 1.0
        out.append(_robust(e) / math.sqrt(len(e)))
    return np.concatenate(out) if out else np.zeros(0)


def _stat(x: np.ndarray, s: str, counts: np.ndarray | None = None) -> float:
    x = np.asarray(x, dtype=float)
    if counts is not None:
        x = np.repeat(x, np.asarray(counts, dtype=np.int64))
    x = x[np.isfinite(x)]
    if not len(x):
        return math.nan
    return float(np.mean(x)) if s == "mean" else float(np.percentile(x, float(s[1:])))


def metric_table(run: MeasuredRun, sim: SimRun) -> dict[str, dict[str, tuple[float, float]]]:
    """{metric: {stat: (measured, simulated)}} in seconds."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    both = np.isfinite(sim.ttft)
    for m in TABLE_METRICS:
        row = {}
        for s in TABLE_STATS:
            if m == "itl":
                meas = _stat(run.itls, s) if run.itls is not None else math.nan
                simv = _stat(sim.itl_values, s, sim.itl_counts)
            else:
                a, b = getattr(run, m), getattr(sim, m)
                meas, simv = _stat(a[both], s), _stat(b[both], s)
            row[s] = (meas, simv)
        out[m] = row
    return out


def rel_err(pair: tuple[float, float]) -> float:
    m, s = pair
    return 100.0 * (s - m) / m if m and math.isfinite(m) and math.isfinite(s) else math.nan


@dataclass
class FitResult:
    names: list[str]
    prior: dict[str, float]
    fitted: dict[str, float]
    fit_runs: list[MeasuredRun]
    holdout_runs: list[MeasuredRun]
    before: list[SimRun]  # per run (fit runs, then held-out)
    after: list[SimRun]
    cost_before: float
    cost_after: float
    identified: dict[str, bool]
    rel_sd: dict[str, float]
    evaluations: int
    message: str
    # calibration family -> the file (source) its kernel tables came from while fitting
    table_sources: dict[str, str] = field(default_factory=dict)

    def tables(self) -> list[tuple[str, bool, dict, dict]]:
        """(run name, held out, table before, table after) per run."""
        runs = self.fit_runs + self.holdout_runs
        return [(r.name, i >= len(self.fit_runs), metric_table(r, b), metric_table(r, a))
                for i, (r, b, a) in enumerate(zip(runs, self.before, self.after))]

    def mean_abs_error(self, held_out: bool, metric: str = "ttft", stat: str = "mean",
                       after: bool = True) -> float:
        vals = [abs(rel_err((ta if after else tb)[metric][stat]))
                for _, h, tb, ta in self.tables() if h == held_out]
        vals = [v for v in vals if math.isfinite(v)]
        return sum(vals) / len(vals) if vals else math.nan


def fit(config: str | Path, measured: list[str | Path], *, overrides: list[str] | None = None,
        holdout: float = 0.0, holdout_files: list[str | Path] | None = None,
        prefix_len: int = 0, scales: tuple[str, ...] = (), fix: tuple[str, ...] = (),
        seed: int = 0, max_evals: int = 500, progress=None) -> FitResult:
    """Fit :data:`PARAMS` (minus ``fix``, plus ``scale_<family>`` for ``scales``) to the
    measured files; ``holdout``: fraction of the files kept out (seeded), or ``holdout_files``."""
    from servesim.simulator.config import (
        apply_overrides,
        load_yaml,
        resolve_config,
        validate_tree,
    )

    for f in scales:
        if f not in SCALE_FAMILIES:
            raise ConfigError(f"--scales: {f!r} is not an op family ({', '.join(SCALE_FAMILIES)})")
    names_all = [n for n, _ in PARAMS]
    for f in fix:
        if f not in names_all:
            raise ConfigError(f"--fix: {f!r} is not a fitted parameter ({', '.join(names_all)})")
    both = {Path(p).resolve() for p in measured} & {Path(p).resolve() for p in holdout_files or []}
    if both:
        raise ConfigError(f"--holdout-file {min(both)}: also a measured file to fit; a held-out "
                          "file must not be fitted")
    runs = [load_measured(p) for p in measured]
    held = [load_measured(p) for p in (holdout_files or [])]
    if holdout and not held:
        if not 0 < holdout < 1:
            raise ConfigError("--holdout: expected a fraction between 0 and 1")
        if len(runs) < 2:
            raise ConfigError("--holdout: needs at least two measured files (one to fit)")
        k = min(len(runs) - 1, max(1, round(holdout * len(runs))))
        order = np.random.default_rng(seed).permutation(len(runs))
        out = set(order[:k].tolist())
        held = [r for i, r in enumerate(runs) if i in out]
        runs = [r for i, r in enumerate(runs) if i not in out]
    tree = load_yaml(config)
    if overrides:
        tree = apply_overrides(tree, overrides)
    # (the block size the replayed engine uses: vLLM's default for this model and GPU if unset)
    resolved = resolve_config(validate_tree(copy.deepcopy(tree), str(config)))
    block = resolved.cache.block_size
    check_replayable(runs + held, resolved.model.max_model_len, config)
    tmp = tempfile.TemporaryDirectory(prefix="servesim-fit-")
    try:
        folder = Path(tmp.name)
        for r in runs + held:
            write_trace(r, folder, block, prefix_len)
        rep = Replayer(tree, str(config), runs, tuple(scales))
        rep_all = Replayer(tree, str(config), runs + held, tuple(scales))
        prior = rep.prior()
        names = [n for n in prior if n not in fix]
        sigma = PRIOR_DECADES * math.log(10)
        evals = [0]
        to_theta, z0, coord_names = _coordinates(prior, names)
        lo = z0 - BOUNDS_DECADES * math.log(10)
        hi = z0 + BOUNDS_DECADES * math.log(10)

        def data_of(th: dict, parts=("ttft", "tpot")) -> np.ndarray:
            evals[0] += 1
            sims = rep.simulate(th)
            if progress is not None:
                progress(evals[0])
            return np.concatenate([_run_residuals(r, s, parts) for r, s in zip(runs, sims)])

        def logx(th: dict) -> np.ndarray:
            return np.log(np.array([th[n] / prior[n] for n in names]))

        def residuals(z, parts=("ttft", "tpot")):
            th = to_theta(z)
            return np.concatenate([data_of(th, parts), PRIOR_WEIGHT * logx(th) / sigma])

        def cost(z, parts=("ttft", "tpot")):
            return float(np.sum(residuals(z, parts) ** 2))

        r0 = residuals(z0)
        z, _ = search(cost, residuals, z0, lo, hi, int(max_evals * 0.75), coord_names)
        # polish in plain coordinates (log θ/θ_prior each): the frontend's terms one by one
        x_lo = np.full(len(names), -BOUNDS_DECADES * math.log(10))
        x_hi = -x_lo

        def theta_x(x):
            return {**prior, **{n: prior[n] * math.exp(float(v)) for n, v in zip(names, x)}}

        def residuals_x(x, parts=("ttft", "tpot")):
            th = theta_x(x)
            return np.concatenate([data_of(th, parts), PRIOR_WEIGHT * logx(th) / sigma])

        def cost_x(x, parts=("ttft", "tpot")):
            return float(np.sum(residuals_x(x, parts) ** 2))

        x = logx(to_theta(z))
        used = [evals[0]]
        fe_idx = [j for j, nm in enumerate(names) if nm in dict(PARAMS)
                  and dict(PARAMS)[nm] == "frontend"]
        x = polish(cost_x, residuals_x, x, x_lo, x_hi, used, max_evals, fe_idx)
        fitted = theta_x(x)
        # identification: the data term's curvature along each parameter (central
        # differences of ±30% of it) against the prior term's
        h = 10 * DIFF_STEP
        x = logx(fitted)

        def sq(v):
            return float(np.sum(data_of({**fitted, **{n: prior[n] * math.exp(a)
                                                       for n, a in zip(names, v)}}) ** 2))

        f0 = sq(x)
        identified, rel_sd = {}, {}
        prior_curv = 2 * (PRIOR_WEIGHT / sigma) ** 2
        for j, n in enumerate(names):
            e = np.zeros(len(names))
            e[j] = h
            c = (sq(x + e) + sq(x - e) - 2 * f0) / h ** 2
            identified[n] = bool(c > 100 * prior_curv)
            # the relative change that doubles the residual error (or raises it by 1% of
            # the starting error when the fit is exact)
            floor = max(f0, 0.01 * float(np.sum(r0[:-len(names)] ** 2)), 1e-12)
            rel_sd[n] = float(math.exp(math.sqrt(2 * floor / c)) - 1) if c > 0 else math.inf
        n_prior = len(names)
        ssr = f0
        sol_message = f"search: {evals[0]} simulations, cost {cost_x(x):.4g}"
        before = rep_all.simulate(prior)
        after = rep_all.simulate(fitted)
        return FitResult(names=names, prior=prior, fitted=fitted, fit_runs=runs,
                         holdout_runs=held, before=before, after=after,
                         cost_before=float(np.sum(r0[:-n_prior] ** 2)),
                         cost_after=ssr, identified=identified, rel_sd=rel_sd,
                         evaluations=evals[0], message=sol_message,
                         table_sources=dict(getattr(rep.cost.calibration, "sources", {})))
    finally:
        tmp.cleanup()


# the API-server delays a lightly loaded run sees only as one sum (request work, the IPC hop
# both ways, one token's output work): searched as that sum and two shares
TRIO = ("request_s", "ipc_s", "detokenize_per_token_s")


def _coordinates(prior: dict, names: list[str]):
    """(z → θ, z0): search coordinates. Each parameter is log(θ / θ_prior), except that
    ``TRIO`` (when all three are fitted) becomes log of ``c = request_s + 2·ipc_s +
    detokenize_per_token_s`` and the logs of ``request_s / 2·ipc_s`` and
    ``detokenize_per_token_s / 2·ipc_s`` (relative to the prior's), so that a coordinate
    sweep can move one share of a well-measured sum without moving the sum."""
    mixed = all(t in names for t in TRIO)
    plain = [n for n in names if not (mixed and n in TRIO)]
    r0, i0, d0 = (prior[t] for t in TRIO)
    c0, a0, b0 = r0 + 2 * i0 + d0, math.log(r0 / (2 * i0)), math.log(d0 / (2 * i0))
    lim = BOUNDS_DECADES * math.log(10)

    def to_theta(z) -> dict:
        th = dict(prior)
        for n, v in zip(plain, z):
            th[n] = prior[n] * math.exp(float(v))
        if mixed:
            zc, za, zb = (float(v) for v in z[len(plain):])
            c, ea, eb = c0 * math.exp(zc), math.exp(a0 + za), math.exp(b0 + zb)
            d = 1.0 + ea + eb
            th["request_s"], th["ipc_s"], th["detokenize_per_token_s"] = (
                c * ea / d, c / (2 * d), c * eb / d)
        for n in names:  # within 10^±BOUNDS_DECADES of the prior
            th[n] = min(max(th[n], prior[n] * math.exp(-lim)), prior[n] * math.exp(lim))
        return th

    coords = plain + (["frontend_total", "request_share", "detokenize_share"] if mixed else [])
    return to_theta, np.zeros(len(coords)), coords


# --------------------------------------------------------------------------------------------
# output


def calibration_doc(res: FitResult, config: str | Path, gpu: str,
                    existing: dict | None = None) -> dict:
    """The calibration document ``-o`` writes (merged into ``existing``)."""
    from servesim.reports.bench_result import _version

    doc = dict(check_calibration_doc(existing, "calibration file"))
    doc.setdefault("version", 2)
    doc.setdefault("gpu", gpu)
    if not any(doc.get(k) for k in ("gemm", "decode_attention", "prefill_attention",
                                     "allreduce", "moe")):
        doc["layer_over"] = "auto"
        doc.setdefault("source", {"kind": "fit", "servesim_version": _version()})
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    fe = dict(doc.get("frontend") or {})
    host = dict(doc.get("host") or {})
    for n, where in PARAMS:
        if n in res.names:  # fitted ones (a --fix'ed parameter keeps its source)
            (fe if where == "frontend" else host)[n] = float(f"{res.fitted[n]:.6g}")
    doc["frontend"] = fe
    doc["host"] = host
    scales = {k[len("scale_"):]: float(f"{v:.6g}") for k, v in res.fitted.items()
              if k.startswith("scale_")}
    if scales:
        doc["scales"] = scales
    doc["fit"] = {
        "date": now,
        "servesim_version": _version(),
        "config": str(config),
        "files": [str(r.path) for r in res.fit_runs],
        "holdout_files": [str(r.path) for r in res.holdout_runs],
        "parameters": {n: {"prior": float(f"{res.prior[n]:.6g}"),
                           "fitted": float(f"{res.fitted[n]:.6g}"),
                           "determined_by_data": res.identified.get(n, False)}
                       for n in res.names},
        "tables": dict(res.table_sources),  # (scales are factors on these tables)
        "residual": {"before": float(f"{res.cost_before:.6g}"),
                     "after": float(f"{res.cost_after:.6g}")},
        "mean_ttft_error_pct": {
            "fit_before": _r(res.mean_abs_error(False, after=False)),
            "fit_after": _r(res.mean_abs_error(False)),
            "holdout_before": _r(res.mean_abs_error(True, after=False)),
            "holdout_after": _r(res.mean_abs_error(True))},
    }
    return doc


def _r(v: float) -> float | None:
    return round(v, 3) if math.isfinite(v) else None


__all__ = ["PARAMS", "FitResult", "MeasuredRun", "Replayer", "calibration_doc", "fit",
           "load_measured", "metric_table"]
