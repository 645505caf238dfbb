"""Points on disk, in ``vllm bench sweep``'s folder layout, written by the driver process only.

    ROOT/SERVE-<arm>-BENCH-<rate>/run=<seed>.json          the point's record (bench dict + extras)
    ROOT/SERVE-<arm>-BENCH-<rate>/run=<seed>.failure.json  why it failed (sweeps)
    ROOT/SERVE-<arm>-BENCH-<rate>/summary.json             the folder's records, in seed order
    ROOT/summary.csv                                       one row per record (scalar keys)

Every file is written atomically (temp file in the same folder, fsync, ``os.replace``): an
interruption leaves either the old file or the new one, never half of one (a SIGKILL between
the two can leave the hidden temp file: the next run on the folder removes it). A record carries
the content hash of its point's definition under ``hash_key``; ``load`` returns it only when that
hash matches, so ``--resume`` reuses exactly the points whose definition did not change (the
hash covers what the point resolves to: :func:`~.points.inputs_hash`).
Summaries hold no host-dependent keys (``VOLATILE_KEYS``), so a resumed experiment writes the
same bytes as an uninterrupted one.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from servesim.simulator.experiments.points import Point

# Host timings (reports.bench_result.VOLATILE_KEYS): dropped from records, like write_run does.
HOST_TIMING_KEYS = frozenset({"wall_seconds", "sim_speed"})
# Kept in records but not in summary.csv, so resumed and uninterrupted runs match byte for byte.
VOLATILE_KEYS = frozenset({"date"}) | HOST_TIMING_KEYS
LEADING_COLUMNS = ("arm", "request_rate", "seed", "run_number")


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def make_folder(path: str | Path, what: str = "output") -> Path:
    """Create the folder ``path`` (and its parents); a one-line error naming it when it, or
    one of its parents, is a file, or it cannot be created (``what``: the kind of folder)."""
    from servesim.simulator.errors import ConfigError, path_is_dir

    p = Path(path)
    for q in (p, *p.absolute().parents):
        if os.path.lexists(q):
            if not path_is_dir(q):
                why = "exists and is not a folder" if q == p else f"{q} is a file, not a folder"
                raise ConfigError(f"{p}: {why}; choose another {what} folder")
            break
    try:
        p.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{p}: cannot write the {what} folder here: "
                          f"{getattr(e, 'strerror', None) or e}") from None
    return p


DEFINITION_FILE = "experiment.json"  # which sweep / plan wrote a folder (``check_definition``)


def check_definition(folder: Path, kind: str, source: str, digest: str, resume: bool) -> None:
    """Refuse to write into ``folder`` when its :data:`DEFINITION_FILE` says another
    ``kind`` (sweep or plan) wrote it: another file (``source``, as resolved) of another
    content (``digest``: a hash of the resolved file). Its points would be overwritten and the
    summaries would mix both. The same file edited, or the same definition under another
    name, continues (changed points rerun); a folder without the file (older versions) is
    taken as this experiment's."""
    from servesim.simulator.errors import ConfigError

    old = read_json(folder / DEFINITION_FILE)
    if old is None or old.get("hash") == digest or old.get("source") == source:
        return
    raise ConfigError(f"{folder}: holds the results of another {kind} ({old.get('source')}), "
                      f"not of {source}"
                      + (f"; --resume continues only the same {kind}" if resume else "")
                      + "; choose another -o")


def write_definition(folder: Path, kind: str, source: str, digest: str) -> None:
    """Record which ``kind`` (sweep or plan) file and definition writes ``folder``."""
    write_json(folder / DEFINITION_FILE, {"kind": kind, "source": source, "hash": digest})


def remove_stale_temps(folder: Path) -> None:
    """Delete temp files under ``folder`` left by a writer that was killed between writing and
    renaming (``.<name>.<pid>.tmp`` whose process no longer runs)."""
    for f in folder.rglob(".*.tmp"):
        pid = f.name.rsplit(".", 2)[-2]
        if pid.isdigit() and not _pid_alive(int(pid)):
            f.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def dumps(obj: Any) -> str:
    """JSON text of a record: 2-space indent, numpy scalars/arrays as Python, final newline."""
    return json.dumps(obj, indent=2, default=_json_default) + "\n"


def write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, dumps(obj))


def _json_default(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    return str(o)


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path``; None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _csv_cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return v


class PointStore:
    """The folder of an experiment's points (see the module docstring)."""

    def __init__(self, root: str | Path, hash_key: str):
        self.root = Path(root)
        self.hash_key = hash_key

    def path(self, p: Point) -> Path:
        return self.root / p.dirname / p.run_name

    def holds_points(self) -> bool:
        """True when the folder already holds point records (of any definition)."""
        return self.root.is_dir() and any(self.root.glob("SERVE-*/run=*.json"))

    def count(self) -> int:
        """Finished point records in the folder (failures not counted)."""
        return sum(1 for f in self.root.glob("SERVE-*/run=*.json")
                   if not f.name.endswith(".failure.json"))

    def load(self, p: Point, expect_hash: str) -> dict | None:
        """``p``'s record if it exists and was written for this very definition of ``p``."""
        data = read_json(self.path(p))
        return data if data is not None and data.get(self.hash_key) == expect_hash else None

    def save(self, p: Point, record: dict) -> None:
        """Write ``p``'s record (atomically) and drop an earlier failure file of ``p``."""
        write_json(self.path(p), record)
        (self.root / p.dirname / p.failure_name).unlink(missing_ok=True)

    def save_failure(self, p: Point, record: dict) -> Path:
        path = self.root / p.dirname / p.failure_name
        write_json(path, record)
        return path

    def collect(self, points: Iterable[tuple[Point, str]]) -> list[tuple[Point, dict]]:
        """The records of ``(point, hash)`` pairs that are done, in the given order."""
        out = []
        for p, h in points:
            data = self.load(p, h)
            if data is not None:
                out.append((p, data))
        return out

    def write_summaries(self, runs: Sequence[tuple[Point, dict]],
                        first_columns: Sequence[str] = LEADING_COLUMNS) -> list[dict]:
        """Rebuild each folder's ``summary.json`` and ``summary.csv`` from ``runs`` (in their
        order); return the summary rows. Columns: ``first_columns``, then every scalar key in
        first-seen order, minus ``VOLATILE_KEYS``."""
        by_dir: dict[str, list[dict]] = {}
        for p, r in runs:
            by_dir.setdefault(p.dirname, []).append(r)
        for d, items in by_dir.items():
            write_json(self.root / d / "summary.json", items)
        records = [r for _, r in runs]
        cols = list(dict.fromkeys(first_columns))
        for r in records:
            for k, v in r.items():
                if k not in cols and k not in VOLATILE_KEYS and _scalar(v):
                    cols.append(k)
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(cols)
        for r in records:
            w.writerow([_csv_cell(r.get(c)) for c in cols])
        atomic_write_text(self.root / "summary.csv", buf.getvalue())
        return [{c: r.get(c) for c in cols} for r in records]
