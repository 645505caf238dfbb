"""Subcommands of this concern (registered on the ``simulate`` app by simulator/cli.py)."""

import typer


def register(app: typer.Typer) -> None:
    """Add this concern's commands to ``app``."""
