"""``simulate report`` and ``simulate compare`` (registered on the app by simulator/cli.py).
Heavy imports (matplotlib, pandas) happen inside the commands."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add this concern's commands to ``app``."""

    @app.command("report")
    def report(
        results: Annotated[Path, typer.Argument(metavar="DIR", help="A run folder "
                                                "(result.json), a sweep folder or a plan "
                                                "folder.")],
    ) -> None:
        """Write DIR/report.md (+ PNG figures) and a self-contained DIR/report.html."""
        from servesim.reports.render import write_report
        from servesim.simulator.progress import phase

        with phase("writing the report"):
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
        as_json: Annotated[bool, typer.Option("--json", help="Print the rows as JSON instead "
                                              "of a table.")] = False,
        itl_scale: Annotated[float, typer.Option("--itl-scale", help="Multiply measured ITL "
                                                 "(2 for inference-perf files with SSE-line "
                                                 "timestamps); a finite number > 0.")] = 1.0,
    ) -> None:
        """Per-metric error of the simulation against measured results: vllm bench serve
        JSONs, inference-perf report folders / stage files, GuideLLM benchmarks.json, AIPerf
        and genai-perf profile exports (staged runs are compared stage by stage)."""
        import json
        import math

        from rich.console import Console
        from servesim.reports.compare import (
            check_output,
            compare_files,
            mape,
            rich_table,
            write_csv,
        )
        from servesim.reports.console import print_table
        from servesim.simulator.errors import ServesimError

        if len(files) < 2:
            raise ServesimError("compare: give a simulated and at least one measured JSON")
        if output is not None:  # before comparing: a bad -o must not cost the table
            check_output(output, files)
        rows = compare_files(files, itl_scale=itl_scale)
        if output is not None:
            write_csv(rows, output)
        if as_json:
            clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                      for k, v in r.items()} for r in rows]
            m = mape(rows)
            typer.echo(json.dumps({"rows": clean, "mean_abs_rel_error_pct":
                                   m if math.isfinite(m) else None}, indent=2))
            return
        console = Console()
        print_table(rich_table(rows), console)
        missing = [r["metric"] for r in rows if r["status"] != "ok"]
        m = mape(rows)
        console.print(f"mean |relative error| over {sum(r['status'] == 'ok' for r in rows)} "
                      f"metrics: " + (f"{m:.1f}%" if math.isfinite(m) else "n/a"),
                      highlight=False)
        if missing:
            console.print(f"not compared (missing on one side): {', '.join(sorted(set(missing)))}",
                          highlight=False)
        if output is not None:
            console.print(f"wrote {output}", highlight=False)

