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
  names a 512-token block, equal leading ids = shared prefix. See
  :func:`~servesim.workloads.importers_json.mooncake_block_ids`.
- ``sharegpt``: JSON array (or JSONL) of ``{"conversations": [{"value": ...}, ...]}``; see
  :func:`~servesim.workloads.importers_json.read_sharegpt` (lengths, vLLM's shuffle and
  filters). No timestamps.
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

This module detects the format and holds the reader registry, :func:`read_trace` and
:func:`trace_workload`; the readers are in ``importers_csv.py`` (Azure, BurstGPT, Vidur,
canonical) and ``importers_json.py`` (Mooncake, vllm_result, ShareGPT), on the file opening,
field parsers and bad-row handling of ``importers_common.py``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterator

from servesim.simulator.errors import TraceError
from servesim.workloads.importers_common import _READ_ERRORS, _Ctx, open_text, read_error
from servesim.workloads.importers_csv import (
    AZURE_HEADER,
    BURSTGPT_COLUMNS,
    CANONICAL_REQUIRED,
    VIDUR_HEADER,
    _read_azure,
    _read_burstgpt,
    _read_canonical,
    _read_vidur,
)
from servesim.workloads.importers_json import (
    _json_error,
    _read_mooncake,
    _read_vllm_result,
    read_sharegpt,
)
from servesim.workloads.schema import MAX_ARRIVAL_S, MAX_TOKENS, RequestSpec

FORMATS = ("canonical", "azure2023", "azure2024", "burstgpt", "mooncake", "sharegpt", "vidur",
           "vllm_result")


# --------------------------------------------------------------------------------------------
# Files and format detection


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
    if head.startswith("\x1f\ufffd"):  # gzip's magic bytes 1f 8b, not UTF-8
        raise TraceError(f"{path}: gzip data; name the file *.gz to read it through gzip")
    if stripped[0] in "[{":
        # "\n" only: str.splitlines() also splits at U+2028 and others, valid inside JSON strings
        first = stripped.split("\n", 1)[0].strip()
        try:
            rec = json.loads(first)
        except (ValueError, RecursionError):
            rec = None
            if stripped[0] == "{" and ('"input_length"' in first or '"hash_ids"' in first):
                return "mooncake"  # a bad first record: the reader names its problem
        if (isinstance(rec, list) and rec and isinstance(rec[0], dict)
                and "input_length" in rec[0]):
            raise TraceError(f"{path}: a JSON array of Mooncake records; expected JSONL (one "
                             "JSON object per line), or set workload.format")
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
        except (ValueError, RecursionError) as e:  # an int past 4300 digits, deep nesting
            raise TraceError(f"{path}: expected a vllm bench result JSON ({_json_error(e)})"
                             ) from None
        except _READ_ERRORS as e:
            raise read_error(path, e) from None
        return isinstance(d, dict) and bool(d.get("start_times"))
    return True


# --------------------------------------------------------------------------------------------
# Readers (importers_csv.py, importers_json.py): each yields (line, t_s, prompt_len,
# output_len, extra kwargs or None)

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
    ``skip_bad_rows``, are skipped and counted in ``stats["skipped_bad_rows"]``), and so does an
    arrival more than ``MAX_ARRIVAL_S`` (1e8 s, about 3.2 years) away from the first request's
    (a typo such as year 2203 for 2023, or a unit mix-up). A zero output
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
    prev, t0 = -math.inf, None
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
        if check_order and t < prev:
            ctx.bad(line, f"timestamp goes back in time ({t:.6f} s after the first row, "
                          f"previous row at {prev:.6f} s): expected rows sorted by "
                          "arrival time")
            continue
        if t0 is not None and abs(t - t0) > MAX_ARRIVAL_S:
            ctx.bad(line, f"arrival {t - t0:.6g} s after the first request is out of range "
                          f"(at most {MAX_ARRIVAL_S:,.0f} s, about 3.2 years): a typo in the "
                          "timestamp?")
            continue
        if check_order:
            prev = t
        if o == 0:
            stats["zero_output"] += 1
            o = 1
        if t0 is None:
            t0 = t
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

    def windowed(s: Iterator[RequestSpec]) -> Iterator[RequestSpec]:
        """``s`` (shifted to 0) in [start_s, end_s) (as ``transforms.time_window``); a window
        with no request is an error naming the trace's span (read to its end to find it)."""
        lo = -math.inf if cfg.start_s is None else cfg.start_s
        hi = math.inf if cfg.end_s is None else cfg.end_s
        n, last = 0, 0.0
        for r in s:
            last = r.arrival_s
            if last >= hi and n:
                return
            if lo <= last < hi:
                n += 1
                yield r
        if n == 0:
            end = "inf" if cfg.end_s is None else f"{cfg.end_s:g}"
            raise ConfigError(f"workload.start_s/end_s: no request of {cfg.path} arrives in "
                              f"[{cfg.start_s or 0:g}, {end}) s (the trace spans 0-{last:g} s)")

    def base(stats: dict) -> Iterator[RequestSpec]:
        s = read_trace(cfg.path, fmt, block_size=block_size, skip_bad_rows=cfg.skip_bad_rows,
                       stats=stats, check_order=stamped, **opts)
        if stamped and (cfg.start_s is not None or cfg.end_s is not None):
            s = windowed(shift_to_zero(s))
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

    def too_late(t: float) -> ConfigError:
        what = "request_rate" if cfg.request_rate is not None else "time_scale"
        return ConfigError(f"workload.{what}: stretches {cfg.path} to an arrival at {t:.6g} s "
                           f"(at most {MAX_ARRIVAL_S:,.0f} s, about 3.2 years)")

    def gen(stats: dict) -> Iterator[RequestSpec]:
        n, last = 0, 0.0
        if stamped:
            for r in scale_time(shift_to_zero(selected(stats)), factor):
                n, last = n + 1, r.arrival_s
                if last > MAX_ARRIVAL_S:
                    raise too_late(last)
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
            if t > MAX_ARRIVAL_S:
                raise too_late(t)
            r.arrival_s = t
            yield r

    return gen
