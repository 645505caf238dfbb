"""``simulate calibrate [--gpu NAME] [-o FILE] [--quick] [--dry-run]`` and
``simulate calibrate report FILE`` (registered on the ``simulate`` app by simulator/cli.py).

torch and Triton are imported only inside the GPU run, so ``--help``, ``--dry-run`` and
``report`` work on a laptop without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

HELP = ("Time the Triton kernels and the vendor path on this GPU over shapes from the model "
        "catalog and write configs/calibration/<gpu>.yaml.")


def register(app: typer.Typer) -> None:
    """Add this concern's commands to ``app``."""
    cal = typer.Typer(invoke_without_command=True, no_args_is_help=False, help=HELP)

    @cal.callback()
    def calibrate(
        ctx: typer.Context,
        gpu: Annotated[str | None, typer.Option(
            "--gpu", help="Hardware catalog name, e.g. h100-sxm.")] = None,
        output: Annotated[Path | None, typer.Option(
            "-o", "--output", help="Output file (default: configs/calibration/GPU.yaml).")] = None,
        quick: Annotated[bool, typer.Option(
            "--quick", help="Smaller grid (< 5 min on an H100).")] = False,
        dry_run: Annotated[bool, typer.Option(
            "--dry-run", help="Print the plan and its estimated duration; no GPU.")] = False,
        quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar.")] = False,
    ) -> None:
        """Run the GPU calibration (see also: simulate calibrate report FILE)."""
        if ctx.invoked_subcommand is not None:
            return
        from servesim.kernels import calibrate as C
        from servesim.simulator.errors import ServesimError

        if not gpu:
            raise ServesimError("simulate calibrate: --gpu NAME is required (a configs/hardware "
                                "name, e.g. h100-sxm); or: simulate calibrate report FILE")
        if dry_run:
            plan = C.build_plan(gpu, quick)
            typer.echo(C.format_plan(plan, C.estimate_plan(plan)))
            return
        C.require_gpu()
        out = output or C.CONFIGS_DIR / "calibration" / f"{gpu}.yaml"
        path = C.run_calibration(gpu, out, quick, progress=None if quiet else _progress,
                                 log=(lambda *_: None) if quiet else typer.echo)
        typer.echo(f"wrote {path}")

    @cal.command("report")
    def report(file: Annotated[Path, typer.Argument(help="A calibration YAML file.")]) -> None:
        """Kernel quality from a calibration file: Triton vs vendor GEMM, decode bandwidth and
        prefill FLOP/s as % of the spec peaks."""
        from servesim.kernels import calibrate as C

        typer.echo("\n".join(C.report_lines(C.read_calibration(file))))

    app.add_typer(cal, name="calibrate")


def _progress(total: int):
    """A rich progress bar; returns the per-shape ``advance`` callback."""
    from rich.progress import Progress

    bar = Progress(transient=True)
    bar.start()
    task = bar.add_task("calibrating", total=total)
    done = [0]

    def advance() -> None:
        bar.advance(task)
        done[0] += 1
        if done[0] >= total:
            bar.stop()

    return advance
