"""Ctrl-C and SIGKILL during a sweep and a plan, on the real simulator with 2 worker processes.

Ctrl-C (SIGINT to the process group, as a terminal sends it) exits 130 with one line naming the
points kept and the resume command. After Ctrl-C or a SIGKILL of the driver, no process it
started is alive 5 s later. ``--resume`` then completes with outputs identical to an
uninterrupted run (run files up to their ``date``; summaries, A/B and plan tables byte for
byte)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from same import SWEEP_NAME, assert_same_results
from servesim.simulator.cli import main

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(),
                                reason="lists worker processes through Linux /proc")

def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out + [g for k in out for g in _children(k)]


def _alive(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            state = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(p)
    return out


def _interrupt(argv: list[str], folder: Path, sig: int, tmp_path: Path) -> tuple[int, str]:
    """Run ``simulate ARGV`` until 2 points are written, send ``sig``; return (exit code,
    stderr) once every process it started is gone (at most 5 s after it ended)."""
    err = tmp_path / f"stderr.{sig}"
    with open(err, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", ("from servesim.simulator.cli import "
                                 "main; main()"), *argv], stdout=subprocess.DEVNULL, stderr=f,
                                start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list(folder.glob("SERVE-*/run=*.json"))) >= 2:
            break
        time.sleep(0.01)
    # Freeze the whole group first, so the run cannot finish between seeing its points and
    # the signal (points take tens of milliseconds); the signal is handled on SIGCONT.
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGSTOP)
    started = _children(proc.pid)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole process group
    else:
        os.kill(proc.pid, sig)  # only the driver: its workers must notice by themselves
    try:
        os.killpg(proc.pid, signal.SIGCONT)
    except ProcessLookupError:  # (the whole group is gone already)
        pass
    rc = proc.wait(timeout=60)
    assert rc != 0, "the experiment finished before it could be interrupted"
    assert len(started) >= 2, f"expected worker processes, found {started}"
    end = time.monotonic() + 5
    while _alive(started) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _alive(started), "worker processes outlived the driver by 5 s"
    return rc, err.read_text()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
@pytest.mark.parametrize("kind", ["sweep", "plan"])
def test_interrupted_then_resumed(kind, sig, request, tmp_path):
    spec_file = request.getfixturevalue(f"{kind}_file")
    out = tmp_path / "out"
    folder, of = (out / SWEEP_NAME, " of 12") if kind == "sweep" else (out / "points", "")
    argv = [kind, str(spec_file), "-o", str(out), "--jobs", "2", "--quiet"]
    rc, err = _interrupt(argv, folder, sig, tmp_path)
    kept = sum(1 for _ in folder.glob("SERVE-*/run=*.json"))
    if sig == signal.SIGINT:
        assert rc == 130
        line = (f"interrupted: {kept}{of} point(s) kept in {folder}; resume with: simulate "
                f"{kind} {spec_file} -o {out} --jobs 2 --resume")
        assert err.splitlines() == [line]
    else:
        assert rc == -signal.SIGKILL
    assert kept >= 2 and not (folder / "summary.csv").exists()
    main([*argv, "--resume"])
    assert_same_results(kind, request.getfixturevalue(f"{kind}_reference"), out)
