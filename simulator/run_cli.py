"""``simulate run`` and ``simulate validate``."""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

import typer

CONFIG_ARG = typer.Argument(..., help="Experiment config YAML (e.g. configs/llama8b_a100.yaml)")
SET_OPT = typer.Option(None, "--set", help="Override a config key: section.key=value (repeatable)")


def load(config: Path, overrides: list[str] | None, seed: int | None = None):
    """Load, override, validate and resolve a config; errors name the file and the key."""
    from servesim.simulator.config import load_config, resolve_config
    from servesim.simulator.errors import in_file

    ov = list(overrides or [])
    if seed is not None:
        ov.append(f"workload.seed={seed}")
    cfg = load_config(config, ov)
    with in_file(config):
        return resolve_config(cfg)


OVERWRITE_OPT = typer.Option(False, "--overwrite",
                             help="Replace a previous run's output folder (one holding "
                             "run_info.json; default: refuse a non-empty folder)")
JSON_OPT = typer.Option(False, "--json", help="Print the result as JSON instead of a table")


def run(
    config: Path = CONFIG_ARG,
    output_dir: Path | None = typer.Option(  # noqa: B008  (typer's idiom)
        None, "-o", "--output-dir",
        help="Run directory (default results/<config-stem>-<UTC timestamp>); must be new or "
             "empty unless --overwrite"),
    overrides: list[str] | None = SET_OPT,
    seed: int | None = typer.Option(None, "--seed", help="Workload seed (vllm bench --seed)"),
    overwrite: bool = OVERWRITE_OPT,
    as_json: bool = JSON_OPT,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors"),
    formats: list[str] | None = typer.Option(  # noqa: B008
        None, "--format", help="Also write the run as a benchmark client would: "
        "inference-perf, guidellm, aiperf (repeatable or comma-separated)"),
) -> None:
    """Simulate one experiment and write result.json, requests.csv, timeseries.csv.

    The run folder is checked (writable, new or empty) before simulating and appears complete
    or not at all; Ctrl-C leaves it as it was."""
    from servesim.reports.writers import (
        REQUESTS_FILE,
        OutputDir,
        RequestsCsvStream,
        write_result,
        write_run,
    )
    from servesim.simulator.errors import Interrupted, in_file
    from servesim.simulator.runner import run_experiment

    fmts = [f.strip() for item in formats or [] for f in item.split(",") if f.strip()]
    if fmts:
        from servesim.reports.client_export import FORMATS
        from servesim.simulator.errors import ServesimError

        bad = [f for f in fmts if f not in FORMATS]
        if bad:
            raise ServesimError(f"--format: {bad[0]!r} is not one of {', '.join(FORMATS)}")
    cfg = load(config, overrides, seed)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    outdir = output_dir or Path("results") / f"{Path(config).stem}-{stamp}"
    out = OutputDir(outdir, overwrite=overwrite, what="run", keep=(Path(config),))
    result = bench = None
    # requests.csv and timeseries.csv written meanwhile (None where it cannot fork)
    stream = RequestsCsvStream.start(out.file(REQUESTS_FILE), cfg.output.timeseries_interval_s)
    try:
        with in_file(config):
            result = run_experiment(cfg, resolved=True, spool_dir=str(out.staging.parent),
                                    request_sink=stream)
        bench = write_run(result, out, formats=fmts, requests_stream=stream)
        if as_json:  # streamed window by window (per-request lists of a large run)
            write_result(sys.stdout, bench)
            return
    except KeyboardInterrupt:
        out.discard()
        if bench is not None:
            raise Interrupted(f"the run was written to {outdir}") from None
        raise Interrupted(f"nothing was written to {outdir} (a run folder appears only when "
                          "complete)") from None
    finally:
        if stream is not None:
            stream.close()
        out.discard()
        if result is not None:
            result.close()
    if not quiet:
        from rich.console import Console
        from servesim.reports.console import print_summary

        console = Console()
        print_summary(bench, console)
        console.print(f"Wrote {outdir}/result.json, requests.csv, timeseries.csv, "
                      "config.resolved.yaml", markup=False, highlight=False, soft_wrap=True)


def validate(
    config: Path = CONFIG_ARG,
    overrides: list[str] | None = SET_OPT,
) -> None:
    """Print the resolved config and the derived capacity, as vLLM logs it at start-up;
    exit 2 when the config cannot run."""
    from servesim.costmodels import plan_memory
    from servesim.simulator.errors import in_file

    cfg = load(config, overrides)
    with in_file(config):
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
