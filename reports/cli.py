"""``simulate plan``, ``simulate report`` and ``simulate compare`` (registered on the app by
simulator/cli.py). Heavy imports (matplotlib, pandas, joblib) happen inside the commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add this concern's commands to ``app``."""

    @app.command("plan")
    def plan(
        plan_file: Annotated[Path, typer.Argument(metavar="PLAN.yaml", help="Plan file "
                                                  "(see configs/plans/).")],
        output: Annotated[Path, typer.Option("-o", "--output", help="Output folder.")],
        jobs: Annotated[int | None, typer.Option("--jobs", "-j", help="Parallel simulations "
                                                 "(default: number of cores).")] = None,
        backend: Annotated[str, typer.Option("--backend", help="local (processes) or "
                                             "ray.")] = "local",
        resume: Annotated[bool, typer.Option("--resume", help="Reuse points already "
                                             "simulated in OUTPUT/points/.")] = False,
        quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
    ) -> None:
        """Find, per candidate deployment, the max request rate per replica within the SLO;
        size and price it for the target rate; write plan.csv, plan.json, report.md/html."""
        import os

        from rich.console import Console
        from servesim.reports.plan import load_plan, run_plan
        from servesim.simulator.errors import ConfigError

        if backend not in ("local", "ray"):
            raise ConfigError(f"--backend {backend}: expected local or ray")
        if jobs is not None and jobs < 1:
            raise ConfigError(f"--jobs {jobs}: expected a positive integer")
        spec, plan_dir = load_plan(plan_file)
        console = Console(stderr=True)
        log = (lambda s: None) if quiet else (lambda s: console.print(s, highlight=False))
        res = run_plan(spec, plan_dir, output, jobs=jobs or os.cpu_count() or 1,
                       backend=backend, resume=resume, quiet=quiet, log=log)
        _print_plan(res, output, quiet)

    @app.command("report")
    def report(
        results: Annotated[Path, typer.Argument(metavar="DIR", help="A run folder "
                                                "(result.json), a sweep folder or a plan "
                                                "folder.")],
    ) -> None:
        """Write DIR/report.md (+ PNG figures) and a self-contained DIR/report.html."""
        from servesim.reports.render import write_report

        md, html = write_report(results)
        typer.echo(f"wrote {md} and {html}")

    @app.command("compare")
    def compare(
        files: Annotated[list[Path], typer.Argument(metavar="SIM.json MEASURED.json [MORE...]",
                                                    help="Simulated result.json file(s) or run "
                                                    "folders, and vllm bench serve "
                                                    "--save-result JSON(s).")],
        output: Annotated[Path | None, typer.Option("-o", "--output", help="Also write the "
                                                    "table as CSV.")] = None,
    ) -> None:
        """Per-metric error of the simulation against measured vllm bench results."""
        from rich.console import Console
        from servesim.reports.compare import compare_files, mape, rich_table, write_csv
        from servesim.simulator.errors import ServesimError

        if len(files) < 2:
            raise ServesimError("compare: give a simulated and at least one measured JSON")
        rows = compare_files(files)
        console = Console()
        console.print(rich_table(rows))
        missing = [r["metric"] for r in rows if r["status"] != "ok"]
        console.print(f"mean |relative error| over {sum(r['status'] == 'ok' for r in rows)} "
                      f"metrics: {mape(rows):.1f}%", highlight=False)
        if missing:
            console.print(f"not compared (missing on one side): {', '.join(sorted(set(missing)))}",
                          highlight=False)
        if output is not None:
            write_csv(rows, output)
            console.print(f"wrote {output}", highlight=False)


def _print_plan(res: dict, output: Path, quiet: bool) -> None:
    import math

    from rich.console import Console
    from rich.table import Table
    from servesim.reports.render import plan_summary

    console = Console()
    if not quiet:
        t = Table(title=f"plan {res['name']}: {res['target_request_rate']:g} req/s, "
                        f"{res['slo_text']}")
        for c in ("#", "candidate", "req/s per replica (95% CI)", "repl", "GPUs", "$/h",
                  "$/1M", "knee", "note"):
            t.add_column(c, justify="left" if c in ("candidate", "note") else "right",
                         no_wrap=c in ("candidate", "req/s per replica (95% CI)"))
        for r in res["candidates"]:
            def g(k, fmt="{:.3g}", r=r):
                v = r.get(k)
                return "" if v is None or (isinstance(v, float) and math.isnan(v)) else \
                    fmt.format(v)
            cap = (f"{g('capacity_rps')} ({g('ci_low')}–{g('ci_high')})"
                   if r.get("fits") and r.get("capacity_rps") else "")
            note = ("skipped" if not r.get("fits") else "no capacity" if not cap else
                    "warning" if r.get("warning") else "")
            t.add_row(g("rank", "{:.0f}"), ("* " if r.get("recommended") else "") +
                      r["candidate"], cap, g("replicas", "{:.0f}"), g("gpus", "{:.0f}"),
                      g("usd_per_hour", "{:.2f}"), g("usd_per_1m_output_tokens", "{:.3f}"),
                      g("utilization_of_knee", "{:.0%}"), note)
        console.print(t)
        for r in res["candidates"]:
            why = r.get("reason") if not r.get("fits") or not r.get("capacity_rps") else \
                r.get("warning")
            if why and isinstance(why, str):
                console.print(f"  {r['candidate']}: {why}", highlight=False)
    console.print(plan_summary(res).replace("**", ""), highlight=False)
    console.print(f"wrote {output}/plan.csv, plan.json, report.md, report.html "
                  f"({res['wall_seconds']:.0f} s)", highlight=False)
