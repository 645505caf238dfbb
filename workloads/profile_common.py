"""What every benchmark-client profile reader returns (:class:`ProfileSpec`) and the small
helpers the readers share: numbers and duration strings, snake/camel/kebab-case keys, the
request stream and the block ids of a profile's shared system prompts."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from servesim.workloads.schema import MAX_TOKENS, RequestSpec

PROFILE_PREFIX_BASE = 6 << 56  # + (group << 24) + block: shared system prompts of profiles
MAX_TABLE = 1_000_000  # prompts (or prefix-pool entries) a profile's data may hold in memory


@dataclass
class ProfileSpec:
    """A profile as the simulator runs it."""

    format: str
    stages: list[dict]  # Stage fields (workloads/config.py), in order
    source: Callable[[int, int], Iterator[RequestSpec]]  # (restart k, block_size) -> requests
    restart_data: bool = False  # every stage starts the request source afresh
    warmup: dict | None = None  # {num_requests | duration_s}, leading part of every stage
    client: dict = field(default_factory=dict)  # request_timeout_s, max_retries
    max_concurrency: int | None = None
    ignored: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _num(v: Any, where: str) -> float:
    """A number, also from AIPerf duration strings ("30s", "5m", "1h")."""
    if isinstance(v, bool):
        raise ValueError(f"{where}: expected a number, got {v!r}")  # noqa: TRY004 (a config error)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(ms|s|m|h)?\s*", v)
        if m:
            x = float(m.group(1))
            return x * {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}[m.group(2)]
        if v.strip().lower() in ("inf", "infinity"):
            return math.inf
    raise ValueError(f"{where}: expected a number, got {v!r}")


def _pos(v: Any, where: str, *, integer: bool = False, zero: bool = False,
         hi: float | None = None) -> Any:
    """``_num(v)``, refused (one line naming ``where``) unless finite, > 0 (>= 0 with
    ``zero``), at most ``hi``, and whole with ``integer``."""
    x = _num(v, where)
    if not (math.isfinite(x) and (x >= 0 if zero else x > 0) and (hi is None or x <= hi)
            and (not integer or x == int(x))):
        top = "" if hi is None else f" and <= {hi:g}" if float(f"{hi:g}") == hi else \
            f" and <= {int(hi)}"
        raise ValueError(f"{where}: expected a {'whole ' if integer else ''}number "
                         f"{'>= 0' if zero else '> 0'}{top}, got {v!r}")
    return int(x) if integer else x


def _tokens(v: Any, where: str) -> int:
    """A token count: a whole number in 0..MAX_TOKENS."""
    return _pos(v, where, integer=True, zero=True, hi=MAX_TOKENS)


def _stage(st: dict, where: str) -> dict:
    """``st`` (Stage fields) checked as a ``workload.stages`` entry is; a ValueError naming
    ``where`` (the profile's key for the stage) and the field otherwise."""
    from pydantic import ValidationError
    from servesim.workloads.config import Stage

    try:
        Stage.model_validate(st)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        raise ValueError(f"{where}{': ' + loc if loc else ''}: {msg[0].lower() + msg[1:]}"
                         + (f" (got {err['input']!r})" if loc else "")) from None
    return st


def _get(d: dict, *names: str, default=None):
    """The first of ``names`` (snake_case or camelCase) present in ``d``."""
    for n in names:
        for k in (n, _camel(n), n.replace("_", "-")):
            if k in d:
                return d[k]
    return default


def _camel(s: str) -> str:
    head, *rest = s.split("_")
    return head + "".join(w.title() for w in rest)


def _requests(lengths: Iterator[tuple[int, int, tuple | None]]) -> Iterator[RequestSpec]:
    for i, (p, o, ids) in enumerate(lengths):
        yield RequestSpec(arrival_s=0.0, prompt_len=max(int(p), 1), output_len=max(int(o), 1),
                          request_id=str(i), prefix_block_ids=ids)


def _group_ids(group: int, tokens: int, block_size: int) -> tuple[int, ...] | None:
    n = tokens // block_size
    return tuple(PROFILE_PREFIX_BASE + (group << 24) + j for j in range(n)) or None
