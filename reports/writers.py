"""The run directory: ``result.json``, ``run_info.json``, ``requests.csv``, ``timeseries.csv``,
``config.resolved.yaml``.

Every file is written atomically (temp file in the same folder + ``os.replace``) and
deterministically: the same :class:`RunResult` gives byte-identical files, except ``date`` in
``result.json`` and the whole of ``run_info.json`` (host timings: ``wall_seconds``,
``sim_speed``, and ``date``).

``result.json`` holds the same keys as vLLM's ``json.dump(result_json, f)``, in the same order;
it is laid out one top-level key per line (values compact) for readability — vLLM's readers
(``json.load``, pandas, ``vllm bench sweep plot``) do not care about whitespace.

CSV cells: floats as Python ``repr`` (shortest round-trip, deterministic), NaN/inf as an empty
cell, integers as integers, booleans ``True``/``False`` (as pandas writes them).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from servesim.reports.bench_result import VOLATILE_KEYS, compute_bench_result
from servesim.simulator.metrics import REQUEST_COLUMNS, STEP_COLUMNS, RunResult

RESULT_FILE = "result.json"
RUN_INFO_FILE = "run_info.json"
REQUESTS_FILE = "requests.csv"
TIMESERIES_FILE = "timeseries.csv"
CONFIG_FILE = "config.resolved.yaml"


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8, ``\\n`` line ends) to ``path`` via a temp file + ``os.replace``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def dumps_result(bench: dict) -> str:
    """JSON text of a bench dict: one top-level key per line, in dict order; no NaN allowed."""
    lines = [
        f"  {json.dumps(k)}: {json.dumps(v, allow_nan=False, separators=(', ', ': '))}"
        for k, v in bench.items()
    ]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _cells(values: Any) -> list[str]:
    """One column → CSV cell strings (see module docstring)."""
    a = np.asarray(values)
    if a.dtype.kind == "f":
        cells = list(map(float.__repr__, a.astype(float).tolist()))
        for i in np.flatnonzero(~np.isfinite(a)).tolist():
            cells[i] = ""
        return cells
    if a.dtype.kind in "iub":
        return list(map(str, a.tolist()))
    out = []
    for v in a.tolist():
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            out.append("")
        elif isinstance(v, float):
            out.append(repr(v))
        else:
            out.append(str(v))
    return out


def columns_csv(columns: dict[str, Any], order: Sequence[str], what: str) -> str:
    """CSV text of ``columns`` with ``order`` first, then any other columns in dict order."""
    missing = [c for c in order if c not in columns]
    if missing:
        raise ValueError(f"RunResult.{what} lacks column(s) {', '.join(missing)}")
    names = list(order) + [c for c in columns if c not in order]
    cols = [_cells(columns[c]) for c in names]
    lengths = {len(c) for c in cols}
    if len(lengths) > 1:
        raise ValueError(f"RunResult.{what}: columns have different lengths {sorted(lengths)}")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(names)
    w.writerows(zip(*cols) if cols else ())
    return buf.getvalue()


def write_run(result: RunResult, outdir: str | Path, *, date: str | None = None) -> dict:
    """Write a run directory; returns the full bench dict (``compute_bench_result``).

    Files: ``result.json`` (vLLM bench keys + deterministic extras), ``run_info.json`` (``date``,
    ``wall_seconds``, ``sim_speed``, ``servesim_version``, ``config_hash``), ``requests.csv``
    (``REQUEST_COLUMNS`` then extra columns such as ``send_s``), ``timeseries.csv``
    (``STEP_COLUMNS`` then extras), ``config.resolved.yaml``.
    """
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    bench = compute_bench_result(result, date=date)
    stable = {k: v for k, v in bench.items() if k not in VOLATILE_KEYS}
    info = {
        "date": bench["date"],
        **{k: bench.get(k) for k in VOLATILE_KEYS},
        "servesim_version": bench.get("servesim_version"),
        "config_hash": bench.get("config_hash"),
    }
    requests_csv = columns_csv(result.requests, REQUEST_COLUMNS, "requests")
    atomic_write_text(out / REQUESTS_FILE, requests_csv)
    steps = result.steps or {c: np.empty(0) for c in STEP_COLUMNS}
    atomic_write_text(out / TIMESERIES_FILE, columns_csv(steps, STEP_COLUMNS, "steps"))
    atomic_write_text(out / CONFIG_FILE, result.config.to_yaml())
    atomic_write_text(out / RUN_INFO_FILE, json.dumps(info, indent=2, allow_nan=False) + "\n")
    atomic_write_text(out / RESULT_FILE, dumps_result(stable))  # last: marks a complete run
    return bench
