"""``simulate fit CONFIG MEASURED... [-o calibration.yaml]`` (see ``simulator/fit.py``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer


def _fmt_s(v: float) -> str:
    if not math.isfinite(v):
        return ""
    a = abs(v)
    if a >= 1e-3:
        return f"{v * 1e3:.3f} ms"
    if a >= 1e-6:
        return f"{v * 1e6:.3f} us"
    return f"{v * 1e9:.1f} ns"


def _pct(v: float) -> str:
    return "" if not math.isfinite(v) else f"{v:+.1f}%"


def fit_command(
    config: Path = typer.Argument(  # noqa: B008
        ..., help="Experiment config of the measured deployment (model, hardware, parallel, "
                  "cache, scheduler)"),
    measured: list[Path] = typer.Argument(  # noqa: B008
        ..., help="`vllm bench serve --save-result --save-detailed` JSON files (or run "
                  "folders with a result.json)"),
    output: Path | None = typer.Option(  # noqa: B008
        None, "-o", "--output", help="Write the fitted parameters to this calibration file "
        "(merged into it when it exists); use it with hardware.calibration: FILE, or name it "
        "<calibration dir>/<gpu>.yaml"),
    overrides: list[str] | None = typer.Option(  # noqa: B008
        None, "--set", help="Override a config key: section.key=value (repeatable)"),
    holdout: float = typer.Option(
        0.0, "--holdout", help="Fraction of the measured files kept out of the fit (seeded) "
        "to report how the fit generalizes"),
    holdout_files: list[Path] | None = typer.Option(  # noqa: B008
        None, "--holdout-file", help="A measured file kept out of the fit (repeatable)"),
    prefix_len: int = typer.Option(
        0, "--prefix-len", min=0, help="Tokens every prompt shares with the others "
        "(vllm bench --random-prefix-len / a shared system prompt): replayed as prefix-cache "
        "hits"),
    fix: list[str] | None = typer.Option(  # noqa: B008
        None, "--fix", help="Keep a parameter at its prior (repeatable): request_s, "
        "tokenize_per_token_s, ipc_s, detokenize_per_token_s, per_step_s, per_request_s"),
    scales: str = typer.Option(
        "", "--scales", help="Also fit one time factor per op family, comma-separated: gemm, "
        "attention, elementwise, comm, moe"),
    max_evals: int = typer.Option(500, "--max-evals", min=10,
                                  help="Most simulations of the measured runs"),
    seed: int = typer.Option(0, "--seed", help="Seed of the --holdout choice"),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON"),
) -> None:
    """Fit the API-server and engine-host parameters to real `vllm bench serve` runs.

    Each measured run is replayed request for request; the per-request TTFT and TPOT of the
    simulation are compared with the measured ones and the error is minimised. Prints the
    parameters (prior → fitted, and whether the runs determine them) and, per run, mean /
    P50 / P90 / P99 of TTFT, TPOT, ITL and E2E: measured, and the simulation's error before
    and after the fit (held-out runs marked)."""
    from rich.console import Console
    from rich.table import Table
    from servesim.reports.console import print_table
    from servesim.reports.writers import atomic_write_text
    from servesim.simulator.errors import ServesimError
    from servesim.simulator.fit import (
        TABLE_METRICS,
        TABLE_STATS,
        calibration_doc,
        fit,
        rel_err,
    )
    from servesim.simulator.progress import phase

    existing = _check_output(output) if output is not None else None
    with phase("fitting (simulations)", max_evals) as tick:
        res = fit(config, list(measured), overrides=list(overrides or []), holdout=holdout,
                  holdout_files=list(holdout_files or []), prefix_len=prefix_len,
                  fix=tuple(fix or ()), seed=seed, max_evals=max_evals, progress=tick,
                  scales=tuple(x.strip() for x in scales.split(",") if x.strip()))
    write_error = None
    if output is not None:
        import yaml
        from servesim.simulator.config import load_config, resolve_config

        cfg = resolve_config(load_config(config, list(overrides or [])))
        doc = calibration_doc(res, config, cfg.hardware.name, existing)
        text = (json.dumps(doc, indent=1) + "\n" if output.suffix == ".json" else
                "# servesim calibration: fitted by `simulate fit` (see fit:)\n"
                + yaml.safe_dump(doc, sort_keys=False))
        try:
            atomic_write_text(output, text)
        except OSError as e:  # still print what was fitted (below), then fail
            write_error = ServesimError(f"{output}: cannot write the calibration file: "
                                        f"{e.strerror or e}; the fitted values are printed "
                                        "above")
    tables = res.tables()
    if as_json:
        out = {
            "parameters": {n: {"prior": res.prior[n], "fitted": res.fitted[n],
                               "determined_by_data": res.identified.get(n),
                               "rel_uncertainty": res.rel_sd.get(n)} for n in res.names},
            "runs": [{"file": name, "held_out": held,
                      "metrics": {m: {s: {"measured": tb[m][s][0], "before": tb[m][s][1],
                                          "after": ta[m][s][1]}
                                      for s in TABLE_STATS} for m in TABLE_METRICS}}
                     for name, held, tb, ta in tables],
            "simulations": res.evaluations,
            "output": str(output) if output else None,
        }
        typer.echo(json.dumps(out, indent=1, default=lambda v: None, allow_nan=False)
                   if not _has_nan(out) else json.dumps(_nan_to_none(out), indent=1))
        if write_error is not None:
            raise write_error
        return
    console = Console()
    t = Table(title="fitted parameters")
    for c in ("parameter", "prior", "fitted", "change", "determined by the runs"):
        t.add_column(c, justify="left" if c in ("parameter", "determined by the runs")
                     else "right")
    for n in res.names:
        p, f = res.prior[n], res.fitted[n]
        ident = res.identified.get(n)
        t.add_row(n, _fmt_s(p) if not n.startswith("scale_") else f"{p:.3f}",
                  _fmt_s(f) if not n.startswith("scale_") else f"{f:.3f}",
                  _pct(100 * (f / p - 1) if p else math.nan),
                  "yes" if ident else "no: prior-dominated (add runs that exercise it)")
    print_table(t, console)
    t = Table(title="per run: measured, and the simulation's error before → after the fit")
    for c in ("run", "metric", *(f"{s}" for s in TABLE_STATS)):
        t.add_column(c, justify="left" if c in ("run", "metric") else "right")
    for name, held, tb, ta in tables:
        label = name + (" (held out)" if held else "")
        for m in TABLE_METRICS:
            cells = []
            for s in TABLE_STATS:
                meas = tb[m][s][0]
                if not math.isfinite(meas):
                    cells.append("n/a")
                    continue
                cells.append(f"{meas * 1e3:.2f} ms: {_pct(rel_err(tb[m][s]))} → "
                             f"{_pct(rel_err(ta[m][s]))}")
            t.add_row(label, m.upper(), *cells)
            label = ""
    print_table(t, console)
    for held, what in ((False, "fitted runs"), (True, "held-out runs")):
        b, a = res.mean_abs_error(held, after=False), res.mean_abs_error(held)
        if math.isfinite(b):
            console.print(f"mean |error| of mean TTFT, {what}: {b:.2f}% → {a:.2f}%",
                          markup=False, highlight=False)
    console.print(f"{res.evaluations} simulations ({res.message})", markup=False,
                  highlight=False)
    if write_error is not None:
        raise write_error
    if output is not None:
        console.print(f"Wrote {output} (use: hardware.calibration: {output})", markup=False,
                      highlight=False, soft_wrap=True)


def _check_output(output: Path) -> dict | None:
    """``-o FILE``, checked before fitting: not a folder, an existing FILE a calibration
    mapping the fit can merge into, its folder creatable and writable. Returns FILE's
    content (None: a new file)."""
    from servesim.reports.writers import check_writable
    from servesim.simulator.config import load_yaml
    from servesim.simulator.errors import ServesimError, path_is_dir, path_is_file
    from servesim.simulator.fit import check_calibration_doc

    if path_is_dir(output):
        raise ServesimError(f"{output}: is a folder; expected a calibration file path")
    existing = None
    if path_is_file(output):
        existing = check_calibration_doc(load_yaml(output), str(output))
    check_writable(output, "calibration file")
    return existing


def _has_nan(x) -> bool:
    if isinstance(x, float):
        return not math.isfinite(x)
    if isinstance(x, dict):
        return any(_has_nan(v) for v in x.values())
    if isinstance(x, list):
        return any(_has_nan(v) for v in x)
    return False


def _nan_to_none(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_to_none(v) for v in x]
    return x


def register(app: typer.Typer) -> None:
    app.command("fit")(fit_command)
