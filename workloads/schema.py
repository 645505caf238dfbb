"""Canonical request schema shared by every importer and generator.

Units: seconds and tokens. A workload is an iterator of :class:`RequestSpec` in non-decreasing
``arrival_s`` order, so a 10-million-row trace streams without being held in memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

# The largest token count a request, a trace row or a length setting may hold: 2**31 - 1, the
# int32 range of vLLM's token positions, far past any model's context (10M tokens at most
# today). Larger values are refused where they are read, as malformed.
MAX_TOKENS = 2**31 - 1
# The latest arrival a trace may hold, in seconds after its first request: 1e8 s, about 3.2
# years. A later timestamp is a typo (year 2203 for 2023) or a unit mix-up, refused where it is
# read; a run over a longer span would only be asked for by mistake.
MAX_ARRIVAL_S = 1e8
# The most requests one stage, warm-up or generated run may ask for (1e8); the lowest finite
# request rate, one request per MAX_ARRIVAL_S. Generated arrivals, stage spans, gaps and think
# times are bounded like trace timestamps: past 1e8 s a run is a typo, and past ~1e15 s a float
# no longer resolves the engine's millisecond steps (a run there never ends).
MAX_REQUESTS = 100_000_000
MIN_RATE = 1.0 / MAX_ARRIVAL_S


@dataclass(slots=True)
class RequestSpec:
    """One request as the client sends it.

    ``prefix_block_ids`` gives content ids for the request's leading *full* KV blocks at the
    engine's block size (prompt first, and it may run on into the output for multi-turn
    sessions, whose next turn re-sends this turn's output). Two requests whose leading ids are
    equal share that prefix in the prefix cache; blocks past the list are unique to the request.
    ``prompt_token_ids`` (when the trace has real token ids) plays the same role at token level.
    """

    arrival_s: float
    prompt_len: int
    output_len: int
    request_id: str | None = None
    prefix_block_ids: tuple[int, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    priority: int = 0
    session_id: str | None = None
    turn: int = 0
    lora: str | None = None
    ignore_eos: bool = True
    # Closed-loop dependency (multi-turn sessions): the request is sent ``think_time_s`` after
    # request ``parent_id`` finishes, and never before ``arrival_s``.
    parent_id: str | None = None
    think_time_s: float = 0.0
    cache_salt: str | None = None
    extra: dict = field(default_factory=dict)


class Workload(Protocol):
    """What the simulator consumes: requests in arrival order plus bench metadata."""

    def __iter__(self) -> Iterator[RequestSpec]: ...

    @property
    def meta(self) -> dict:
        """``vllm bench serve`` traffic fields for result.json: ``num_prompts``,
        ``request_rate`` (float or inf), ``burstiness``, ``max_concurrency``, ``dataset_name``."""
        ...
