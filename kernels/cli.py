"""``simulate calibrate [--gpu NAME] [-o FILE] [--quick] [--dry-run]``,
``simulate calibrate report FILE``, ``simulate calibrate check FILE`` and
``simulate calibrate import aiconfigurator --gpu NAME`` (registered on the ``simulate`` app by
simulator/cli.py).

torch and Triton are imported only inside the GPU run, so ``--help``, ``--dry-run``,
``report``, ``check`` and ``import`` work on a laptop without them (``import`` needs the
``servesim[aiconfigurator]`` extra).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

HELP = ("Time GEMM, attention, MoE (and with >= 2 GPUs all-reduce) kernels on this GPU over "
        "shapes from the model catalog and write <user calibration dir>/<gpu>.yaml (it takes "
        "precedence over the shipped configs/calibration/<gpu>.json).")


def register(app: typer.Typer) -> None:
    """Add this concern's commands to ``app``."""
    cal = typer.Typer(invoke_without_command=True, no_args_is_help=False, help=HELP)

    @cal.callback()
    def calibrate(
        ctx: typer.Context,
        gpu: Annotated[str | None, typer.Option(
            "--gpu", help="Hardware catalog name, e.g. h100-sxm.")] = None,
        output: Annotated[Path | None, typer.Option(
            "-o", "--output", help="Output file (default: $SERVESIM_CALIBRATION_DIR/GPU.yaml, "
            "~/.config/servesim/calibration/GPU.yaml).")] = None,
        quick: Annotated[bool, typer.Option(
            "--quick", help="Smaller grid (80 s on an H100 or H200).")] = False,
        dry_run: Annotated[bool, typer.Option(
            "--dry-run", help="Print the plan and its estimated duration; no GPU.")] = False,
        quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar.")] = False,
        time_limit: Annotated[float | None, typer.Option(
            "--time-limit", min=1, help="Seconds: start no kernel after this and write what "
            "was measured to GPU.partial.yaml (Ctrl-C also keeps it there).")] = None,
    ) -> None:
        """Run the GPU calibration (see also: simulate calibrate report FILE)."""
        if ctx.invoked_subcommand is not None:
            return
        from servesim.kernels import calibrate as C
        from servesim.simulator.errors import ServesimError

        if not gpu:
            raise ServesimError("simulate calibrate: --gpu NAME is required (a configs/hardware "
                                "name, e.g. h100-sxm); or: simulate calibrate report FILE")
        plan = C.build_plan(gpu, quick)  # (an unknown --gpu name fails here, on any machine)
        if dry_run:
            typer.echo(C.format_plan(plan, C.estimate_plan(plan)))
            return
        from servesim.costmodels.calibration import user_calibration_dir
        from servesim.kernels.calibration_file import check_output_file

        out = output or user_calibration_dir() / f"{gpu}.yaml"
        check_output_file(out, f"{gpu}.yaml")  # before minutes of measuring, not after
        C.require_gpu()
        path = C.run_calibration(gpu, out, quick, progress=None if quiet else _progress,
                                 log=(lambda *_: None) if quiet else typer.echo,
                                 time_limit=time_limit)
        if path.name.endswith(f".partial{path.suffix}"):  # (also under --quiet)
            typer.echo(f"partial: {C.read_calibration(path)['source']['partial']}; point "
                       "hardware.calibration at the file to use it", err=True)
        typer.echo(f"wrote {path}")
        if not quiet:
            for line in C.yielded_families(path, gpu):
                typer.echo(line)

    @cal.command("report")
    def report(
        file: Annotated[Path, typer.Argument(help="A calibration YAML file.")],
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        """Kernel quality from a calibration file: Triton vs vendor GEMM, decode bandwidth and
        prefill FLOP/s as % of the spec peaks."""
        from servesim.kernels import calibrate as C

        doc = C.read_calibration(file)
        if as_json:
            import json

            from servesim.kernels.calibration_report import report_data

            typer.echo(json.dumps(report_data(doc), indent=2, default=str))
            return
        typer.echo("\n".join(C.report_lines(doc)))

    @cal.command("check")
    def check(
        file: Annotated[Path, typer.Argument(help="A calibration YAML file.")],
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        """How well the cost model reproduces the file's own rows, per op family: median and
        P90 |error| at the measured points and with each point left out of its curve."""
        from servesim.kernels import calibrate as C

        res = C.check_file(file)
        if as_json:
            import json

            typer.echo(json.dumps(res, indent=2))
            return
        typer.echo("\n".join(C.check_lines(file, res)))

    imp = typer.Typer(no_args_is_help=True, help="Import measured kernel tables from a "
                      "public database into a calibration file.")

    @imp.command("aiconfigurator")
    def import_aiconfigurator(
        gpu: Annotated[str, typer.Option(
            "--gpu", help="GPU: our name (h100-sxm) or theirs (h100_sxm), or 'all'.")],
        vllm_version: Annotated[str | None, typer.Option(
            "--vllm-version", help="vLLM version of the tables (default: the newest per "
            "table; tables without it use the newest).")] = None,
        output: Annotated[Path | None, typer.Option(
            "-o", "--output", help="Output file, .json (fast to load) or .yaml (a folder "
            "with --gpu all); default configs/calibration/GPU.json.")] = None,
        data_dir: Annotated[Path | None, typer.Option(
            "--data-dir", help="aiconfigurator_core/systems/data folder (default: the "
            "installed aiconfigurator-core package).")] = None,
        all_shapes: Annotated[bool, typer.Option(
            "--all-shapes", help="Keep every curve, not only those the model catalog reads "
            "(files grow ~12x).")] = False,
    ) -> None:
        """Convert aiconfigurator-core's vLLM kernel tables (measured by NVIDIA, Apache-2.0)
        for one GPU into a calibration file."""
        from servesim.kernels import calibrate as C
        from servesim.kernels import import_aiconfigurator as A

        gpus = list(A.GPU_MAP.values()) if gpu == "all" else [A.system_name(gpu)[1]]
        for g in gpus:
            doc = A.import_tables(g, vllm_version=vllm_version, data_dir=data_dir,
                                  all_shapes=all_shapes, log=lambda m: typer.echo(m, err=True))
            if output is None:
                out = C.CONFIGS_DIR / "calibration" / f"{g}.json"
            else:
                out = output / f"{g}.json" if gpu == "all" else output
            path = C.write_calibration(doc, out)
            kept = ", ".join(f"{f} {t['points']} pts (vLLM {t['vllm']})"
                             for f, t in doc["tables"].items())
            typer.echo(f"wrote {path}: {kept}")

    cal.add_typer(imp, name="import")
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
