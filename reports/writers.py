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
import pickle
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np
from servesim.reports.bench_requests import PerRequest
from servesim.reports.bench_result import VOLATILE_KEYS, compute_bench_result
from servesim.simulator.errors import ServesimError
from servesim.simulator.metrics import (
    RAW_FIELDS,
    RAW_STRINGS,
    REQUEST_COLUMNS,
    STEP_COLUMNS,
    RunResult,
    derive_request_columns,
)

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
        if cols and len(cols) > 1 and not any(
                _needs_quotes(c) for c, name in zip(cols, names)
                if np.asarray(columns[name]).dtype.kind not in "fiub"):
            if cols[0]:  # no cell to quote: the csv module's bytes, ~8x faster
                f.write("\n".join(map(",".join, zip(*cols))))
                f.write("\n")
        else:
            w.writerows(zip(*cols) if cols else ())
        n += len(cols[0]) if cols else 0
    if names is None:
        w.writerow(order)
    return n


_SPECIAL = frozenset(',"\r\n')


def _needs_quotes(cells: list[str]) -> bool:
    """Whether ``csv.writer`` (QUOTE_MINIMAL) would quote any of these cells."""
    for c in cells:
        if not _SPECIAL.isdisjoint(c):
            return True
    return False


def _row_windows(columns: dict[str, Any], rows: int = 65_536):
    """``columns`` in windows of ``rows`` rows (one window when shorter or empty)."""
    n = max((len(v) for v in columns.values()), default=0)
    for lo in range(0, max(n, 1), rows):
        yield {k: np.asarray(v)[lo:lo + rows] for k, v in columns.items()}


def write_result(f, bench: dict) -> None:
    """Write :func:`dumps_result`'s text to ``f``; per-request lists of a streamed run
    (``bench_requests.PerRequest``) are written window by window."""
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


def check_writable(path: Path, what: str = "") -> Path:
    """Create the folder ``path`` goes in and check that a file can be created there (a
    one-line error naming ``path``: "cannot write{ the <what>} here"); returns the folder."""
    parent = make_parent(path)
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{Path(path).name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ServesimError(f"{path}: cannot write{f' the {what}' if what else ''} here: "
                            f"{e.strerror or e}") from None
    return parent


def holds_files(p: Path, overwrite: bool, what: str = "output",
                replace: str = "pass --overwrite to replace it") -> bool:
    """Whether ``p`` is a non-empty folder (to be replaced: allowed only with ``overwrite``);
    a one-line error naming ``p`` when it is a file, or non-empty without ``overwrite``
    (``replace``: what the user may pass instead)."""
    if p.exists() and not p.is_dir():
        raise ServesimError(f"{p}: exists and is not a folder; choose another {what} folder")
    if not p.is_dir() or not any(p.iterdir()):
        return False
    if not overwrite:
        raise ServesimError(f"{p}: {what} folder is not empty; {replace}, or choose another "
                            "folder")
    return True


def replaceable(p: Path, what: str, keep: tuple[Path, ...] = ()) -> None:
    """``--overwrite`` replaces a whole folder: only one a servesim run wrote (it holds
    ``run_info.json``), and never one holding a file of ``keep`` (the config being run)."""
    out = p.resolve()
    for f in keep:
        f = Path(f).resolve()
        if out in f.parents:
            raise ServesimError(f"{p}: holds {f.name}, which this run reads; --overwrite will "
                                f"not replace it, choose another {what} folder")
    if not (p / RUN_INFO_FILE).is_file():
        raise ServesimError(f"{p}: holds files that are not a servesim run's (no "
                            f"{RUN_INFO_FILE}); --overwrite replaces only a run folder, choose "
                            f"another {what} folder")


class OutputDir:
    """An output folder that appears complete or not at all.

    Created before any work (so an unwritable ``-o`` fails before simulating): files are
    written to a hidden staging folder beside ``path``; :meth:`commit` swaps it in (the old
    folder, with ``overwrite``, is moved aside and removed only after the swap), and
    :meth:`discard` (also on an exception inside ``with``) removes it, leaving ``path`` as it
    was. A non-empty existing folder is refused unless ``overwrite``."""

    def __init__(self, path: str | Path, *, overwrite: bool = False, what: str = "output",
                 keep: tuple[Path, ...] = ()):
        self.path = Path(path)
        self.staging: Path | None = None
        p = self.path
        if p.is_symlink():  # (the swap would replace the link, not fill its target)
            raise ServesimError(f"{p}: is a symlink; give the {what} folder itself")
        here = Path.cwd().resolve()
        if p.resolve() == here or p.resolve() in here.parents:
            raise ServesimError(f"{p}: is the working directory or holds it; choose a {what} "
                                "folder inside it")
        if holds_files(p, overwrite, what):
            replaceable(p, what, keep)
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


class RequestsCsvStream:
    """``requests.csv`` and ``timeseries.csv`` written while the simulation runs.

    Formatting CSV cells costs about a microsecond per float (Python's shortest ``repr``), as
    much as simulating the request on a large run; a forked worker process does it on another
    core, fed the engine's raw rows as they are recorded (``Recorder.sink``, batches of
    ``Recorder.SINK_ROWS``): request rows are written once every row before them has arrived
    (request-index order), step rows are formatted ahead (the worker runs its own
    ``StepSampler``). After the simulation only the tails are left (:meth:`send_timeseries`,
    :meth:`finish`), and they overlap with :func:`write_run` computing the metrics. The files
    are the bytes :func:`write_run` would write (the worker checks its step rows against the
    run's and formats those when they differ). Linux only (``fork``); where it is unavailable
    or the worker fails, :func:`write_run` writes the files as before."""

    def __init__(self, path: str | Path, timeseries_interval: float | None = None):
        self.path = Path(path)
        self.timeseries_interval = timeseries_interval
        self._pid = 0
        self._w = None
        self.ok = False

    @classmethod
    def start(cls, path: str | Path,
              timeseries_interval: float | None = None) -> RequestsCsvStream | None:
        """Fork the worker (None where it cannot); ``timeseries_interval``: the config's
        ``output.timeseries_interval_s``."""
        if not sys.platform.startswith("linux"):
            return None
        stream = cls(path, timeseries_interval)
        r, w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            return None
        if pid == 0:  # the worker: never returns
            code = 1
            try:
                os.close(w)
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
                with os.fdopen(r, "rb") as src:
                    _csv_worker(src, stream.path, timeseries_interval)
                code = 0
            finally:
                os._exit(code)
        os.close(r)
        stream._pid = pid
        stream._w = os.fdopen(w, "wb")
        return stream

    def __call__(self, message: tuple) -> None:
        """Hand on ("rows", raw request fields) or ("steps", raw step columns)."""
        if self._w is not None:
            try:
                pickle.dump(message, self._w, protocol=pickle.HIGHEST_PROTOCOL)
            except OSError:  # the worker is gone: write_run writes the files instead
                self.close()

    def expect(self, num_rows: int) -> None:
        """The run has ``num_rows`` request rows (the worker checks it streamed as many)."""
        self(("expect", int(num_rows)))

    def send_timeseries(self, steps: dict, path: str | Path) -> bool:
        """After the last rows: have the worker write timeseries.csv at ``path``; ``steps``
        (``RunResult.steps``) are the rows it must hold. False when it cannot."""
        if self._w is None:
            return False
        self(("timeseries", str(path), {k: np.asarray(v) for k, v in steps.items()}))
        return self._w is not None

    def _close_pipe(self) -> None:
        """No more messages (the worker sees EOF)."""
        if self._w is not None:
            try:
                self._w.close()
            except OSError:
                pass
            self._w = None

    def finish(self) -> bool:
        """No more rows: wait for the worker to write the rest; True when the files are
        complete."""
        self._close_pipe()
        if self._pid:
            _, status = os.waitpid(self._pid, 0)
            self._pid = 0
            self.ok = os.waitstatus_to_exitcode(status) == 0
        return self.ok

    def close(self) -> None:
        """Stop the worker (on errors and interruptions); its files are not to be used."""
        self._close_pipe()
        if self._pid:
            import signal

            try:
                os.kill(self._pid, signal.SIGKILL)
                os.waitpid(self._pid, 0)
            except OSError:
                pass
            self._pid = 0
        self.ok = False


def _rows_text(columns: dict[str, Any], names: Sequence[str]) -> str:
    """CSV lines (no header) of ``columns`` in ``names`` order: :func:`write_csv`'s bytes."""
    buf = io.StringIO()
    write_csv(buf, [columns], names, "rows")
    text = buf.getvalue()
    return text[text.index("\n") + 1:]


class _StepRows:
    """The worker's copy of the run's step rows: a ``StepSampler`` fed the same chunks, with
    every row formatted as soon as it is final (raw rows at once; sampled rows when their
    interval closes)."""

    def __init__(self, interval: float | None):
        from servesim.simulator.recorder import Recorder
        from servesim.simulator.runner import StepSampler

        self.sampler = StepSampler(interval, keep_tokens=False)
        self.names = dict(zip(Recorder.STEP, STEP_COLUMNS))
        self.pieces: list[str] = []
        self.done = 0  # sampled rows (sampler._rows entries) formatted
        self.last_t = -math.inf
        self.sorted = True

    def add(self, chunk: dict[str, np.ndarray]) -> None:
        t = chunk["time_s"]
        if len(t):
            if t[0] < self.last_t or (len(t) > 1 and bool(np.any(np.diff(t) < 0))):
                self.sorted = False
            self.last_t = float(t[-1])
        s = self.sampler
        raw = s.interval is None
        s.add(chunk)
        if s.interval is None:
            self.pieces.append(self._text(chunk))
            return
        if raw:  # switched to sampling: the raw rows are void
            self.pieces = []
            self.done = 0
        for rows in s._rows[self.done:]:
            self.pieces.append(self._text(rows))
        self.done = len(s._rows)

    def _text(self, rows: dict[str, np.ndarray]) -> str:
        names = self.names  # (extra columns keep their names, as StepSampler.columns)
        return _rows_text({names.get(k, k): v for k, v in rows.items()}, STEP_COLUMNS)

    def write(self, path: str, steps: dict[str, np.ndarray]) -> None:
        """timeseries.csv with the rows ``steps`` holds (pre-formatted when they match)."""
        mine = self.sampler.columns()
        same = self.sorted and set(mine) == set(steps) and all(
            np.array_equal(np.asarray(mine[k], dtype=float), np.asarray(steps[k], dtype=float),
                           equal_nan=True) for k in mine)
        if not same or not len(mine["time_s"]):
            _write_timeseries(path, steps)
            return
        if self.sampler.interval is not None:  # + the last (open) interval's row
            tail = {k: v[-1:] for k, v in mine.items()}
            self.pieces.append(_rows_text(tail, STEP_COLUMNS))
        header = list(STEP_COLUMNS) + [c for c in steps if c not in STEP_COLUMNS]
        with open(path, "w", encoding="utf-8", newline="") as f:
            csv.writer(f, lineterminator="\n").writerow(header)  # (write_csv's header)
            f.writelines(self.pieces)


def _csv_worker(src, path: Path, interval: float | None) -> None:
    """Read pickled messages from ``src`` until EOF (see :class:`RequestsCsvStream`); write
    requests.csv at ``path`` in request-index order, each row as soon as every row before it
    has arrived, and timeseries.csv when asked. Messages: ("meta", {"client_columns": bool})
    before any row (the run's columns; without it the file is not used), ("rows", raw request
    fields), ("steps", raw step columns), ("timeseries", path, the run's step columns) and
    ("expect", number of request rows): a file with another number of rows is not used
    (exit status 1, :func:`write_run` writes it)."""
    pending: list[dict] = []  # request row batches, each sorted by index
    mins: list[int] = []
    next_index = 0
    steps = _StepRows(interval)
    timeseries = None
    meta: dict | None = None
    expect: list[int] = []

    def merged() -> dict:
        if len(pending) == 1:
            return pending[0]
        cat = {k: np.concatenate([b[k] for b in pending]) for k in pending[0]}
        order = np.argsort(cat["index"], kind="stable")
        return {k: v[order] for k, v in cat.items()}

    def windows():
        nonlocal next_index, timeseries, meta
        emitted = False
        while True:
            try:
                msg = pickle.load(src)
            except EOFError:
                break
            if msg[0] == "steps":
                steps.add(msg[1])
                continue
            if msg[0] == "timeseries":  # (after the last rows)
                timeseries = msg
                continue
            if msg[0] == "expect":
                expect.append(msg[1])
                continue
            if msg[0] == "meta":
                meta = msg[1]
                continue
            if meta is None:
                raise ValueError("request rows before the run's meta message")
            client = meta["client_columns"]
            batch = {k: (np.asarray(v, dtype=object) if isinstance(v, list) else v)
                     for k, v in msg[1].items()}
            order = np.argsort(batch["index"], kind="stable")
            if not len(order):
                continue
            batch = {k: v[order] for k, v in batch.items()}
            pending.append(batch)
            mins.append(int(batch["index"][0]))
            if next_index not in mins:
                continue
            m = merged()
            idx = m["index"].astype(np.int64)
            gap = np.flatnonzero(idx != next_index + np.arange(len(idx)))
            k = int(gap[0]) if len(gap) else len(idx)
            pending.clear()
            mins.clear()
            if k < len(idx):
                pending.append({f: v[k:] for f, v in m.items()})
                mins.append(int(idx[k]))
            if k:
                next_index += k
                emitted = True
                yield derive_request_columns({f: v[:k] for f, v in m.items()}, client)
        if meta is None:
            raise ValueError("no meta message: not a run's stream")
        if pending:
            yield derive_request_columns(merged(), meta["client_columns"])
        elif not emitted:  # no request at all: the header (the same columns)
            yield derive_request_columns(
                {f: np.zeros(0) for f in RAW_FIELDS}
                | {f: np.zeros(0, dtype=object) for f in RAW_STRINGS}, meta["client_columns"])

    with open(path, "w", encoding="utf-8", newline="") as f:
        n = write_csv(f, windows(), REQUEST_COLUMNS, "requests")
    if expect and expect[-1] != n:
        raise ValueError(f"requests.csv: {n} rows streamed, the run has {expect[-1]}")
    if timeseries is not None:
        _, ts_path, columns = timeseries
        steps.write(ts_path, columns)


def _write_timeseries(path: str | Path, steps: dict) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        # in windows: a 10M-request replay has ~900k one-second rows
        write_csv(f, _row_windows(steps), STEP_COLUMNS, "steps")


def write_run(result: RunResult, outdir: str | Path | OutputDir, *, date: str | None = None,
              overwrite: bool = False, formats: list[str] | None = None,
              requests_stream: RequestsCsvStream | None = None) -> dict:
    """Write a run directory; returns the full bench dict (``compute_bench_result``).

    Files: ``result.json`` (vLLM bench keys + deterministic extras), ``run_info.json`` (``date``,
    ``wall_seconds``, ``sim_speed``, ``servesim_version``, ``config_hash``), ``requests.csv``
    (``REQUEST_COLUMNS`` then extra columns such as ``send_s``), ``timeseries.csv``
    (``STEP_COLUMNS`` then extras), ``config.resolved.yaml``.

    ``outdir``: a path (refused when it is a non-empty folder, unless ``overwrite``) or an
    :class:`OutputDir` prepared before simulating. The folder appears complete or not at all.
    Per-request rows are written window by window (bounded memory for streamed runs), or were
    written during the simulation by ``requests_stream`` (into the same staging folder).
    ``formats``: also write the run as those benchmark clients would have
    (``inference-perf``, ``guidellm``, ``aiperf``; ``reports/client_export.py``).
    """
    from servesim.simulator.progress import phase

    out = outdir if isinstance(outdir, OutputDir) else OutputDir(outdir, overwrite=overwrite,
                                                                 what="run")
    with out:
        steps = result.steps or {c: np.empty(0) for c in STEP_COLUMNS}
        # The stream's worker writes timeseries.csv meanwhile (another core).
        ts_sent = requests_stream is not None and requests_stream.send_timeseries(
            steps, out.file(TIMESERIES_FILE))
        with phase("computing metrics"):
            bench = compute_bench_result(result, date=date)
        stable = {k: v for k, v in bench.items() if k not in VOLATILE_KEYS}
        info = {
            "date": bench["date"],
            **{k: bench.get(k) for k in VOLATILE_KEYS},
            "servesim_version": bench.get("servesim_version"),
            "config_hash": bench.get("config_hash"),
        }
        atomic_write_text(out.file(CONFIG_FILE), result.config.to_yaml())
        atomic_write_text(out.file(RUN_INFO_FILE),
                          json.dumps(info, indent=2, allow_nan=False) + "\n")
        with phase("writing result.json"), \
                open(out.file(RESULT_FILE), "w", encoding="utf-8", newline="") as f:
            write_result(f, stable)
        streamed = False
        if requests_stream is not None:
            with phase("writing requests.csv"):
                requests_stream.expect(result.num_requests)
                streamed = requests_stream.finish() and \
                    Path(requests_stream.path) == Path(out.file(REQUESTS_FILE))
        ts_sent = ts_sent and requests_stream.ok
        if not streamed:
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
        if not ts_sent:
            _write_timeseries(out.file(TIMESERIES_FILE), steps)
        if formats:
            from servesim.reports.client_export import write_client_results

            with phase("writing " + ", ".join(formats) + " results"):
                write_client_results(result, bench, out.staging, formats)
        for name, text in (getattr(result, "files", None) or {}).items():
            atomic_write_text(out.file(name), text)
        for name, sub in getattr(result, "instances", None) or ():  # cluster: per instance
            write_run(sub, out.file(f"instances/{name}"), date=date)
        out.commit()
    return bench
