"""``simulate sweep``: run a sweep / A/B file (registered on the app by simulator/cli.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add ``simulate sweep`` to ``app``."""

    @app.command("sweep")
    def sweep(
        spec_file: Annotated[Path, typer.Argument(metavar="SWEEP.yaml", help="Sweep spec file.")],
        output: Annotated[Path, typer.Option("-o", "--output", help="Output folder (results "
                                             "go to OUTPUT/<experiment_name>/).")],
        jobs: Annotated[int | None, typer.Option("--jobs", "-j", help="Parallel points "
                                                 "(default: number of cores).")] = None,
        backend: Annotated[str, typer.Option("--backend", help="local (processes) or ray "
                                             "(RAY_ADDRESS if set, else a local Ray).")] = "local",
        resume: Annotated[bool, typer.Option("--resume", help="Skip points already "
                                             "written.")] = False,
        method: Annotated[str, typer.Option("--ci", help="A/B interval: t or "
                                            "bootstrap.")] = "t",
        quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    ) -> None:
        """Run arms x request rates x seeds; write the vllm bench sweep layout and A/B stats."""
        from rich.console import Console
        from servesim.reports.ab import ab_rich_table, paired_ab, write_ab_csv
        from servesim.simulator.errors import ConfigError
        from servesim.simulator.sweep import load_spec, run_sweep

        if backend not in ("local", "ray"):
            raise ConfigError(f"--backend {backend}: expected local or ray")
        if method not in ("t", "bootstrap"):
            raise ConfigError(f"--ci {method}: expected t or bootstrap")
        if jobs is not None and jobs < 1:
            raise ConfigError(f"--jobs {jobs}: expected a positive integer")
        spec = load_spec(spec_file)
        console = Console()
        n = len(spec.points())
        if not quiet:
            console.print(f"sweep [bold]{spec.experiment_name}[/]: {len(spec.arms)} arm(s) x "
                          f"{len(spec.rates)} rate(s) x {len(spec.seeds)} seed(s) = {n} points, "
                          f"backend {backend}", highlight=False)
        out = run_sweep(spec, output, jobs=jobs, backend=backend, resume=resume,
                        progress=not quiet)
        ab_rows = out.ab_rows
        if method != "t" and len(spec.arms) > 1 and out.rows:
            ab_rows = paired_ab(out.rows, baseline=spec.baseline, method=method)
            write_ab_csv(ab_rows, out.exp_dir / "ab.csv")
        if ab_rows:
            console.print(ab_rich_table(ab_rows))
            console.print(f"all metrics: {out.exp_dir / 'ab.csv'}", highlight=False)
        console.print(
            f"{out.num_run} point(s) run, {out.num_skipped} skipped (already done), "
            f"{out.num_failed} failed, in {out.wall_seconds:.1f} s -> {out.exp_dir}",
            highlight=False)
        for path, err in out.failures[:10]:
            console.print(f"[red]failed[/] {path}: {err}", highlight=False)
        if out.num_failed:
            raise typer.Exit(1)
