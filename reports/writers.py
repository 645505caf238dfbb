"""The run directory: ``result.json``, ``run_info.json``, ``requests.csv``, ``timeseries.csv``,
``config.resolved.yaml``.

A run folder appears complete or not at all (:class:`OutputDir`: staging folder + rename);
other files are written atomically (temp file in the same folder + ``os.replace``). Both are
deterministic: the same :class:`RunResult` gives byte-identical files, except ``date`` in
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
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np
from servesim.reports.bench_result import VOLATILE_KEYS, PerRequest, compute_bench_result
from servesim.simulator.errors import ServesimError
from servesim.simulator.metrics import REQUEST_COLUMNS, STEP_COLUMNS, RunResult

RESULT_FILE = "result.json"
RUN_INFO_FILE = "run_info.json"
REQUESTS_FILE = "requests.csv"
TIMESERIES_FILE = "timeseries.csv"
CONFIG_FILE = "config.resolved.yaml"


def atomic_write_text(path: str | Path, text: str | bytes) -> None:
    """Write ``text`` (UTF-8, ``\\n`` line ends; or bytes as they are) to ``path`` via a temp
    file + ``os.replace``: readers see the old file or the new one, never half of it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        data = text.encode("utf-8") if isinstance(text, str) else text
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def dumps_result(bench: dict) -> str:
    """JSON text of a bench dict: one top-level key per line, in dict order; no NaN allowed."""
    buf = io.StringIO()
    write_result(buf, bench)
    return buf.getvalue()


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


def write_csv(f, windows: Iterable[dict[str, Any]], order: Sequence[str], what: str) -> int:
    """Write column windows as CSV rows to the text stream ``f`` (header from the first
    window: ``order`` first, then its other columns); returns the number of rows. Same bytes
    as :func:`columns_csv` of the concatenated columns."""
    names: list[str] | None = None
    w = csv.writer(f, lineterminator="\n")
    n = 0
    for columns in windows:
        if names is None:
            missing = [c for c in order if c not in columns]
            if missing:
                raise ValueError(f"RunResult.{what} lacks column(s) {', '.join(missing)}")
            names = list(order) + [c for c in columns if c not in order]
            w.writerow(names)
        cols = [_cells(columns[c]) for c in names]
        lengths = {len(c) for c in cols}
        if len(lengths) > 1:
            raise ValueError(f"RunResult.{what}: columns have different lengths {sorted(lengths)}")
        w.writerows(zip(*cols) if cols else ())
        n += len(cols[0]) if cols else 0
    if names is None:
        w.writerow(order)
    return n


def _row_windows(columns: dict[str, Any], rows: int = 65_536):
    """``columns`` in windows of ``rows`` rows (one window when shorter or empty)."""
    n = max((len(v) for v in columns.values()), default=0)
    for lo in range(0, max(n, 1), rows):
        yield {k: np.asarray(v)[lo:lo + rows] for k, v in columns.items()}


def write_result(f, bench: dict) -> None:
    """Write :func:`dumps_result`'s text to ``f``; per-request lists of a streamed run
    (``bench_result.PerRequest``) are written window by window."""
    f.write("{\n")
    first = True
    for k, v in bench.items():
        f.write(("" if first else ",\n") + f"  {json.dumps(k)}: ")
        first = False
        if isinstance(v, PerRequest):
            f.write("[")
            sep = ""
            for part in v.windows():
                if part:
                    f.write(sep + json.dumps(part, allow_nan=False, separators=_SEP)[1:-1])
                    sep = ", "
            f.write("]")
        else:
            f.write(json.dumps(v, allow_nan=False, separators=_SEP))
    f.write("\n}\n")


_SEP = (", ", ": ")


def make_parent(path: Path) -> Path:
    """Create the folder ``path`` goes in (a one-line error naming ``path`` when an ancestor
    is a file or it cannot be created); returns it."""
    parent = Path(path).absolute().parent
    for q in (parent, *parent.parents):
        if q.exists():
            if not q.is_dir():
                raise ServesimError(f"{path}: {q} is a file, not a folder")
            break
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ServesimError(f"{path}: cannot create its folder: {e.strerror or e}") from None
    return parent


class OutputDir:
    """An output folder that appears complete or not at all.

    Created before any work (so an unwritable ``-o`` fails before simulating): files are
    written to a hidden staging folder beside ``path``; :meth:`commit` swaps it in (the old
    folder, with ``overwrite``, is moved aside and removed only after the swap), and
    :meth:`discard` (also on an exception inside ``with``) removes it, leaving ``path`` as it
    was. A non-empty existing folder is refused unless ``overwrite``."""

    def __init__(self, path: str | Path, *, overwrite: bool = False, what: str = "output"):
        self.path = Path(path)
        self.staging: Path | None = None
        p = self.path
        if p.exists() and not p.is_dir():
            raise ServesimError(f"{p}: exists and is not a folder; choose another {what} folder")
        if p.is_dir() and not overwrite and any(p.iterdir()):
            raise ServesimError(f"{p}: {what} folder is not empty; pass --overwrite to "
                                "replace it, or choose another folder")
        parent = make_parent(p)
        try:
            self.staging = Path(tempfile.mkdtemp(dir=parent, prefix=f".{p.name}.partial-"))
        except OSError as e:
            raise ServesimError(f"{p}: cannot write the {what} folder here: "
                                f"{e.strerror or e}") from None
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(self.staging, 0o777 & ~mask)  # mkdtemp makes it 0700

    def file(self, name: str) -> Path:
        """Where to write ``name`` (inside the staging folder)."""
        return self.staging / name

    def commit(self) -> Path:
        p = self.path
        old = None
        if p.is_dir():
            old = Path(tempfile.mkdtemp(dir=self.staging.parent, prefix=f".{p.name}.old-"))
            os.replace(p, old / p.name)
        os.replace(self.staging, p)
        self.staging = None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return p

    def discard(self) -> None:
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()


def write_run(result: RunResult, outdir: str | Path | OutputDir, *, date: str | None = None,
              overwrite: bool = False, formats: list[str] | None = None) -> dict:
    """Write a run directory; returns the full bench dict (``compute_bench_result``).

    Files: ``result.json`` (vLLM bench keys + deterministic extras), ``run_info.json`` (``date``,
    ``wall_seconds``, ``sim_speed``, ``servesim_version``, ``config_hash``), ``requests.csv``
    (``REQUEST_COLUMNS`` then extra columns such as ``send_s``), ``timeseries.csv``
    (``STEP_COLUMNS`` then extras), ``config.resolved.yaml``.

    ``outdir``: a path (refused when it is a non-empty folder, unless ``overwrite``) or an
    :class:`OutputDir` prepared before simulating. The folder appears complete or not at all.
    Per-request rows are written window by window (bounded memory for streamed runs).
    ``formats``: also write the run as those benchmark clients would have
    (``inference-perf``, ``guidellm``, ``aiperf``; ``reports/clients.py``).
    """
    from servesim.simulator.progress import phase

    out = outdir if isinstance(outdir, OutputDir) else OutputDir(outdir, overwrite=overwrite,
                                                                 what="run")
    with out:
        with phase("computing metrics"):
            bench = compute_bench_result(result, date=date)
        stable = {k: v for k, v in bench.items() if k not in VOLATILE_KEYS}
        info = {
            "date": bench["date"],
            **{k: bench.get(k) for k in VOLATILE_KEYS},
            "servesim_version": bench.get("servesim_version"),
            "config_hash": bench.get("config_hash"),
        }
        with phase("writing requests.csv", result.num_requests) as tick, \
                open(out.file(REQUESTS_FILE), "w", encoding="utf-8", newline="") as f:
            done = 0

            def windows():
                nonlocal done
                for w in result.iter_requests():
                    yield w
                    done += len(w["finished_reason"])
                    tick(done)

            write_csv(f, windows(), REQUEST_COLUMNS, "requests")
        steps = result.steps or {c: np.empty(0) for c in STEP_COLUMNS}
        with open(out.file(TIMESERIES_FILE), "w", encoding="utf-8", newline="") as f:
            # in windows: a 10M-request replay has ~900k one-second rows
            write_csv(f, _row_windows(steps), STEP_COLUMNS, "steps")
        atomic_write_text(out.file(CONFIG_FILE), result.config.to_yaml())
        atomic_write_text(out.file(RUN_INFO_FILE),
                          json.dumps(info, indent=2, allow_nan=False) + "\n")
        with phase("writing result.json"), \
                open(out.file(RESULT_FILE), "w", encoding="utf-8", newline="") as f:
            write_result(f, stable)
        if formats:
            from servesim.reports.clients import write_client_results

            with phase("writing " + ", ".join(formats) + " results"):
                write_client_results(result, bench, out.staging, formats)
        for name, text in (getattr(result, "files", None) or {}).items():
            atomic_write_text(out.file(name), text)
        for name, sub in getattr(result, "instances", None) or ():  # cluster: per instance
            write_run(sub, out.file(f"instances/{name}"), date=date)
        out.commit()
    return bench
