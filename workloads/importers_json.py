"""JSON trace readers: Mooncake JSONL (``hash_ids`` → engine block ids), ``vllm bench serve
--save-detailed`` results and ShareGPT. Each reader yields ``(line, t_s, prompt_len,
output_len, extra kwargs or None)`` per request; the rules of each format are in
:mod:`servesim.workloads.importers`."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable

import numpy as np
from servesim.simulator.errors import TraceError
from servesim.workloads.generators import MOONCAKE_BASE
from servesim.workloads.importers_common import _UNDECODABLE, _Bad, _float, _int, _short

MOONCAKE_BLOCK = 512  # tokens per Mooncake hash id
# The largest hash id whose block ids stay below 2^62 (the id ranges of generators.py); real
# traces number their blocks from 0, so a larger id is malformed.
MOONCAKE_MAX_HASH = (2**62 - MOONCAKE_BASE) // MOONCAKE_BLOCK - 1


def _json_error(e: Exception) -> str:
    """Why a JSON text could not be decoded, in a few words."""
    if isinstance(e, json.JSONDecodeError):
        return e.msg
    if isinstance(e, RecursionError):
        return "nested too deeply"
    return str(e).split(":")[0]  # "Exceeds the limit (4300 digits) for integer string ..."


def _jint(v, what: str) -> int:
    """An integer from a JSON value: a number, not a string of digits."""
    if isinstance(v, str):
        raise _Bad(f"expected an integer {what}, got the string {_short(v)}")
    return _int(v, what)


def _jfloat(v, what: str) -> float:
    """A finite number from a JSON value: a number, not a string of digits."""
    if isinstance(v, str):
        raise _Bad(f"expected a number {what}, got the string {_short(v)}")
    return _float(v, what)


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
            except (ValueError, RecursionError) as e:  # ValueError: an int past 4300 digits
                raise _Bad(f"expected a JSON object ({_json_error(e)}), got "
                           f"{text.strip()[:40]!r}") from None
            if not isinstance(rec, dict):
                raise _Bad(f"expected a JSON object, got {text.strip()[:40]!r}")
            for k in ("timestamp", "input_length", "output_length"):
                if k not in rec:
                    raise _Bad(f"expected key {k!r} (Mooncake: timestamp, input_length, "
                               "output_length, hash_ids)")
            t = _jfloat(rec["timestamp"], "timestamp (ms)") / 1000.0
            p = _jint(rec["input_length"], "input_length")
            o = _jint(rec["output_length"], "output_length")
            hids = rec.get("hash_ids") or []
            if not isinstance(hids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hids
            ):
                raise _Bad("expected hash_ids to be a list of non-negative integers")
            big = next((h for h in hids if h > MOONCAKE_MAX_HASH), None)
            if big is not None:
                raise _Bad(f"hash_ids entry {_short(big)} is too large (at most "
                           f"{MOONCAKE_MAX_HASH:,})")
        except _Bad as e:
            ctx.bad(line, str(e))
            continue
        ids = mooncake_block_ids(hids, max(p, 0), bs) if p > 0 else None
        yield line, t, p, o, {"prefix_block_ids": ids} if ids else None


def _load_json(ctx, f):
    try:
        return json.load(f)
    except json.JSONDecodeError as e:
        raise TraceError(f"{ctx.name}:{e.lineno}: expected JSON ({e.msg})") from None
    except (ValueError, RecursionError) as e:
        raise TraceError(f"{ctx.name}: expected JSON ({_json_error(e)})") from None


def _list(ctx, d: dict, key: str, n: int | None = None, optional: bool = False) -> list | None:
    """``d[key]`` checked to be a list (of ``n`` entries when given); None when ``optional``
    and absent, null or empty."""
    v = d.get(key)
    if optional and (v is None or v == []):
        return None
    if not isinstance(v, list):
        raise TraceError(f"{ctx.name}: {key}: expected a list (one entry per request), got "
                         f"{type(v).__name__} {_short(v)}")
    if n is not None and len(v) != n:
        raise TraceError(f"{ctx.name}: {key}: expected {n} entries (one per input_lens entry), "
                         f"got {len(v)}")
    return v


def _sort_key(x) -> float:
    """A start time to sort by: non-finite ones (refused row by row) last."""
    try:
        f = float(x)
    except OverflowError:
        return math.inf
    return f if math.isfinite(f) else math.inf


def _read_vllm_result(ctx, f, opts):
    d = _load_json(ctx, f)
    if not isinstance(d, dict) or "input_lens" not in d or "output_lens" not in d:
        raise TraceError(f"{ctx.name}: expected a `vllm bench serve --save-detailed` result "
                         "with input_lens and output_lens")
    ins = _list(ctx, d, "input_lens")
    outs = _list(ctx, d, "output_lens", len(ins))
    starts = _list(ctx, d, "start_times", len(ins), optional=True)
    errs = _list(ctx, d, "errors", len(ins), optional=True) or [""] * len(ins)
    order = range(len(ins))
    if starts is not None:
        bad = [x for x in starts if not isinstance(x, (int, float)) or isinstance(x, bool)]
        if bad:
            raise TraceError(f"{ctx.name}: start_times: expected a list of numbers, got "
                             f"{_short(bad[0])}")
        order = sorted(order, key=lambda i: _sort_key(starts[i]))
    keep_failed = opts.get("keep_failed", False)
    for i in order:
        try:
            p = _jint(ins[i], "input_lens entry")
            o = _jint(outs[i], "output_lens entry")
            t = _jfloat(starts[i], "start_times entry") if starts is not None else 0.0
        except _Bad as e:
            ctx.bad(f"request {i}", str(e))
            continue
        failed = bool(errs[i]) or o == 0
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
    overridden), prompt > 1024, prompt + output > 2048 (counted in ``filtered``, as are the
    entries dropped for < 2 turns, for not being objects, or for lacking ``prompt_len`` /
    ``output_len`` when other entries have them). Errors and requests name an entry by its
    position in the file (from 0). The file is read whole (a JSON array); only lengths are
    kept."""
    text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(x) for x in text.split("\n") if x.strip()]
        except json.JSONDecodeError as e:
            raise TraceError(f"{ctx.name}:{e.lineno}: expected a ShareGPT JSON array") from None
        except (ValueError, RecursionError) as e:
            raise TraceError(f"{ctx.name}: expected JSON ({_json_error(e)})") from None
    except (ValueError, RecursionError) as e:
        raise TraceError(f"{ctx.name}: expected JSON ({_json_error(e)})") from None
    if not isinstance(data, list):
        raise TraceError(f"{ctx.name}: expected a ShareGPT JSON array of conversations")
    pre = [(i, d) for i, d in enumerate(data)
           if isinstance(d, dict) and "prompt_len" in d and "output_len" in d]
    kept = pre if pre else [
        (i, d) for i, d in enumerate(data)
        if isinstance(d, dict) and isinstance(d.get("conversations"), list)
        and len(d["conversations"]) >= 2
    ]
    ctx.stats["filtered"] += len(data) - len(kept)
    random.Random(opts.get("seed", 0)).shuffle(kept)  # the same permutation as vLLM's
    count = None if pre else _tokenizer_len(opts.get("tokenizer"), ctx.name)
    fixed_out = opts.get("sharegpt_output_len")
    for i, d in kept:
        try:
            if pre:
                p = _jint(d["prompt_len"], "prompt_len")
                o = _jint(d["output_len"], "output_len")
            else:
                c = d["conversations"]
                if not all(isinstance(x, dict) and isinstance(x.get("value"), str)
                           for x in c[:2]):
                    raise _Bad("expected conversations[0..1] with string 'value'")
                p, o = count(c[0]["value"]), count(c[1]["value"])
        except _Bad as e:
            ctx.bad(f"entry {i}" + (f" (id {_short(d['id'])})" if "id" in d else ""), str(e))
            continue
        if fixed_out is not None:
            o = fixed_out
        if opts.get("sharegpt_filter", True) and (
            p < 4 or (fixed_out is None and o < 4) or p > 1024 or p + o > 2048
        ):
            ctx.stats["filtered"] += 1
            continue
        yield f"entry {i}", 0.0, p, o, None
