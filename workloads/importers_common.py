"""What every trace reader shares: opening a (gzip'd) UTF-8 trace with one-line read errors,
the field parsers (integers, finite numbers) and the per-file context that names file and line
of a bad row, or counts it when bad rows are skipped."""

from __future__ import annotations

import contextlib
import gzip
import io
import math
import re
import zlib
from pathlib import Path

from servesim.simulator.errors import TraceError


class _Bad(Exception):
    """A malformed row (message without the file:line prefix)."""


def _check_file(path) -> Path:
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{path}: no such file")
    if not p.is_file():
        raise TraceError(f"{path}: not a file")
    return p


def open_text(path, errors: str = "strict") -> io.TextIOBase:
    """Open a trace for reading as UTF-8 text (``.gz`` transparently); one-line error if
    missing. ``errors="surrogateescape"`` lets a reader flag undecodable rows one by one
    (:data:`_UNDECODABLE`)."""
    p = _check_file(path)
    if p.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding="utf-8-sig", errors=errors,
                                newline="")
    return open(p, encoding="utf-8-sig", errors=errors, newline="")


_UNDECODABLE = re.compile("[\udc80-\udcff]")  # bytes that are not UTF-8, surrogate-escaped
_READ_ERRORS = (UnicodeDecodeError, EOFError, OSError, zlib.error)


def read_error(path, e: BaseException, line: int | None = None) -> TraceError:
    """A one-line :class:`TraceError` for a file that cannot be read as (gzip'd) UTF-8 text."""
    where = f" after line {line}" if line else ""
    if isinstance(e, UnicodeDecodeError):
        return TraceError(f"{path}: invalid UTF-8 bytes{where}: expected a UTF-8 text file")
    if isinstance(e, EOFError):
        return TraceError(f"{path}: truncated gzip file{where} (the compressed stream ends "
                          "early)")
    if isinstance(e, (gzip.BadGzipFile, zlib.error)):
        return TraceError(f"{path}: not a valid gzip file ({e}); files ending in .gz are "
                          "read through gzip")
    return TraceError(f"{path}: cannot read the file ({getattr(e, 'strerror', None) or e})")


def _odd_text(s) -> bool:
    """A CSV cell Python's int()/float() would read but a trace should not hold: ``1_000``,
    non-ASCII digits such as ``٣٠٠``."""
    return isinstance(s, str) and (not s.isascii() or "_" in s)


def _int(s, what: str) -> int:
    """An integer from a CSV cell (``12``, ``12.0``) or a JSON number (``12``, ``12.0``); a
    fractional part, inf/nan, a JSON bool, ``1_000`` or non-ASCII digits are malformed."""
    if isinstance(s, bool) or _odd_text(s):
        raise _Bad(f"expected an integer {what}, got {_short(s)}")
    if isinstance(s, int):
        return s
    f = math.nan
    if isinstance(s, str):
        try:
            return int(s)
        except ValueError:  # also past Python's 4300-digit limit: float() then gives inf
            with contextlib.suppress(ValueError):
                f = float(s)
    elif isinstance(s, float):
        f = s
    if math.isfinite(f) and f.is_integer():
        return int(f)
    raise _Bad(f"expected an integer {what}, got {_short(s)}")


def _float(s, what: str) -> float:
    if isinstance(s, bool) or _odd_text(s):
        raise _Bad(f"expected a number {what}, got {_short(s)}")
    try:
        f = float(s)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int past 1e308
        raise _Bad(f"expected a number {what}, got {_short(s)}") from None
    if not math.isfinite(f):
        raise _Bad(f"expected a finite number {what}, got {_short(s)}")
    return f


def _short(v, n: int = 40) -> str:
    """``repr(v)``, cut to ``n`` characters (a 4000-digit JSON number stays one short line)."""
    r = repr(v)
    return r if len(r) <= n else f"{r[:n]}... ({len(r)} characters)"


class _Ctx:
    def __init__(self, path, skip: bool, stats: dict):
        self.name, self.skip, self.stats = str(path), skip, stats
        self.line = 0  # last line read (for errors raised by the file itself)
        for k in ("skipped_bad_rows", "dropped_failed", "filtered", "zero_output"):
            stats[k] = 0

    def bad(self, line, msg: str) -> None:
        """Raise a TraceError naming file and line, or count the row when skipping."""
        if self.skip:
            self.stats["skipped_bad_rows"] += 1
            return
        where = f"{self.name}:{line}" if isinstance(line, int) else f"{self.name}: {line}"
        raise TraceError(f"{where}: {msg}")
