"""``simulate run`` and ``simulate validate``."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import typer

CONFIG_ARG = typer.Argument(..., help="Experiment config YAML (e.g. configs/llama8b_a100.yaml)")
SET_OPT = typer.Option(None, "--set", help="Override a config key: section.key=value (repeatable)")


def load(config: Path, overrides: list[str] | None, seed: int | None = None):
    from servesim.simulator.config import load_config, resolve_config

    ov = list(overrides or [])
    if seed is not None:
        ov.append(f"workload.seed={seed}")
    return resolve_config(load_config(config, ov))


def run(
    config: Path = CONFIG_ARG,
    output_dir: Path | None = typer.Option(  # noqa: B008  (typer's idiom)
        None, "-o", "--output-dir",
        help="Run directory (default results/<config-stem>-<UTC timestamp>)"),
    overrides: list[str] | None = SET_OPT,
    seed: int | None = typer.Option(None, "--seed", help="Workload seed (vllm bench --seed)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors"),
) -> None:
    """Simulate one experiment and write result.json, requests.csv, timeseries.csv."""
    from rich.console import Console
    from servesim.reports import compute_bench_result, print_summary, write_run
    from servesim.simulator.runner import run_experiment

    cfg = load(config, overrides, seed)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    outdir = output_dir or Path("results") / f"{Path(config).stem}-{stamp}"
    console = Console(stderr=False, quiet=quiet)
    progress_cb, finish = _progress(quiet)
    try:
        result = run_experiment(cfg, resolved=True, progress=progress_cb)
    finally:
        finish()
    write_run(result, outdir)
    if not quiet:
        print_summary(compute_bench_result(result), console)
        console.print(f"Wrote {outdir}/result.json, requests.csv, timeseries.csv, "
                      "config.resolved.yaml")


def _progress(quiet: bool):
    """A rich progress bar that appears only for runs longer than ~2 s."""
    if quiet:
        return None, lambda: None
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    state = {"bar": None, "task": None, "t0": time.perf_counter(), "last": 0.0}

    def cb(done: int, total: int | None) -> None:
        now = time.perf_counter()
        if now - state["last"] < 0.2:
            return
        state["last"] = now
        if state["bar"] is None:
            if now - state["t0"] < 2.0:
                return
            bar = Progress(TextColumn("simulating"), BarColumn(),
                           TextColumn("{task.completed}/{task.total} requests"),
                           TimeRemainingColumn(), transient=True)
            bar.start()
            state["bar"], state["task"] = bar, bar.add_task("run", total=total)
        state["bar"].update(state["task"], completed=done)

    def finish() -> None:
        if state["bar"] is not None:
            state["bar"].stop()

    return cb, finish


def validate(
    config: Path = CONFIG_ARG,
    overrides: list[str] | None = SET_OPT,
) -> None:
    """Print the resolved config and the derived capacity, as vLLM logs it at start-up;
    exit 2 when the config cannot run."""
    from servesim.costmodels import plan_memory

    cfg = load(config, overrides)
    plan = plan_memory(cfg)
    typer.echo("# resolved config")
    typer.echo(cfg.to_yaml().rstrip())
    typer.echo("\n# derived capacity (as vLLM logs it at start-up)")
    for line in plan.log_lines():
        typer.echo(line)
    typer.echo(f"num_gpu_blocks: {plan.num_gpu_blocks}")


def register(app: typer.Typer) -> None:
    app.command("run")(run)
    app.command("validate")(validate)
