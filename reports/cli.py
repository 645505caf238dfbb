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

