"""What the engine tells the cost model about one step, and what it gets back.

The cost model never sees requests: only a :class:`BatchShape` built from the scheduler's
``{request: num_new_tokens}`` map. Units: tokens, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BatchShape:
    """One engine step's batch.

    Decode rows (one new token each) are summarised by count and context sums, so building a
    shape is O(1) in the number of running requests. Prefill chunks (few per step) are listed.

    - ``num_decode``: rows scheduling exactly 1 token whose KV for all earlier tokens exists.
    - ``decode_context_sum``: Σ over decode rows of the attention context length, i.e. the
      tokens whose K/V the row reads (its ``num_computed_tokens + 1``).
    - ``decode_context_max``: the largest such context (split-KV heuristics).
    - ``prefill_new_tokens[i]``: new tokens of prefill chunk i.
    - ``prefill_context[i]``: tokens already in the KV cache before chunk i (its offset: prefix
      hits plus earlier chunks); the chunk attends to those and causally to itself.
    - ``num_sampled``: rows that sample a token this step (LM head and sampler rows); with
      speculative decoding every draft position of a decode row has logits too.

    Speculative decoding (``costmodels/spec_decode.py``): a decode row may carry draft
    tokens after its one new token (vLLM's ``scheduled_spec_decode_tokens``); their total is
    ``num_spec_tokens`` (0 without spec decode), so decode rows hold ``num_decode +
    num_spec_tokens`` query tokens. Multi-LoRA (``costmodels/lora.py``): ``num_loras``
    distinct adapters serve ``lora_tokens`` of the scheduled tokens; ``lora_h2d_s`` /
    ``lora_disk_s`` are this step's adapter loads (CPU→GPU copies on the GPU stream; disk
    reads on the host), decided by the worker's LRU caches when the batch was scheduled.
    """

    num_decode: int = 0
    decode_context_sum: int = 0
    decode_context_max: int = 0
    prefill_new_tokens: tuple[int, ...] = ()
    prefill_context: tuple[int, ...] = ()
    num_sampled: int = 0
    num_spec_tokens: int = 0
    num_loras: int = 0
    lora_tokens: int = 0
    lora_h2d_s: float = 0.0
    lora_disk_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.num_decode + self.num_spec_tokens + sum(self.prefill_new_tokens)

    @property
    def num_reqs(self) -> int:
        return self.num_decode + len(self.prefill_new_tokens)

    @property
    def is_decode_only(self) -> bool:
        return not self.prefill_new_tokens


@dataclass(slots=True)
class OpCost:
    """One operator's total over all layers of the step."""

    name: str
    count: int
    seconds: float
    flops: float
    bytes: float
    bound: str  # "compute" | "memory" | "latency" | "host" | "overlap" (negative: time hidden)
    efficiency: float
    provenance: str  # "calibrated:<file>" | "default" | "spec-sheet"


@dataclass(slots=True)
class StepCost:
    seconds: float
    breakdown: list[OpCost] = field(default_factory=list)
    gpu_seconds: float = 0.0
    host_seconds: float = 0.0
    padded_batch: int = 0
    cudagraph: str = "NONE"  # runtime mode used: FULL | PIECEWISE | NONE
