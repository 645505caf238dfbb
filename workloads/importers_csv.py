"""CSV trace readers: Azure LLM inference traces (2023, 2024), BurstGPT, Vidur and the
canonical CSV. Each reader yields ``(line, t_s, prompt_len, output_len, extra kwargs or None)``
per data row; the rules of each format are in :mod:`servesim.workloads.importers`."""

from __future__ import annotations

import csv
from datetime import datetime

from servesim.simulator.errors import TraceError
from servesim.workloads.importers_common import _UNDECODABLE, _Bad, _Ctx, _float, _int

AZURE_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
VIDUR_HEADER = ["arrived_at", "num_prefill_tokens", "num_decode_tokens"]
CANONICAL_REQUIRED = ["arrival_s", "prompt_len", "output_len"]
CANONICAL_OPTIONAL = ["prefix_block_ids", "priority", "session_id", "turn", "lora", "parent_id",
                      "think_time_s", "request_id"]
BURSTGPT_COLUMNS = ["Timestamp", "Request tokens", "Response tokens"]
# A canonical row's prefix_block_ids of a long prompt at a small block size runs past the csv
# module's default 131,072-character field limit (a converted Mooncake conversation trace has
# 143,256): take fields up to the token limit's size
csv.field_size_limit(2**31 - 1)


class _Stamps:
    """Azure ``TIMESTAMP`` → seconds since the first row's stamp (µs resolution)."""

    def __init__(self):
        self.t0: datetime | None = None

    def __call__(self, s: str) -> float:
        s = s.strip()
        try:
            dt = datetime.fromisoformat(s)
        except ValueError:
            raise _Bad(
                f"expected a TIMESTAMP like '2023-11-16 18:15:46.6805900', got {s!r}"
            ) from None
        if self.t0 is None:
            self.t0 = dt
        try:
            return (dt - self.t0).total_seconds()
        except TypeError:
            raise _Bad(f"TIMESTAMP {s!r} mixes time-zone-aware and naive stamps") from None


def _csv_rows(ctx: _Ctx, f, expect_header: list[str] | None, fmt: str):
    """(line_no, fields, header) for the data rows of a CSV file."""
    reader = csv.reader(f)
    try:
        header = next(reader)
    except StopIteration:
        raise TraceError(f"{ctx.name}: empty trace (no header, no requests)") from None
    except csv.Error as e:
        raise TraceError(f"{ctx.name}:1: malformed CSV header ({e})") from None
    header = [h.strip() for h in header]
    seen = set()
    for c in header:
        if c and c in seen:
            raise TraceError(f"{ctx.name}:1: duplicate column {c!r}")
        seen.add(c)
    if expect_header is not None and header[: len(expect_header)] != expect_header:
        raise TraceError(f"{ctx.name}:1: expected the {fmt} header {','.join(expect_header)}, "
                         f"got {','.join(header)!r}")
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            ctx.bad(reader.line_num, f"malformed CSV row ({e})")
            continue
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        ctx.line = reader.line_num
        if _UNDECODABLE.search("".join(row)):
            ctx.bad(reader.line_num, "invalid UTF-8 bytes (expected UTF-8 text)")
            continue
        yield reader.line_num, row, header


def _read_azure(ctx, f, opts):
    """Columns past the three of the header are ignored (every row must have them all)."""
    stamp = _Stamps()
    for line, row, header in _csv_rows(ctx, f, AZURE_HEADER, "Azure"):
        try:
            if len(row) != len(header):
                raise _Bad(f"expected {len(header)} fields ({','.join(header)}), "
                           f"got {len(row)}")
            yield (line, stamp(row[0]), _int(row[1].strip(), "ContextTokens"),
                   _int(row[2].strip(), "GeneratedTokens"), None)
        except _Bad as e:
            ctx.bad(line, str(e))


def _read_vidur(ctx, f, opts):
    for line, row, header in _csv_rows(ctx, f, VIDUR_HEADER, "Vidur"):
        try:
            if len(row) != len(header):
                raise _Bad(f"expected {len(header)} fields ({','.join(header)}), got {len(row)}")
            yield (line, _float(row[0], "arrived_at"), _int(row[1], "num_prefill_tokens"),
                   _int(row[2], "num_decode_tokens"), None)
        except _Bad as e:
            ctx.bad(line, str(e))


def _read_burstgpt(ctx, f, opts):
    model, log_type, keep_failed = opts.get("model"), opts.get("log_type"), opts.get(
        "keep_failed", False)
    idx = None
    for line, row, header in _csv_rows(ctx, f, None, "BurstGPT"):
        if idx is None:
            missing = [c for c in BURSTGPT_COLUMNS if c not in header]
            if missing:
                raise TraceError(f"{ctx.name}:1: expected BurstGPT columns "
                                 f"{', '.join(BURSTGPT_COLUMNS)}; missing {', '.join(missing)}")
            idx = {c: header.index(c) for c in header}
            need = max(idx[c] for c in BURSTGPT_COLUMNS) + 1
        try:
            if len(row) < need:
                raise _Bad(f"expected {len(header)} fields ({','.join(header)}), got {len(row)}")
            if model is not None and row[idx["Model"]].strip() != model:
                ctx.stats["filtered"] += 1
                continue
            if log_type is not None and row[idx["Log Type"]].strip() != log_type:
                ctx.stats["filtered"] += 1
                continue
            t = _float(row[idx["Timestamp"]], "Timestamp")
            p = _int(row[idx["Request tokens"]].strip(), "Request tokens")
            o = _int(row[idx["Response tokens"]].strip(), "Response tokens")
        except _Bad as e:
            ctx.bad(line, str(e))
            continue
        if o == 0:
            ctx.stats["dropped_failed"] += 0 if keep_failed else 1
            if not keep_failed:
                continue
            o = 1
        yield line, t, p, o, None


def _read_canonical(ctx, f, opts):
    """Besides the fields: a ``request_id`` may appear once in the file, and a ``parent_id``
    must name another request of it (its ``request_id``, or a row position from 0: the id the
    client gives a row without one), checked at the end of the file. The request_ids are held
    in memory."""
    bs = opts["block_size"]
    idx = None
    rids: dict[str, int] = {}  # request_id -> line
    missing_parents: dict[str, int] = {}  # parent_id not seen yet -> first line naming it
    k = 0  # position of the row among the rows read
    for line, row, header in _csv_rows(ctx, f, None, "canonical"):
        if idx is None:
            missing = [c for c in CANONICAL_REQUIRED if c not in header]
            if missing:
                raise TraceError(f"{ctx.name}:1: expected canonical columns "
                                 f"{','.join(CANONICAL_REQUIRED)}[,...]; missing "
                                 f"{', '.join(missing)}")
            idx = {c: i for i, c in enumerate(header)}
            opt = [c for c in CANONICAL_OPTIONAL if c in idx]
            # other columns ride along in RequestSpec.extra (numbers as floats), e.g. a
            # per-request acceptance rate for speculative_config.acceptance.column
            others = [(c, i) for i, c in enumerate(header)
                      if c and c not in CANONICAL_REQUIRED and c not in CANONICAL_OPTIONAL]
        try:
            if len(row) != len(header):
                raise _Bad(f"expected {len(header)} fields ({','.join(header)}), got {len(row)}")
            t = _float(row[idx["arrival_s"]], "arrival_s")
            p = _int(row[idx["prompt_len"]].strip(), "prompt_len")
            o = _int(row[idx["output_len"]].strip(), "output_len")
            kw = {}
            for c in opt:
                v = row[idx[c]].strip()
                if not v:
                    continue
                if c == "prefix_block_ids":
                    ids = tuple(_int(x, "prefix_block_ids entry") for x in v.split())
                    if len(ids) > (max(p, 0) + max(o, 0)) // bs:
                        raise _Bad(
                            f"{len(ids)} prefix_block_ids but only {(p + o) // bs} full blocks "
                            f"of {bs} tokens in prompt+output (written for another block size?)"
                        )
                    kw[c] = ids or None
                elif c in ("priority", "turn"):
                    kw[c] = _int(v, c)
                elif c == "think_time_s":
                    kw[c] = _float(v, c)
                else:
                    kw[c] = v
            rid, parent = kw.get("request_id"), kw.get("parent_id")
            if rid is not None and rid in rids:
                raise _Bad(f"duplicate request_id {rid!r} (first at line {rids[rid]})")
            if parent is not None and parent == rid:
                raise _Bad(f"parent_id {parent!r} names the request itself")
            if others:
                extra = {}
                for c, i in others:
                    v = row[i].strip()
                    if v:
                        try:
                            extra[c] = float(v)
                        except ValueError:
                            extra[c] = v
                if extra:
                    kw["extra"] = extra
        except _Bad as e:
            ctx.bad(line, str(e))
            continue
        if rid is not None:
            rids[rid] = line
            missing_parents.pop(rid, None)
        if parent is not None and parent not in rids:
            missing_parents.setdefault(parent, line)
        yield line, t, p, o, kw or None
        k += 1
    # a parent named by position: rows without a request_id get their index as id
    for parent, line in missing_parents.items():
        if not (parent.isascii() and parent.isdigit() and int(parent) < k):
            raise TraceError(f"{ctx.name}:{line}: parent_id {parent!r} names no request in "
                             "the trace")
