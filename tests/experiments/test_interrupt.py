"""Ctrl-C and SIGKILL during a sweep and a plan, on the real simulator with 2 worker processes.

Ctrl-C (SIGINT to the process group, as a terminal sends it) exits 130 with one line naming the
points kept and the resume command. After Ctrl-C or a SIGKILL of the driver, no process it
started is alive 5 s later. ``--resume`` then completes with outputs identical to an
uninterrupted run (run files up to their ``date``; summaries, A/B and plan tables byte for
byte)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
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
    """Run ``simulate ARGV`` until 3 points are written, send ``sig``; return (exit code,
    stderr) once every process it started is gone (at most 5 s after it ended)."""
    err = tmp_path / f"stderr.{sig}"
    with open(err, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", ("from servesim.simulator.cli import "
                                 "main; main()"), *argv], stdout=subprocess.DEVNULL, stderr=f,
                                start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list(folder.glob("SERVE-*/run=*.json"))) >= 3:
            break
        time.sleep(0.02)
    started = _children(proc.pid)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole process group
    else:
        os.kill(proc.pid, sig)  # only the driver: its workers must notice by themselves
    rc = proc.wait(timeout=60)
    assert rc != 0, "the experiment finished before it could be interrupted"
    assert len(started) >= 2, f"expected worker processes, found {started}"
    end = time.monotonic() + 5
    while _alive(started) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _alive(started), "worker processes outlived the driver by 5 s"
    return rc, err.read_text()


def _no_date(p: Path) -> dict:
    return {k: v for k, v in json.loads(p.read_text()).items() if k != "date"}


def _same_tree(a: Path, b: Path, files: tuple[str, ...]) -> None:
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    runs = sorted(p.relative_to(a) for p in a.glob("SERVE-*/run=*.json"))
    assert runs == sorted(p.relative_to(b) for p in b.glob("SERVE-*/run=*.json"))
    for rel in runs:
        assert _no_date(a / rel) == _no_date(b / rel), rel
    assert not list(b.rglob("*.tmp"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_sweep_interrupted_then_resumed(sweep_file, sweep_reference, tmp_path, sig):
    out = tmp_path / "out"
    argv = ["sweep", str(sweep_file), "-o", str(out), "--jobs", "2", "--quiet"]
    rc, err = _interrupt(argv, out / "kill", sig, tmp_path)
    kept = sum(1 for _ in (out / "kill").glob("SERVE-*/run=*.json"))
    if sig == signal.SIGINT:
        assert rc == 130
        assert err.splitlines() == [
            (f"interrupted: {kept} of 12 point(s) kept in {out / 'kill'}; resume with: "
            f"simulate sweep {sweep_file} -o {out} --jobs 2 --resume")]
    else:
        assert rc == -signal.SIGKILL
    assert 3 <= kept < 12
    main([*argv, "--resume"])
    _same_tree(sweep_reference, out / "kill", ("summary.csv", "ab.csv"))


def _plan_json(d: Path) -> dict:
    return {k: v for k, v in json.loads((d / "plan.json").read_text()).items()
            if k not in ("wall_seconds", "jobs")}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_plan_interrupted_then_resumed(plan_file, plan_reference, tmp_path, sig):
    out = tmp_path / "out"
    argv = ["plan", str(plan_file), "-o", str(out), "--jobs", "2", "--quiet"]
    rc, err = _interrupt(argv, out / "points", sig, tmp_path)
    kept = sum(1 for _ in (out / "points").glob("SERVE-*/run=*.json"))
    if sig == signal.SIGINT:
        assert rc == 130
        assert err.splitlines() == [
            (f"interrupted: {kept} point(s) kept in {out / 'points'}; resume with: "
            f"simulate plan {plan_file} -o {out} --jobs 2 --resume")]
    else:
        assert rc == -signal.SIGKILL
    assert kept >= 3 and not (out / "plan.csv").exists()
    main([*argv, "--resume"])
    assert (out / "plan.csv").read_bytes() == (plan_reference / "plan.csv").read_bytes()
    assert _plan_json(out) == _plan_json(plan_reference)
    _same_tree(plan_reference / "points", out / "points", ("summary.csv",))
