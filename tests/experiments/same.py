"""The results of two runs of one experiment are the same: summaries, A/B and plan tables byte
for byte; point files up to their ``date``; plan.json up to host timings."""

from __future__ import annotations

import json
from pathlib import Path

SWEEP_NAME = "kill"  # experiment_name of conftest.SWEEP


def _no_date(p: Path) -> dict:
    return {k: v for k, v in json.loads(p.read_text()).items() if k != "date"}


def _plan_json(d: Path) -> dict:
    return {k: v for k, v in json.loads((d / "plan.json").read_text()).items()
            if k not in ("wall_seconds", "jobs", "backend")}


def assert_same_results(kind: str, ref: Path, out: Path) -> None:
    """``ref`` and ``out`` are the ``-o`` folders of two runs of the ``kind`` experiment."""
    if kind == "plan":
        assert (out / "plan.csv").read_bytes() == (ref / "plan.csv").read_bytes()
        assert _plan_json(out) == _plan_json(ref)
        ref, out, files = ref / "points", out / "points", ("summary.csv",)
    else:
        ref, out, files = ref / SWEEP_NAME, out / SWEEP_NAME, ("summary.csv", "ab.csv")
    for name in files:
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name
    runs = sorted(p.relative_to(ref) for p in ref.glob("SERVE-*/run=*.json"))
    assert runs and runs == sorted(p.relative_to(out) for p in out.glob("SERVE-*/run=*.json"))
    for rel in runs:
        assert _no_date(out / rel) == _no_date(ref / rel), rel
    assert not list(out.rglob("*.tmp"))
