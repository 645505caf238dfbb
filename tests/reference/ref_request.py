"""Reference requests: vLLM's ``Request`` counters, block hashing and ``check_stop``."""

from __future__ import annotations

from dataclasses import dataclass

# --------------------------------------------------------------------------------------------
# Request (vllm/v1/request.py)

WAITING = "WAITING"
RUNNING = "RUNNING"
PREEMPTED = "PREEMPTED"
FINISHED_STOPPED = "FINISHED_STOPPED"
FINISHED_LENGTH_CAPPED = "FINISHED_LENGTH_CAPPED"
FINISHED = (FINISHED_STOPPED, FINISHED_LENGTH_CAPPED)
FINISH_REASON = {FINISHED_STOPPED: "stop", FINISHED_LENGTH_CAPPED: "length"}

EOS = "<eos>"
NONE_HASH = -1


@dataclass
class RequestSpec:
    """One request as the client sends it (plain data)."""

    request_id: str
    arrival_time: float
    prompt_token_ids: tuple
    max_tokens: int
    eos_after: int | None = None  # the model emits EOS as this output (None: never)
    priority: int = 0


class BlockHasher:
    """vLLM's ``get_request_block_hasher``: ``hash((parent_hash, tuple(block_tokens), extra))``
    over full blocks. Interned to small ints, so equal content gives equal ids without
    collisions."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._ids: dict = {}

    def __call__(self, request: Request) -> list[int]:
        bs = self.block_size
        start = len(request.block_hashes)
        num_full = len(request.all_token_ids) // bs
        new = []
        parent = request.block_hashes[-1] if request.block_hashes else NONE_HASH
        for i in range(start, num_full):
            key = (parent, tuple(request.all_token_ids[i * bs:(i + 1) * bs]))
            h = self._ids.get(key)
            if h is None:
                h = self._ids[key] = len(self._ids)
            new.append(h)
            parent = h
        return new


class Request:
    def __init__(self, spec: RequestSpec, block_hasher: BlockHasher | None):
        self.request_id = spec.request_id
        self.priority = spec.priority
        self.arrival_time = spec.arrival_time
        self.max_tokens = spec.max_tokens
        self.eos_after = spec.eos_after
        self.status = WAITING
        self.prompt_token_ids = list(spec.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list = []
        self.all_token_ids: list = list(self.prompt_token_ids)
        self.num_output_placeholders = 0
        self.spec_token_ids: list = []
        self.num_computed_tokens = 0
        self.is_prefill_chunk = False
        self.num_preemptions = 0
        self.block_hashes: list[int] = []
        self._block_hasher = block_hasher
        self.update_block_hashes()
        # Bookkeeping for the test (not vLLM state).
        self.finish_time: float | None = None
        self.admitted_seq = -1

    def append_output_token_ids(self, token_id) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return self.status in FINISHED

    def __lt__(self, other: Request) -> bool:
        # Request.__lt__: priority, then arrival time, then request id (a string).
        if self.priority != other.priority:
            return self.priority < other.priority
        if self.arrival_time != other.arrival_time:
            return self.arrival_time < other.arrival_time
        if self.request_id != other.request_id:
            return self.request_id < other.request_id
        return id(self) < id(other)

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, ph={self.num_output_placeholders}, "
                f"{self.status})")


def check_stop(request: Request, max_model_len: int) -> bool:
    """vllm/v1/core/sched/utils.py ``check_stop`` (min_tokens 0, no stop strings)."""
    if request.output_token_ids[-1] == EOS:
        request.status = FINISHED_STOPPED
        return True
    if (request.num_tokens >= max_model_len
            or request.num_output_tokens >= request.max_tokens):
        request.status = FINISHED_LENGTH_CAPPED
        return True
    return False
