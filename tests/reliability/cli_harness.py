"""Run the ``simulate`` CLI in-process and check the reliability contract (issue 16)."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

from servesim.simulator.cli import run_cli


@dataclass
class Outcome:
    rc: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return [ln for ln in self.err.splitlines() if not ln.startswith("warning: ")]


def cli(*args: object) -> Outcome:
    """``simulate ARGS`` in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = run_cli([str(a) for a in args])
    return Outcome(rc, out.getvalue(), err.getvalue())


def check_contract(o: Outcome, *names: str) -> None:
    """Exit 0 or 2; never a traceback; on 2 exactly one ``error: ...`` line on stderr that
    names each of ``names`` (file, key or line)."""
    assert o.rc in (0, 2), (o.rc, o.err)
    assert "Traceback" not in o.err + o.out, o.err
    if o.rc == 2:
        lines = o.err_lines
        assert len(lines) == 1, o.err
        assert lines[0].startswith("error: "), lines
        for n in names:
            assert n in lines[0], (n, lines[0])


def no_partial_output(parent: Path, name: str) -> None:
    """``parent/name`` is either a complete run folder or absent, and no staging or spool
    folder is left beside it."""
    p = parent / name
    if p.exists():
        assert (p / "result.json").is_file(), sorted(x.name for x in p.iterdir())
    left = [x.name for x in parent.iterdir() if x.name.startswith(f".{name}.")
            or x.name.startswith(".servesim-requests-")]
    assert not left, left
