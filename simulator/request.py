"""Request lifecycle, as vLLM V1's ``vllm/v1/request.py`` models it.

Two counters drive everything (course digest §1): ``num_tokens`` (prompt + generated so far)
and ``num_computed_tokens`` (tokens whose KV is in the cache). A request samples a token in a
step iff ``num_computed_tokens + num_scheduled == num_tokens`` (the sampling guard), so a
request that is never preempted is scheduled ``prompt_len + max_tokens - 1`` tokens in total.
"""

from __future__ import annotations

import enum

from servesim.workloads.schema import RequestSpec


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything above PREEMPTED is finished (vLLM: ``is_finished = status > PREEMPTED``).
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


FINISHED_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "rejected",
}


def stable_int(s: str | None) -> int:
    """A process-independent 63-bit integer for a string (``hash()`` of str is salted)."""
    if s is None:
        return 0
    import hashlib

    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") >> 1


_NAN = float("nan")
_WAITING = RequestStatus.WAITING
_ROOT_HASH = hash((0, 0))  # the prefix-hash root without LoRA and cache salt


class Request:
    """One request inside the engine.

    ``max_tokens`` is the output cap (vLLM ``SamplingParams.max_tokens``); ``eos_after`` is the
    number of outputs after which the model emits EOS (None when ``ignore_eos``). A request that
    stops on EOS finishes as FINISHED_STOPPED ("stop"), one that hits ``max_tokens`` or
    ``max_model_len`` as FINISHED_LENGTH_CAPPED ("length"); EOS is checked first, like vLLM's
    ``check_stop``.

    KV content identity for prefix caching: block ``i`` (``block_size`` tokens) hashes its
    parent's hash with a content key: the workload's ``prefix_block_ids[i]`` when given, else the
    prompt's token ids when known; blocks past those hold content unique to the request.
    """

    __slots__ = (
        "_n_shared",
        "arrival_time",
        "block_hashes",
        "block_ids",
        "d_computed",
        "d_mark",
        "eos_after",
        "error",
        "fe",
        "finish_time",
        "first_scheduled_time",
        "first_token_time",
        "index",
        "itls",
        "kv_pool",
        "last_token_time",
        "max_tokens",
        "num_cached_blocks",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_output_tokens",
        "num_preemptions",
        "num_tokens",
        "prefix_block_ids",
        "prev_blocks",
        "prev_cached",
        "prev_pos",
        "prev_token_time",
        "priority",
        "prompt_len",
        "prompt_token_ids",
        "queued_time",
        "request_id",
        "root_hash",
        "run_seq",
        "sched_seq",
        "send_time",
        "spec",
        "spec_inflight",
        "spec_tokens",
        "status",
        "stop_pending",
        "target",
    )

    @staticmethod
    def limits(spec: RequestSpec, max_model_len: int) -> tuple[int, int, int | None]:
        """(prompt_len, max_tokens, eos_after) of ``spec``: with ``ignore_eos`` the output
        length is the cap; else the API default max_tokens (whatever fits in max_model_len)
        with EOS after the output length."""
        p = int(spec.prompt_len)
        if spec.ignore_eos:
            return p, int(spec.output_len), None
        return p, max(max_model_len - p, 1), int(spec.output_len)

    def __init__(self, spec: RequestSpec, index: int, max_model_len: int, send_time: float):
        self.spec = spec
        self.index = index
        self.request_id = spec.request_id if spec.request_id is not None else str(index)
        self.prompt_len, self.max_tokens, self.eos_after = Request.limits(spec, max_model_len)
        self.priority = spec.priority
        # vLLM's arrival_time (the API server's renderer starts; priority order): the client's
        # send time unless a frontend (simulator/frontend.py) moves it later. ``fe``: the
        # frontend's timestamps (``frontend.FE_*``), None without one; with one,
        # first_token_time / finish_time are the client's.
        self.arrival_time = send_time
        self.send_time = send_time
        self.fe = None
        # when the engine core's loop took it in (vLLM's QUEUED event; without a frontend
        # model; with one it is ``fe[2]``): NaN until it reaches the engine
        self.queued_time = _NAN
        self.itls = None  # the client's inter-token gaps, when recorded (output.save_detailed)
        self.num_tokens = self.prompt_len
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        # Async scheduling with several batches in flight (pipeline parallelism): outputs
        # scheduled but not yet returned (vLLM ``num_output_placeholders``).
        self.num_output_placeholders = 0
        # Async scheduling, one batch in flight: the finished status this request reaches when
        # the batch in flight returns (its stop is not yet known to vLLM's scheduler).
        self.stop_pending: RequestStatus | None = None
        # Speculative decoding (simulator/spec_decode.py): drafts to verify next step (vLLM
        # ``len(spec_token_ids)``), and (batch, rejected, accepted) of the batch in flight.
        self.spec_tokens = 0
        self.spec_inflight: tuple | None = None
        self.status = _WAITING
        self.block_ids: list[int] = []  # block table (ids); ``blocks`` gives views
        self.kv_pool = None  # the BlockPool holding them (for ``blocks``)
        self.num_cached_blocks = 0
        self.block_hashes: list[int] = []
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.first_scheduled_time = _NAN
        self.first_token_time = _NAN
        self.last_token_time = _NAN
        self.prev_token_time = _NAN  # the token before the last (async delivery)
        self.finish_time = _NAN
        self.prefix_block_ids = spec.prefix_block_ids or ()
        self.prompt_token_ids = spec.prompt_token_ids
        lora, salt = spec.lora, spec.cache_salt
        self.root_hash = _ROOT_HASH if lora is None and salt is None else \
            hash((stable_int(lora), stable_int(salt)))
        self.error = ""
        # Block table when last freed (a preempted request's own prefix hits): ids, the
        # free-queue position of index 0 in the freed run (index i at prev_pos - i) and how
        # many were cached.
        self.prev_blocks: list[int] = []
        self.prev_pos = 0
        self.prev_cached = 0
        self._n_shared = -1
        # Decode-group bookkeeping of the scheduler's fast path (see decode_group.py).
        self.d_mark = -1
        self.d_computed = 0
        self.run_seq = 0  # position in the scheduler's running order (admission counter)
        self.sched_seq = -2  # the last batch in which a row of it sampled (async caching)
        self.target = None  # (outputs at which it stops, how): the scheduler's, cached

    @property
    def blocks(self) -> list:
        """The block table as ``KVCacheBlock`` views (tests, tools; the engine uses
        ``block_ids``)."""
        if self.kv_pool is None:
            return []
        views = self.kv_pool.blocks
        return [views[b] for b in self.block_ids]

    # -- prefix-cache content ------------------------------------------------------------------
    def num_shared_blocks(self, block_size: int) -> int:
        """Leading blocks whose content another request may hold (workload prefix ids, or the
        prompt's full blocks when token ids are known); the rest are unique to the request."""
        n = self._n_shared
        if n < 0:
            n = len(self.prefix_block_ids)
            if self.prompt_token_ids is not None:
                n = max(n, self.prompt_len // block_size)
            self._n_shared = n
        return n

    def ensure_block_hashes(self, num_full_blocks: int, block_size: int,
                            unique: bool = False) -> list[int]:
        """Extend ``block_hashes`` to cover the first ``num_full_blocks`` full blocks of
        shareable content (at most ``num_shared_blocks``: content unique to the request is
        not hashed, only the request itself can hit it, see ``kv_cache``), or all of them with
        ``unique`` (sliding window).

        Shareable blocks chain ``hash((parent_hash, content))`` from a root that folds in the
        LoRA id and cache salt (vLLM's extra keys). Blocks of content unique to this request
        get distinct negative ids ``~(index << 32 | i)`` (no other request can match them)."""
        hashes = self.block_hashes
        i = len(hashes)
        n_shared = self.num_shared_blocks(block_size)
        n = n_shared if n_shared < num_full_blocks else num_full_blocks
        if i >= n:
            if unique and i < num_full_blocks:
                base = self.index << 32
                hashes.extend([~(base | j) for j in range(i, num_full_blocks)])
            return hashes
        parent = hashes[-1] if hashes else self.root_hash
        ids = self.prefix_block_ids
        n_ids = len(ids)
        toks = self.prompt_token_ids
        while i < n:
            if i < n_ids:
                key = ids[i]
            else:
                key = tuple(toks[i * block_size:(i + 1) * block_size])
            parent = hash((parent, key))
            hashes.append(parent)
            i += 1
        if unique and i < num_full_blocks:
            base = self.index << 32
            hashes.extend([~(base | j) for j in range(i, num_full_blocks)])
        return hashes

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, out={self.num_output_tokens}, "
                f"{self.status.name})")
