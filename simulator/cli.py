"""The ``simulate`` command line (one typer app).

Each concern registers its own subcommands (``costmodels.cli``, ``kernels.cli``,
``workloads.cli``, ``reports.cli``, ``simulator.experiments.cli``); heavy imports (torch, matplotlib,
ray) happen inside the commands so ``simulate --help`` stays fast.

Errors: a :class:`~servesim.simulator.errors.ServesimError` is printed as one line on stderr
and exits with code 2; ``--debug`` (anywhere on the line) shows the traceback instead.
"""

from __future__ import annotations

import sys
import warnings
from importlib import metadata

import typer

app = typer.Typer(
    name="simulate",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="servesim: discrete-event simulator and capacity planner for vLLM-style LLM serving.",
)


def version() -> str:
    try:
        return metadata.version("servesim")
    except metadata.PackageNotFoundError:  # running from a source tree without install
        return "0+unknown"


def _version_cb(value: bool) -> None:
    if value:
        typer.echo(f"servesim {version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", callback=_version_cb, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """servesim: simulate vLLM serving, plan capacity, A/B scheduler and KV-cache policies."""


def _register_all() -> None:
    from servesim.costmodels import cli as costmodels_cli
    from servesim.kernels import cli as kernels_cli
    from servesim.reports import cli as reports_cli
    from servesim.simulator import run_cli
    from servesim.simulator.experiments import cli as experiments_cli
    from servesim.workloads import cli as workloads_cli

    for mod in (run_cli, costmodels_cli, workloads_cli, kernels_cli, experiments_cli,
                reports_cli):
        mod.register(app)


_register_all()


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, turning user errors into one line + exit 2."""
    from servesim.simulator.errors import ServesimError

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    # Warnings (e.g. "no calibration file for this GPU") are one line each; --quiet drops them.
    warnings.formatwarning = lambda msg, *a, **k: f"warning: {msg}\n"
    if "--quiet" in args or "-q" in args:
        warnings.simplefilter("ignore")
    try:
        app(args=args, prog_name="simulate", standalone_mode=False)
    except ServesimError as e:
        if debug:
            raise
        typer.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # usage errors (typer's vendored click) and the like
        if hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):
            e.show()
            sys.exit(e.exit_code)
        if debug:
            raise
        typer.echo(f"internal error: {type(e).__name__}: {e} (re-run with --debug for details)",
                   err=True)
        sys.exit(1)
