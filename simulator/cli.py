"""The ``simulate`` command line (one typer app).

Each concern registers its own subcommands (``costmodels.cli``, ``kernels.cli``,
``workloads.cli``, ``reports.cli``, ``simulator.experiments.cli``); heavy imports (torch, matplotlib,
ray) happen inside the commands so ``simulate --help`` stays fast.

Errors: a :class:`~servesim.simulator.errors.ServesimError` is printed as one line on stderr
and exits with code 2; ``--debug`` (anywhere on the line) shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import warnings

import typer

_app = typer.Typer(
    name="simulate",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="servesim: discrete-event simulator and capacity planner for vLLM-style LLM serving.",
)


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("servesim")
    except metadata.PackageNotFoundError:  # running from a source tree without install
        return "0+unknown"


def _version_cb(value: bool) -> None:
    if value:
        typer.echo(f"servesim {version()}")
        raise typer.Exit()


@_app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", callback=_version_cb, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """servesim: simulate vLLM serving, plan capacity, A/B scheduler and KV-cache policies."""


# Each concern's CLI module and the commands it adds (in help order). A command line naming
# one of them imports only that module (start-up time: ``simulate run`` must not load the
# report, sweep or kernel code); anything else (--help, a typo) registers them all.
_MODULES = {
    "servesim.simulator.run_cli": ("run", "validate"),
    "servesim.simulator.fit_cli": ("fit",),
    "servesim.costmodels.cli": ("estimate",),
    "servesim.workloads.cli": ("trace",),
    "servesim.kernels.cli": ("calibrate",),
    "servesim.simulator.experiments.cli": ("sweep", "plan"),
    "servesim.reports.cli": ("report", "compare"),
}
_registered: set[str] = set()


def _register(modules) -> None:
    import importlib

    for name in modules:
        if name not in _registered:
            _registered.add(name)
            importlib.import_module(name).register(_app)


def _register_all() -> None:
    _register(_MODULES)


def _register_for(args: list[str]) -> None:
    """Register the module of the command ``args`` starts with (all when it names none)."""
    if args and not args[0].startswith("-"):
        for name, cmds in _MODULES.items():
            if args[0] in cmds:
                _register((name,))
                return
    _register_all()


def __getattr__(name: str):
    if name == "app":  # the fully registered app (tests, embedding)
        _register_all()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> None:
    """Console entry point. Exit codes: 0 success; 2 a user error (bad input, usage), printed
    as one line on stderr; 130 interrupted (one line saying what was kept); 1 an internal
    error (one line; ``--debug`` shows the traceback). Returns normally on success."""
    rc = run_cli(argv)
    if _STDOUT_FAILED:  # spare the interpreter's flush of it at exit (a second error)
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (closed at exit)
    if rc:
        sys.exit(rc)


# errno of a failed write to standard output that is the environment's, not servesim's
_STDOUT_ERRNOS = {errno.ENOSPC, errno.EPIPE, errno.EIO, errno.EDQUOT, errno.EFBIG}
_STDOUT_FAILED = False


def run_cli(argv: list[str] | None = None) -> int:
    """Run the app in-process and return the exit code (what ``main`` exits with)."""
    from servesim.simulator import progress
    from servesim.simulator.errors import (
        Interrupted,
        ServesimError,
        install_cli_warnings,
        printable,
    )

    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    quiet = "--quiet" in args or "-q" in args
    saved = warnings.showwarning, warnings.filters[:], os.environ.get("SERVESIM_WARNINGS")
    warned = install_cli_warnings(quiet)
    show = not quiet and sys.stderr.isatty()  # bars are for people, not for logs or pipes
    old_reporter = progress.set_reporter(progress.BarReporter() if show else None)
    old_term = _sigterm_as_interrupt()
    try:
        _register_for(args)
        rc = _app(args=args, prog_name="simulate", standalone_mode=False)
    except Interrupted as e:
        typer.echo(f"interrupted: {printable(e)}", err=True)
        return e.exit_code
    except ServesimError as e:
        if debug:
            raise
        typer.echo(f"error: {printable(e)}", err=True)
        return e.exit_code
    except typer.Exit as e:
        return e.exit_code
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("interrupted: nothing was written", err=True)
        return 130
    except Exception as e:  # usage errors (typer's vendored click) and the like
        if (isinstance(e, OSError) and e.filename is None and e.errno in _STDOUT_ERRNOS
                and not debug):  # standard output failed (a full disk, a closed pipe)
            global _STDOUT_FAILED
            _STDOUT_FAILED = True
            typer.echo(f"error: cannot write the output: {e.strerror or e}", err=True)
            return 2
        if hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int):
            ctx = getattr(e, "ctx", None)
            where = ctx.command_path if ctx is not None else "simulate"
            hint = f" (see {where} --help)" if ctx is not None else ""
            typer.echo(f"error: {where}: {_one_line(e.format_message())}{hint}", err=True)
            return e.exit_code
        if debug:
            raise
        typer.echo(f"internal error: {type(e).__name__}: {_one_line(e)} (re-run with --debug "
                   "for details)", err=True)
        return 1
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        progress.set_reporter(old_reporter)
        warnings.showwarning, warnings.filters[:] = saved[0], saved[1]
        if saved[2] is None:
            os.environ.pop("SERVESIM_WARNINGS", None)
        else:
            os.environ["SERVESIM_WARNINGS"] = saved[2]
        if warned:
            with contextlib.suppress(OSError):
                os.unlink(warned)
    if rc == 130:  # typer turns Ctrl-C into a returned 130
        typer.echo("interrupted: nothing was written", err=True)
    return rc if isinstance(rc, int) else 0


def _sigterm_as_interrupt():
    """SIGTERM → KeyboardInterrupt (same clean-up and exit 130 as Ctrl-C); returns the old
    handler, or None off the main thread (where signals cannot be set)."""
    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return None


def _one_line(e: object) -> str:
    from servesim.simulator.errors import one_line

    return one_line(e, 500)


if __name__ == "__main__":  # python -m servesim.simulator.cli
    main()
