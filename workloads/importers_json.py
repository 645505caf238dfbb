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
from servesim.workloads.importers_common import _UNDECODABLE, _Bad, _float, _int

MOONCAKE_BLOCK = 512  # tokens per Mooncake hash id


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
