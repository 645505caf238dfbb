"""Trace importers: file → stream of :class:`RequestSpec` (streaming, line-numbered errors).

Formats (``format:``; ``auto`` detects by the CSV header / first JSON record):

- ``azure2023`` / ``azure2024``: ``TIMESTAMP,ContextTokens,GeneratedTokens`` (Azure LLM
  inference traces). 2023 stamps are naive with 7 fractional digits, 2024 ones carry ``+00:00``
  and 6 digits; auto-detection tells them apart by the first row's stamp.
- ``burstgpt``: ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type``
  (columns found by name, extras ignored). Failed rows (``Response tokens`` = 0) are dropped as
  vLLM does (counted in ``dropped_failed``) or, with ``keep_failed``, kept with output_len 1.
  ``model`` / ``log_type`` filter rows. Unlike vLLM's sampler we replay the timestamps.
- ``mooncake``: JSONL ``{timestamp (ms), input_length, output_length, hash_ids}``; each hash id
  names a 512-token block, equal leading ids = shared prefix. See :func:`mooncake_block_ids`.
- ``sharegpt``: JSON array (or JSONL) of ``{"conversations": [{"value": ...}, ...]}``; see
  :func:`read_sharegpt` (lengths, vLLM's shuffle and filters). No timestamps.
- ``vidur``: ``arrived_at,num_prefill_tokens,num_decode_tokens`` (s, tokens, tokens).
- ``vllm_result``: ``vllm bench serve --save-detailed`` JSON (``input_lens``, ``output_lens``,
  ``start_times``, ``errors``): a measured run replayed request for request.
- ``canonical``: ``arrival_s,prompt_len,output_len[,prefix_block_ids,priority,session_id,turn,
  lora,parent_id,think_time_s,request_id]``; ``prefix_block_ids`` space-separated ints at the
  engine block size the file was written for. Any other column is kept per request in
  ``RequestSpec.extra`` (numbers as floats), e.g. for ``speculative_config.acceptance.column``.

:func:`read_trace` yields *raw* arrival times (s, in the trace's own time base; 0 for formats
without timestamps). :func:`trace_workload` builds the simulator stream from a ``TraceWorkload``
config: timestamps are shifted so the first request arrives at t=0, then windowed, cut, sampled
and rescaled. Files ending in ``.gz`` are read through gzip.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import random
import re
import zlib
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import numpy as np
from servesim.simulator.errors import TraceError
from servesim.workloads.generators import MOONCAKE_BASE
from servesim.workloads.schema import MAX_TOKENS, RequestSpec

MOONCAKE_BLOCK = 512  # tokens per Mooncake hash id

FORMATS = ("canonical", "azure2023", "azure2024", "burstgpt", "mooncake", "sharegpt", "vidur",
           "vllm_result")
AZURE_HEADER = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
VIDUR_HEADER = ["arrived_at", "num_prefill_tokens", "num_decode_tokens"]
CANONICAL_REQUIRED = ["arrival_s", "prompt_len", "output_len"]
CANONICAL_OPTIONAL = ["prefix_block_ids", "priority", "session_id", "turn", "lora", "parent_id",
                      "think_time_s", "request_id"]
BURSTGPT_COLUMNS = ["Timestamp", "Request tokens", "Response tokens"]


class _Bad(Exception):
    """A malformed row (message without the file:line prefix)."""


# --------------------------------------------------------------------------------------------
# Files and format detection


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


def detect_format(path) -> str:
    """Format name from the CSV header or the first JSON record (see module doc)."""
    try:
        with open_text(path, errors="replace") as f:
            head = f.read(65536)
    except _READ_ERRORS as e:
        raise read_error(path, e) from None
    stripped = head.lstrip()
    if not stripped:
        raise TraceError(f"{path}: empty trace (no header, no requests)")
    if stripped[0] in "[{":
        first = stripped.splitlines()[0].strip()
        try:
            rec = json.loads(first)
        except json.JSONDecodeError:
            rec = None
        if isinstance(rec, dict):
            if "input_length" in rec or "hash_ids" in rec:
                return "mooncake"
            if "conversations" in rec:
                return "sharegpt"
            if "input_lens" in rec or "output_lens" in rec:
                return "vllm_result"
        if stripped[0] == "[":
            return "sharegpt"
        if '"input_lens"' in head or '"output_lens"' in head or '"num_prompts"' in head:
            return "vllm_result"
        raise TraceError(f"{path}: cannot detect the trace format from its first JSON record "
                         "(set workload.format)")
    lines = stripped.splitlines()
    header = [h.strip() for h in next(csv.reader([lines[0]]))]
    if header[:3] == AZURE_HEADER:
        if len(lines) > 1:
            ts = lines[1].split(",")[0].strip()
            if ts.endswith("Z") or "+" in ts[10:] or ts[19:].count("-"):
                return "azure2024"
        return "azure2023"
    if all(c in header for c in BURSTGPT_COLUMNS):
        return "burstgpt"
    if header[:3] == VIDUR_HEADER:
        return "vidur"
    if all(c in header for c in CANONICAL_REQUIRED):
        return "canonical"
    raise TraceError(
        f"{path}:1: cannot detect the trace format from header {','.join(header)!r}: expected "
        "TIMESTAMP,ContextTokens,GeneratedTokens (Azure), Timestamp,Model,Request tokens,... "
        "(BurstGPT), arrived_at,num_prefill_tokens,num_decode_tokens (Vidur) or "
        "arrival_s,prompt_len,output_len (canonical); or set workload.format"
    )


def has_timestamps(path, fmt: str) -> bool:
    """Whether requests of this file carry their own arrival times."""
    if fmt == "sharegpt":
        return False
    if fmt == "vllm_result":
        try:
            with open_text(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise TraceError(f"{path}:{e.lineno}: expected a vllm bench result JSON") from None
        except _READ_ERRORS as e:
            raise read_error(path, e) from None
        return isinstance(d, dict) and bool(d.get("start_times"))
    return True


# --------------------------------------------------------------------------------------------
# Field parsers


def _int(s, what: str) -> int:
    if isinstance(s, bool):
        raise _Bad(f"expected an integer {what}, got {s!r}")
    if isinstance(s, int):
        return s
    try:
        return int(s)
    except (TypeError, ValueError):
        try:
            f = float(s)
        except (TypeError, ValueError):
            f = math.nan
        if math.isfinite(f) and f.is_integer():
            return int(f)
    raise _Bad(f"expected an integer {what}, got {s!r}")


def _float(s, what: str) -> float:
    if isinstance(s, bool):
        raise _Bad(f"expected a number {what}, got {s!r}")
    try:
        f = float(s)
    except (TypeError, ValueError):
        raise _Bad(f"expected a number {what}, got {s!r}") from None
    if not math.isfinite(f):
        raise _Bad(f"expected a finite number {what}, got {s!r}")
    return f


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


def mooncake_block_ids(hash_ids, input_length: int, block_size: int) -> tuple[int, ...] | None:
    """Engine-block content ids for a Mooncake request (``hash_ids`` of 512-token blocks).

    Engine block i covers tokens [i·bs, (i+1)·bs); it counts only when it lies fully inside
    ``input_length``. Its content is identified by the hash id h of the 512-token block holding
    its last token (Mooncake ids chain the whole prefix) and that token's offset in it:
    id = MOONCAKE_BASE + h·512 + ((i+1)·bs − 1) mod 512. For bs dividing 512 this is the pair
    (h, j) of h's j-th sub-block; so requests with k equal leading hash ids share exactly
    k·512/bs leading ids (k·512 tokens)."""
    n = input_length // block_size
    if n <= 0 or not hash_ids:
        return None
    n = min(n, len(hash_ids) * MOONCAKE_BLOCK // block_size)
    if n <= 0:
        return None
    last = (np.arange(1, n + 1, dtype=np.int64) * block_size) - 1
    h = np.asarray(hash_ids, dtype=np.int64)[last // MOONCAKE_BLOCK]
    return tuple((MOONCAKE_BASE + h * MOONCAKE_BLOCK + last % MOONCAKE_BLOCK).tolist())


# --------------------------------------------------------------------------------------------
# Readers: each yields (line, t_s, prompt_len, output_len, extra kwargs or None)


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
    stamp = _Stamps()
    for line, row, _ in _csv_rows(ctx, f, AZURE_HEADER, "Azure"):
        try:
            if len(row) != 3:
                raise _Bad(f"expected 3 fields (TIMESTAMP,ContextTokens,GeneratedTokens), "
                           f"got {len(row)}")
            yield (line, stamp(row[0]), _int(row[1].strip(), "ContextTokens"),
                   _int(row[2].strip(), "GeneratedTokens"), None)
        except _Bad as e:
            ctx.bad(line, str(e))


def _read_vidur(ctx, f, opts):
    for line, row, _ in _csv_rows(ctx, f, VIDUR_HEADER, "Vidur"):
        try:
            if len(row) < 3:
                raise _Bad(f"expected 3 fields ({','.join(VIDUR_HEADER)}), got {len(row)}")
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


def _read_mooncake(ctx, f, opts):
    bs = opts["block_size"]
    for line, text in enumerate(f, 1):
        ctx.line = line
        if not text.strip():
            continue
        if _UNDECODABLE.search(text):
            ctx.bad(line, "invalid UTF-8 bytes (expected UTF-8 text)")
            continue
        try:
            try:
                rec = json.loads(text)
            except json.JSONDecodeError:
                raise _Bad(f"expected a JSON object, got {text.strip()[:40]!r}") from None
            if not isinstance(rec, dict):
                raise _Bad(f"expected a JSON object, got {text.strip()[:40]!r}")
            for k in ("timestamp", "input_length", "output_length"):
                if k not in rec:
                    raise _Bad(f"expected key {k!r} (Mooncake: timestamp, input_length, "
                               "output_length, hash_ids)")
            t = _float(rec["timestamp"], "timestamp (ms)") / 1000.0
            p = _int(rec["input_length"], "input_length")
            o = _int(rec["output_length"], "output_length")
            hids = rec.get("hash_ids") or []
            if not isinstance(hids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hids
            ):
                raise _Bad("expected hash_ids to be a list of non-negative integers")
        except _Bad as e:
            ctx.bad(line, str(e))
            continue
        ids = mooncake_block_ids(hids, max(p, 0), bs) if p > 0 else None
        yield line, t, p, o, {"prefix_block_ids": ids} if ids else None


def _read_canonical(ctx, f, opts):
    bs = opts["block_size"]
    idx = None
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
        yield line, t, p, o, kw or None


def _load_json(ctx, f):
    try:
        return json.load(f)
    except json.JSONDecodeError as e:
        raise TraceError(f"{ctx.name}:{e.lineno}: expected JSON ({e.msg})") from None


def _read_vllm_result(ctx, f, opts):
    d = _load_json(ctx, f)
    if not isinstance(d, dict) or "input_lens" not in d or "output_lens" not in d:
        raise TraceError(f"{ctx.name}: expected a `vllm bench serve --save-detailed` result "
                         "with input_lens and output_lens")
    ins, outs = d["input_lens"], d["output_lens"]
    starts = d.get("start_times") or None
    errs = d.get("errors") or [""] * len(ins)
    if len(outs) != len(ins) or (starts is not None and len(starts) != len(ins)):
        raise TraceError(f"{ctx.name}: input_lens, output_lens and start_times differ in length")
    order = range(len(ins))
    if starts is not None:
        try:
            order = sorted(order, key=lambda i: float(starts[i]))
        except (TypeError, ValueError):
            raise TraceError(f"{ctx.name}: expected numbers in start_times") from None
    keep_failed = opts.get("keep_failed", False)
    for i in order:
        try:
            p = _int(ins[i], "input_lens entry")
            o = _int(outs[i], "output_lens entry")
            t = _float(starts[i], "start_times entry") if starts is not None else 0.0
        except _Bad as e:
            ctx.bad(f"request {i}", str(e))
            continue
        failed = bool(i < len(errs) and errs[i]) or o == 0
        if failed:
            ctx.stats["dropped_failed"] += 0 if keep_failed else 1
            if not keep_failed:
                continue
            o = max(o, 1)
        yield f"request {i}", t, p, o, {"request_id": str(i)}


def _tokenizer_len(name: str | None, path: str) -> Callable[[str], int]:
    """Token counter: a local HF tokenizer when named (never downloads), else ceil(chars/4)."""
    if name is None:
        return lambda s: math.ceil(len(s) / 4)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TraceError(f"{path}: tokenizer {name!r} needs the transformers package") from None
    try:
        tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any loading failure is a one-line user error
        raise TraceError(f"{path}: cannot load tokenizer {name!r} locally ({e})") from None
    return lambda s: len(tok(s).input_ids)


def read_sharegpt(ctx, f, opts):
    """ShareGPT as vLLM's ``ShareGPTDataset``: keep entries with ≥ 2 turns, shuffle with
    ``random.seed(seed)``, turn 0 = prompt, turn 1 = completion. Lengths: the entry's
    ``prompt_len``/``output_len`` fields when present, else a local tokenizer (``tokenizer``),
    else ceil(characters/4). ``sharegpt_output_len`` overrides the output length. Filter
    (``sharegpt_filter``, vLLM ``is_valid_sequence``): drop prompt < 4, output < 4 (unless
    overridden), prompt > 1024, prompt + output > 2048 (counted in ``filtered``). The file is
    read whole (a JSON array); only lengths are kept."""
    text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(x) for x in text.splitlines() if x.strip()]
        except json.JSONDecodeError as e:
            raise TraceError(f"{ctx.name}:{e.lineno}: expected a ShareGPT JSON array") from None
    if not isinstance(data, list):
        raise TraceError(f"{ctx.name}: expected a ShareGPT JSON array of conversations")
    pre = [d for d in data if isinstance(d, dict) and "prompt_len" in d and "output_len" in d]
    data = pre if pre else [
        d for d in data
        if isinstance(d, dict) and isinstance(d.get("conversations"), list)
        and len(d["conversations"]) >= 2
    ]
    random.Random(opts.get("seed", 0)).shuffle(data)
    count = None if pre else _tokenizer_len(opts.get("tokenizer"), ctx.name)
    fixed_out = opts.get("sharegpt_output_len")
    for i, d in enumerate(data):
        try:
            if pre:
                p, o = _int(d["prompt_len"], "prompt_len"), _int(d["output_len"], "output_len")
            else:
                c = d["conversations"]
                if not all(isinstance(x, dict) and isinstance(x.get("value"), str)
                           for x in c[:2]):
                    raise _Bad("expected conversations[0..1] with string 'value'")
                p, o = count(c[0]["value"]), count(c[1]["value"])
        except _Bad as e:
            ctx.bad(f"entry {d.get('id', i)!s}", str(e))
            continue
        if fixed_out is not None:
            o = fixed_out
        if opts.get("sharegpt_filter", True) and (
            p < 4 or (fixed_out is None and o < 4) or p > 1024 or p + o > 2048
        ):
            ctx.stats["filtered"] += 1
            continue
        yield f"entry {i}", 0.0, p, o, None


_READERS = {
    "azure2023": _read_azure, "azure2024": _read_azure, "burstgpt": _read_burstgpt,
    "mooncake": _read_mooncake, "canonical": _read_canonical, "vidur": _read_vidur,
    "vllm_result": _read_vllm_result, "sharegpt": read_sharegpt,
}


def read_trace(path, format: str = "auto", *, block_size: int = 16, skip_bad_rows: bool = False,
               stats: dict | None = None, check_order: bool | None = None,
               **opts) -> Iterator[RequestSpec]:
    """Requests of a trace file with raw arrival times (s in the trace's own time base).

    Checks every row: malformed fields, negative lengths, a zero prompt and timestamps going
    back in time each raise a :class:`TraceError` ``file:line: ...`` (or, with
    ``skip_bad_rows``, are skipped and counted in ``stats["skipped_bad_rows"]``). A zero output
    length becomes 1 (counted in ``stats["zero_output"]``). An empty trace is an error.
    ``opts``: model, log_type, keep_failed (BurstGPT, vllm_result), tokenizer,
    sharegpt_output_len, sharegpt_filter, seed (ShareGPT)."""
    fmt = detect_format(path) if format == "auto" else format
    if fmt not in _READERS:
        raise TraceError(f"{path}: unknown trace format {fmt!r} (one of {', '.join(FORMATS)})")
    stats = {} if stats is None else stats
    ctx = _Ctx(path, skip_bad_rows, stats)
    if check_order is None:
        check_order = fmt != "sharegpt"
    opts["block_size"] = block_size
    n = 0
    per_row = fmt not in ("sharegpt", "vllm_result")  # whole-file JSON: decode strictly
    rows = _guarded(path, ctx, _rows(ctx, fmt, opts, "surrogateescape" if per_row else "strict"))
    prev = -math.inf
    for line, t, p, o, kw in rows:
        if p < 0 or o < 0:
            what = "prompt" if p < 0 else "output"
            ctx.bad(line, f"negative {what} length {p if p < 0 else o} "
                          "(token counts must be >= 0)")
            continue
        if p > MAX_TOKENS or o > MAX_TOKENS:
            what = "prompt" if p > MAX_TOKENS else "output"
            ctx.bad(line, f"{what} length {p if p > MAX_TOKENS else o} is out of range "
                          f"(token counts must be <= {MAX_TOKENS:,})")
            continue
        if p == 0:
            ctx.bad(line, "prompt length 0 (a request needs at least one prompt token)")
            continue
        if check_order:
            if t < prev:
                ctx.bad(line, f"timestamp goes back in time ({t:.6f} s after the first row, "
                              f"previous row at {prev:.6f} s): expected rows sorted by "
                              "arrival time")
                continue
            prev = t
        if o == 0:
            stats["zero_output"] += 1
            o = 1
        n += 1
        if kw:
            yield RequestSpec(arrival_s=t, prompt_len=p, output_len=o, **kw)
        else:
            yield RequestSpec(arrival_s=t, prompt_len=p, output_len=o)
    if n == 0:
        why = ""
        if stats.get("skipped_bad_rows"):
            why = f" ({stats['skipped_bad_rows']} bad rows skipped)"
        elif stats.get("filtered") or stats.get("dropped_failed"):
            why = (f" ({stats.get('filtered', 0)} filtered out, "
                   f"{stats.get('dropped_failed', 0)} failed rows dropped)")
        raise TraceError(f"{path}: empty trace: no requests{why}")


def _rows(ctx, fmt: str, opts: dict, errors: str):
    with open_text(ctx.name, errors=errors) as f:
        yield from _READERS[fmt](ctx, f, opts)


def _guarded(path, ctx, rows):
    """``rows``, with read failures of the file itself (bad gzip, not UTF-8) as TraceError."""
    try:
        yield from rows
    except _READ_ERRORS as e:
        raise read_error(path, e, ctx.line) from None


# --------------------------------------------------------------------------------------------
# kind: trace


def _reader_opts(cfg) -> dict:
    return {"model": cfg.model, "log_type": cfg.log_type, "keep_failed": cfg.keep_failed,
            "tokenizer": cfg.tokenizer, "sharegpt_output_len": cfg.sharegpt_output_len,
            "sharegpt_filter": cfg.sharegpt_filter, "seed": cfg.seed}


def trace_workload(cfg, block_size: int, meta: dict) -> Callable[[dict], Iterator[RequestSpec]]:
    """Factory of the request stream of a ``kind: trace`` config (see module doc).

    Order of operations: read (raw stamps) → shift so the trace's first row is at 0 → window
    [start_s, end_s) → first ``max_requests`` → seeded ``sample`` → shift so the first kept
    request is at 0 → rescale by ``time_scale``, or to the mean rate ``request_rate``
    (= (N−1)/(last − first)). Formats without timestamps (or ``use_timestamps: false``) get
    vLLM's ``get_request`` arrivals at ``request_rate`` (default inf) and ``burstiness``.
    ``sample``/``request_rate``/generated arrivals need a counting pre-pass over the file.
    ``meta`` gets ``num_prompts`` and the mean ``request_rate`` once they are known (up front
    when a pre-pass ran, else at the end of the first full iteration)."""
    from servesim.simulator.errors import ConfigError
    from servesim.workloads.arrivals import vllm_arrival_times
    from servesim.workloads.transforms import (
        mean_rate,
        sample_indices,
        scale_time,
        select,
        shift_to_zero,
        take,
        time_window,
    )

    fmt = detect_format(cfg.path) if cfg.format == "auto" else cfg.format
    stamped = cfg.use_timestamps and has_timestamps(cfg.path, fmt)
    if not stamped and (cfg.start_s is not None or cfg.end_s is not None):
        raise ConfigError(f"workload.start_s/end_s: {cfg.path} ({fmt}) has no timestamps to "
                          "window (use max_requests)")
    if cfg.request_rate is not None and cfg.time_scale != 1.0:
        raise ConfigError("workload.time_scale: set either time_scale or request_rate, not both")
    opts = _reader_opts(cfg)
    meta.update(dataset_name=fmt, dataset_path=str(cfg.path), burstiness=cfg.burstiness,
                request_rate=cfg.request_rate if cfg.request_rate is not None else math.inf,
                time_scale=cfg.time_scale, timestamps="trace" if stamped else "generated")

    def base(stats: dict) -> Iterator[RequestSpec]:
        s = read_trace(cfg.path, fmt, block_size=block_size, skip_bad_rows=cfg.skip_bad_rows,
                       stats=stats, check_order=stamped, **opts)
        if stamped:
            s = time_window(shift_to_zero(s), cfg.start_s, cfg.end_s)
        return take(s, cfg.max_requests)

    def survey(stats=None) -> tuple[int, float]:
        n, last = 0, 0.0
        for r in base({} if stats is None else stats):
            n, last = n + 1, r.arrival_s
        return n, last

    indices = None
    total = None
    if cfg.sample is not None:
        total, _ = survey()
        indices = sample_indices(total, cfg.sample, cfg.seed)
        total = len(indices)

    def selected(stats: dict) -> Iterator[RequestSpec]:
        s = base(stats)
        return select(s, indices) if indices is not None else s

    factor = cfg.time_scale
    if not stamped:
        if total is None:
            total, _ = survey()
        meta["num_prompts"] = total
    elif cfg.request_rate is not None:
        n, first, last = 0, 0.0, 0.0
        for r in shift_to_zero(selected({})):
            n, last = n + 1, r.arrival_s
        total = n
        rate0 = mean_rate(n, first, last)
        if math.isinf(rate0):
            raise ConfigError(f"workload.request_rate: every request of {cfg.path} arrives at "
                              "the same time; there is no rate to rescale")
        factor = rate0 / cfg.request_rate
        meta["num_prompts"] = n
    elif total is not None:
        meta["num_prompts"] = total

    def gen(stats: dict) -> Iterator[RequestSpec]:
        n, last = 0, 0.0
        if stamped:
            for r in scale_time(shift_to_zero(selected(stats)), factor):
                n, last = n + 1, r.arrival_s
                yield r
            if meta.get("num_prompts") is None:
                meta["num_prompts"] = n
            if cfg.request_rate is None:
                meta["request_rate"] = mean_rate(n, 0.0, last)
            return
        rate = cfg.request_rate if cfg.request_rate is not None else math.inf
        times = (t for chunk in vllm_arrival_times(total, rate, cfg.burstiness, cfg.seed)
                 for t in chunk.tolist())
        for r, t in zip(selected(stats), times):
            r.arrival_s = t
            yield r

    return gen
