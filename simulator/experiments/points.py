"""A point: one simulation, defined by its config tree, seed and offered rate → a result record.

Both experiment kinds are made of points: a sweep's arm × rate × seed grid, a plan's
(candidate, rate, seed) probes. A point is stored at ``SERVE-<arm>-BENCH-<rate>/run=<seed>.json``
(``vllm bench sweep``'s layout; the plan's "arm" is its candidate) and identified for
``--resume`` by a content hash of everything that defines it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from servesim.simulator.errors import ServesimError


@dataclass(frozen=True)
class Point:
    """Where one simulation's record lives: arm (or plan candidate), rate label and seed."""

    arm: str
    rate: float | None  # req/s; None: the base config's own rate (e.g. a trace replay)
    rate_label: str
    seed: int

    @property
    def dirname(self) -> str:
        return f"SERVE-{self.arm}-BENCH-{self.rate_label}"

    @property
    def run_name(self) -> str:
        return f"run={self.seed}.json"

    @property
    def failure_name(self) -> str:
        return f"run={self.seed}.failure.json"


def content_hash(*parts: Any) -> str:
    """16 hex digits of SHA-256 over the canonical JSON of ``parts`` (keys sorted)."""
    blob = json.dumps(list(parts), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def fmt_rate(rate: float | None) -> str:
    """Folder label of a request rate: ``4``, ``2.5``, ``inf`` (``base`` for None)."""
    if rate is None:
        return "base"
    if math.isinf(rate):
        return "inf"
    return str(int(rate)) if float(rate).is_integer() else repr(float(rate))


def one_line(e: BaseException) -> str:
    """A failed point's error as one line: the message of a ServesimError, else ``Type: msg``."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, ServesimError):
        return msg or type(e).__name__
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__
