"""``simulate sweep`` (a grid of points) and ``simulate plan`` (an adaptive search over points),
registered on the app by simulator/cli.py. Both share the experiment options and what Ctrl-C
does: kill the workers, keep every point written so far, print one line with the resume
command, exit 130."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

Output = Annotated[Path, typer.Option("-o", "--output", help="Output folder.")]
Jobs = Annotated[int | None, typer.Option("--jobs", "-j", help="Parallel simulations "
                                          "(default: number of cores).")]
Backend = Annotated[str, typer.Option("--backend", help="local (worker processes) or ray "
                                      "(a Ray cluster: --ray-address, else RAY_ADDRESS, else "
                                      "a local Ray with --jobs CPUs).")]
RayAddress = Annotated[str | None, typer.Option("--ray-address", metavar="ADDR",
                                                help="Ray cluster to run on (its head's "
                                                "host:port); servesim must be installed on "
                                                "its nodes.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")]


def _interruptible(argv: list[str], run: Callable[[], Any]) -> Any:
    """``run()``; on Ctrl-C print what was kept and how to resume, and exit 130."""
    from servesim.simulator.experiments import Interrupted

    try:
        return run()
    except Interrupted as e:
        cmd = " ".join(["simulate", *map(shlex.quote, argv)])
        cmd += "" if "--resume" in argv else " --resume"
        typer.echo(e.describe(cmd), err=True)
        raise SystemExit(130) from None


def _argv(command: str, spec: Path, output: Path, jobs: int | None, backend: str,
          ray_address: str | None) -> list[str]:
    """The command line that reruns this experiment (for the resume hint)."""
    argv = [command, str(spec), "-o", str(output)]
    if jobs is not None:
        argv += ["--jobs", str(jobs)]
    if backend != "local":
        argv += ["--backend", backend]
    if ray_address:
        argv += ["--ray-address", ray_address]
    return argv


def _fresh_output(output: Path, spec_file: Path, overwrite: bool) -> None:
    """Refuse a non-empty ``output`` (another run's or plan's files would stay beside the new
    ones); with ``overwrite`` clear it first, unless it holds the spec file or the working
    directory."""
    import shutil

    from servesim.reports.writers import holds_files
    from servesim.simulator.errors import ConfigError

    if not holds_files(output, overwrite, "plan output",
                       "pass --resume to continue the plan written there, --overwrite to "
                       "replace it"):
        return
    out = output.resolve()
    for inside, what in ((spec_file.resolve(), "the plan file"), (Path.cwd().resolve(),
                                                                 "the working directory")):
        if inside == out or out in inside.parents:
            raise ConfigError(f"{output}: holds {what}; --overwrite will not clear it, "
                              "choose another -o")
    shutil.rmtree(output)


def register(app: typer.Typer) -> None:
    """Add ``simulate sweep`` and ``simulate plan`` to ``app``."""

    @app.command("sweep")
    def sweep(
        spec_file: Annotated[Path, typer.Argument(metavar="SWEEP.yaml", help="Sweep spec file.")],
        output: Annotated[Path, typer.Option("-o", "--output", help="Output folder (results "
                                             "go to OUTPUT/<experiment_name>/).")],
        jobs: Jobs = None,
        backend: Backend = "local",
        ray_address: RayAddress = None,
        resume: Annotated[bool, typer.Option("--resume", help="Skip points already "
                                             "written.")] = False,
        method: Annotated[str, typer.Option("--ci", help="A/B interval: t or "
                                            "bootstrap.")] = "t",
        as_json: Annotated[bool, typer.Option("--json", help="Print the outcome (summary "
                                              "rows, A/B rows) as JSON instead of "
                                              "tables.")] = False,
        quiet: Quiet = False,
    ) -> None:
        """Run arms x request rates x seeds; write the vllm bench sweep layout and A/B stats."""
        from rich.console import Console
        from rich.markup import escape
        from servesim.reports.ab import ab_rich_table
        from servesim.simulator.errors import ConfigError
        from servesim.simulator.experiments.executors import check_options
        from servesim.simulator.sweep import load_spec, run_sweep

        check_options(backend, jobs)
        if method not in ("t", "bootstrap"):
            raise ConfigError(f"--ci {method}: expected t or bootstrap")
        spec = load_spec(spec_file)
        console = Console()
        quiet = quiet or as_json
        if not quiet:
            if spec.profile_sweep is not None:  # its rates come from its first two points
                size = spec.profile_sweep["sweep_size"]
                loads = (f"a GuideLLM sweep of {size} (synchronous, throughput, {size - 2} "
                         "rates between)")
            else:
                size, loads = len(spec.rates), f"{len(spec.rates)} rate(s)"
            n = len(spec.arms) * size * len(spec.seeds)
            console.print(f"sweep [bold]{spec.experiment_name}[/]: {len(spec.arms)} arm(s) x "
                          f"{loads} x {len(spec.seeds)} seed(s) = {n} points, "
                          f"backend {backend}", highlight=False)
        argv = _argv("sweep", spec_file, output, jobs, backend, ray_address)
        out = _interruptible(argv, lambda: run_sweep(
            spec, output, jobs=jobs, backend=backend, ray_address=ray_address, resume=resume,
            progress=not quiet, ab_method=method))
        if as_json:
            import dataclasses
            import json

            typer.echo(json.dumps(dataclasses.asdict(out), indent=2, default=str))
            if out.num_failed:
                raise typer.Exit(1)
            return
        if out.ab_rows:
            console.print(ab_rich_table(out.ab_rows))
            console.print(f"all metrics: {out.exp_dir / 'ab.csv'}", highlight=False)
        console.print(
            f"{out.num_run} point(s) run, {out.num_skipped} skipped (already done), "
            f"{out.num_failed} failed, in {out.wall_seconds:.1f} s -> {out.exp_dir}",
            highlight=False)
        for path, err in out.failures[:10]:
            console.print("[red]failed[/] " + escape(f"{path}: {err}"), highlight=False,
                          soft_wrap=True)
        if out.ab_note:
            console.print(f"warning: {out.ab_note}", highlight=False, markup=False,
                          soft_wrap=True)
        if out.num_failed:
            raise typer.Exit(1)

    @app.command("plan")
    def plan(
        plan_file: Annotated[Path, typer.Argument(metavar="PLAN.yaml", help="Plan file "
                                                  "(see configs/plans/).")],
        output: Output,
        jobs: Jobs = None,
        backend: Backend = "local",
        ray_address: RayAddress = None,
        resume: Annotated[bool, typer.Option("--resume", help="Reuse points already "
                                             "simulated in OUTPUT/points/.")] = False,
        overwrite: Annotated[bool, typer.Option("--overwrite", help="Clear a non-empty "
                                                "OUTPUT first (default: refuse).")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print plan.json instead of "
                                              "the table.")] = False,
        quiet: Quiet = False,
    ) -> None:
        """Find, per candidate deployment, the max request rate per replica within the SLO;
        size and price it for the target rate; write plan.csv, plan.json, report.md/html.

        OUTPUT must be new or empty, unless --resume (continue the plan written there) or
        --overwrite (clear it first)."""
        from rich.console import Console
        from servesim.reports.plan import print_plan
        from servesim.simulator.errors import ConfigError
        from servesim.simulator.experiments.executors import check_options
        from servesim.simulator.plan import load_plan
        from servesim.simulator.plan.runner import run_plan

        n_jobs = check_options(backend, jobs)
        if resume and overwrite:
            raise ConfigError("--resume and --overwrite: conflicting options (--resume continues "
                              "the plan in OUTPUT, --overwrite clears it); pass one")
        spec, plan_dir = load_plan(plan_file)
        if not resume:
            _fresh_output(output, plan_file, overwrite)
        console = Console(stderr=True)
        log = (lambda s: None) if quiet else (lambda s: console.print(s, highlight=False))
        argv = _argv("plan", plan_file, output, jobs, backend, ray_address)
        res = _interruptible(argv, lambda: run_plan(
            spec, plan_dir, output, jobs=n_jobs, backend=backend, ray_address=ray_address,
            resume=resume, quiet=quiet or as_json, log=log, source=str(plan_file)))
        if as_json:
            import json

            typer.echo(json.dumps(res, indent=2, default=str))
            return
        print_plan(res, output, quiet)
