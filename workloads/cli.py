"""``simulate trace stats|convert`` (registered on the ``simulate`` app by simulator/cli.py)."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Annotated

import typer

trace_app = typer.Typer(no_args_is_help=True, help="Inspect and convert request traces.")

FormatOpt = Annotated[str, typer.Option("--format", "-f", help="Trace format (default: detect)")]
BlockOpt = Annotated[int, typer.Option("--block-size", min=1, help="KV block size, tokens")]
SkipOpt = Annotated[bool, typer.Option("--skip-bad-rows", help="Skip malformed rows, count them")]


def _fmt_num(x, digits=2) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer()):
        return f"{int(x):,}"
    return f"{x:,.{digits}f}"


def _strict_json(x):
    """``x`` with infinite floats as "inf" / "-inf" and NaN as None (strict JSON)."""
    if isinstance(x, dict):
        return {k: _strict_json(v) for k, v in x.items()}
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


@trace_app.command("stats")
def stats_cmd(
    file: Annotated[Path, typer.Argument(help="Trace file")],
    format: FormatOpt = "auto",
    block_size: BlockOpt = 16,
    skip_bad_rows: SkipOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """Requests, duration, rate, inter-arrival CV, length percentiles and prefix-reuse
    potential, in one streaming pass (bounded memory, exact percentiles)."""
    from servesim.workloads.stats import trace_stats

    s = trace_stats(file, format, block_size=block_size, skip_bad_rows=skip_bad_rows)
    if as_json:  # strict JSON: an infinite rate (every request at one instant) as "inf"
        typer.echo(json.dumps(_strict_json(s), indent=2, default=lambda x: None,
                              allow_nan=False))
        return
    from rich.console import Console
    from rich.table import Table
    from servesim.reports.console import print_table

    con = Console()
    con.print(f"[bold]{s['path']}[/bold] ({s['format']})")
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_row("requests", f"{s['requests']:,}")
    t.add_row("duration (s)", _fmt_num(s["duration_s"]))
    t.add_row("mean rate (req/s)", _fmt_num(s["mean_rate_rps"], 3))
    t.add_row("inter-arrival CV", _fmt_num(s["interarrival_cv"], 3))
    reuse = f"{s['prefix_reuse']:.3f}" if s["has_prefix_ids"] else "0 (no prefix ids)"
    if s["prefix_reuse_approximate"]:
        reuse += " (approximate)"
    t.add_row(f"prefix reuse @ block {s['block_size']}", reuse)
    for k in ("skipped_bad_rows", "dropped_failed", "filtered", "zero_output"):
        if s[k]:
            t.add_row(k.replace("_", " "), f"{s[k]:,}")
    print_table(t, con)
    lt = Table("tokens", "mean", "p50", "p90", "p99", "max", "total")
    for k in ("prompt_len", "output_len"):
        d = s[k]
        lt.add_row(k, *(_fmt_num(d[c], 1) for c in ("mean", "p50", "p90", "p99")),
                   f"{d['max']:,}", f"{d['total']:,}")
    print_table(lt, con)


CANONICAL_COLUMNS = ["arrival_s", "prompt_len", "output_len", "prefix_block_ids", "priority",
                     "session_id", "turn", "lora", "parent_id", "think_time_s", "request_id"]


def _row(r, cols) -> list:
    out = []
    for c in cols:
        v = getattr(r, c) if c in CANONICAL_COLUMNS else r.extra.get(c)  # extra: other columns
        if c == "prefix_block_ids":
            v = " ".join(map(str, v)) if v else ""
        elif c == "arrival_s":
            v = repr(float(v))
        elif v is None:
            v = ""
        out.append(v)
    return out


def write_canonical(reqs, out: Path, columns: list[str] | None = None) -> int:
    """Stream requests to a canonical CSV; returns the number of rows. ``columns`` defaults to
    the required three plus every optional one (empty cells = default); a column that is not
    canonical is read from ``RequestSpec.extra``. The file appears complete or not at all: it
    is written next to ``out``, then renamed over it, which :func:`check_output_file` allows
    only for a regular file (checked again here, just before the rename)."""
    cols = columns or CANONICAL_COLUMNS
    n = 0
    fd, tmp = tempfile.mkstemp(dir=out.absolute().parent, prefix=f".{out.name}.",
                               suffix=".part")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(cols)
            for r in reqs:
                w.writerow(_row(r, cols))
                n += 1
        os.chmod(tmp, 0o644)
        _check_regular(out)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return n


def _check_regular(out: Path) -> None:
    """Refuse an existing ``out`` that is not a regular file: renaming over a symlink, FIFO or
    device node would replace it (``/dev/null``, ``/dev/stdout``) with a regular file."""
    from servesim.simulator.errors import ServesimError

    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(out).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a symlink" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "a folder" if stat.S_ISDIR(mode) else "a special file")
            raise ServesimError(f"{out}: exists and is {kind}, not a regular file; expected a "
                                "new or regular file name")


def check_output_file(out: Path, inputs: list[Path], overwrite: bool) -> None:
    """Refuse, before any work, an output that is an input, a folder, an existing file
    (unless ``overwrite``) or anything else than a regular file (a symlink, FIFO or device:
    even with ``overwrite``), or in a folder that cannot be created or written."""
    from servesim.reports.writers import check_writable
    from servesim.simulator.errors import ServesimError

    for i in inputs:
        with contextlib.suppress(OSError):
            if out.exists() and os.path.samefile(out, i):
                raise ServesimError(f"{out}: is the input file; write the output elsewhere")
    if out.is_dir():
        raise ServesimError(f"{out}: is a folder; expected a file name")
    _check_regular(out)
    if out.exists() and not overwrite:
        raise ServesimError(f"{out}: exists; pass --overwrite to replace it")
    check_writable(out)


@trace_app.command("convert")
def convert_cmd(
    file: Annotated[Path, typer.Argument(help="Trace file")],
    out: Annotated[Path, typer.Option("--output", "-o", help="Canonical CSV to write")],
    format: FormatOpt = "auto",
    block_size: BlockOpt = 16,
    skip_bad_rows: SkipOpt = False,
    overwrite: Annotated[bool, typer.Option("--overwrite",
                                            help="Replace an existing output file")] = False,
) -> None:
    """Convert a trace to the canonical CSV (streaming). Arrival times are shifted so the first
    request is at 0 (traces without timestamps: all 0); prefix ids at ``--block-size``. The
    output appears complete or not at all. A benchmark client's profile (inference-perf,
    GuideLLM, AIPerf, genai-perf) is converted to its requests at their nominal send times."""
    from servesim.simulator.errors import TraceError
    from servesim.workloads.importers import FORMATS
    from servesim.workloads.profiles import FORMATS as PROFILE_FORMATS

    if format != "auto" and format not in FORMATS + PROFILE_FORMATS:
        raise TraceError(f"{file}: unknown trace format {format!r} (one of "
                         f"{', '.join(FORMATS + PROFILE_FORMATS)})")
    parent = out.absolute().parent
    made = [d for d in (parent, *parent.parents) if not d.exists()]  # deepest first
    check_output_file(out, [file], overwrite)
    try:
        _convert(file, out, format, block_size, skip_bad_rows)
    except BaseException:  # leave no folder behind that check_output_file created
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


def _convert(file: Path, out: Path, format: str, block_size: int, skip_bad_rows: bool) -> None:
    from servesim.simulator.errors import Interrupted, ServesimError
    from servesim.workloads import build_workload
    from servesim.workloads.config import TraceWorkload
    from servesim.workloads.profiles import FORMATS as PROFILE_FORMATS
    from servesim.workloads.profiles import is_profile_file

    if format in PROFILE_FORMATS or (format == "auto" and is_profile_file(file)):
        from servesim.workloads.config import ProfileWorkload

        wl = build_workload(ProfileWorkload(path=str(file), format=format),
                            block_size=block_size)
        if any(st["num_requests"] is None for st in wl.meta["stages"]):
            raise ServesimError(f"{file}: a closed-loop stage bounded by duration only has no "
                                "fixed request count; simulate it instead (kind: profile)")
        cols = ["arrival_s", "prompt_len", "output_len", "prefix_block_ids", "request_id"]
        typer.echo("note: nominal send times, stages back to back (a client starts a stage "
                   "when the previous one has drained; closed-loop stages send at its start)",
                   err=True)
    else:
        cfg = TraceWorkload(path=str(file), format=format, skip_bad_rows=skip_bad_rows)
        wl = build_workload(cfg, block_size=block_size)
        fmt = wl.meta["dataset_name"]
        cols = CANONICAL_COLUMNS[:3]
        if fmt in ("mooncake", "canonical"):
            cols = cols + ["prefix_block_ids"]
        if fmt == "canonical":  # and the file's other columns (RequestSpec.extra)
            cols = CANONICAL_COLUMNS + [c for c in _csv_header(file)
                                        if c and c not in CANONICAL_COLUMNS]
        if fmt == "vllm_result":
            cols = cols + ["request_id"]
    from servesim.simulator.progress import phase

    def ticking(reqs, tick):
        for k, r in enumerate(reqs, 1):
            tick(k)
            yield r

    try:
        with phase(f"converting {file}") as tick:
            n = write_canonical(ticking(wl, tick), out, cols)
    except KeyboardInterrupt:
        raise Interrupted(f"nothing was written to {out}") from None
    notes = [f"{wl.meta[k]:,} {what}" for k, what in (
        ("skipped_bad_rows", "bad rows skipped"), ("dropped_failed", "failed requests dropped"),
        ("filtered", "filtered out"), ("zero_output", "zero output lengths set to 1"))
        if wl.meta.get(k)]
    typer.echo(f"wrote {n:,} requests to {out}" + (f" ({', '.join(notes)})" if notes else ""))


def _csv_header(path: Path) -> list[str]:
    """The column names of a CSV trace."""
    from servesim.workloads.importers_common import _READ_ERRORS, open_text, read_error

    try:
        with open_text(path, errors="replace") as f:
            return [h.strip() for h in next(csv.reader(f), [])]
    except _READ_ERRORS as e:
        raise read_error(path, e) from None
    except csv.Error:
        return []  # the reader names the malformed header


def register(app: typer.Typer) -> None:
    """Add this concern's commands to ``app``."""
    app.add_typer(trace_app, name="trace")
