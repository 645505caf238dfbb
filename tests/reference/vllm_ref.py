"""An independent, plainly written reference of vLLM 0.22.1's V1 scheduling, for differential
testing of ``servesim.simulator``.

Written from vLLM's source (``/tmp/src/vllm-0.22.1``), function by function, keeping vLLM's
names; it imports nothing from servesim and shares no code with it. Speed is no concern here:
every structure is the obvious one (a linked free list like vLLM's, dicts, lists, a heap).

What it models (one full-attention KV-cache group, no spec decode, no connectors, no LoRA, no
multimodal, no structured output)::

    vllm/v1/request.py                Request (counters, block hashes, __lt__)
    vllm/v1/core/sched/utils.py       check_stop (EOS first, then max_model_len / max_tokens)
    vllm/v1/core/kv_cache_utils.py    KVCacheBlock, FreeKVCacheBlockQueue, block hash chain
    vllm/v1/core/block_pool.py        BlockHashToBlockMap, BlockPool
    vllm/v1/core/single_type_kv_cache_manager.py + kv_cache_coordinator.py
                                      FullAttentionManager (unitary coordinator)
    vllm/v1/core/kv_cache_manager.py  KVCacheManager (get_computed_blocks, allocate_slots with
                                      full_sequence_must_fit, free, cache_blocks)
    vllm/v1/core/sched/request_queue.py   FCFS deque / PRIORITY heap
    vllm/v1/core/sched/scheduler.py   Scheduler.schedule, _preempt_request,
                                      _update_after_schedule, update_from_output
    vllm/v1/core/sched/async_scheduler.py AsyncScheduler (output placeholders)
    vllm/v1/engine/core.py            EngineCore.step / step_with_batch_queue, the busy loop
    vllm/v1/executor/*                max_concurrent_batches (2 for async, pp for PP)

Time (not vLLM's, the simulator's model): every non-empty batch takes ``step_time`` seconds of
latency and holds the GPU for ``step_time / pipeline_parallel_size`` (so PP stages overlap);
batches run back to back in the order they were scheduled; host time is zero. A request is
seen by the first ``schedule()`` call at or after its arrival time (the engine processes its
input queue before every step). The model emits a token for a scheduled request iff the
scheduler did not consider that row a partial prefill (``not request.is_prefill_chunk``); the
``eos_after``-th output token is EOS.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

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


# --------------------------------------------------------------------------------------------
# Request queues (vllm/v1/core/sched/request_queue.py)

class FCFSRequestQueue(deque):
    def add_request(self, request):
        self.append(request)

    def pop_request(self):
        return self.popleft()

    def peek_request(self):
        return self[0]

    def prepend_request(self, request):
        self.appendleft(request)

    def remove_requests(self, requests):
        keep = [r for r in self if r not in requests]
        self.clear()
        self.extend(keep)


class PriorityRequestQueue:
    def __init__(self):
        self._heap: list[Request] = []

    def add_request(self, request):
        heapq.heappush(self._heap, request)

    def pop_request(self):
        return heapq.heappop(self._heap)

    def peek_request(self):
        return self._heap[0]

    def prepend_request(self, request):
        self.add_request(request)

    def remove_requests(self, requests):
        self._heap = [r for r in self._heap if r not in requests]
        heapq.heapify(self._heap)

    def __len__(self):
        return len(self._heap)

    def __bool__(self):
        return bool(self._heap)

    def __iter__(self):
        heap = self._heap[:]
        while heap:
            yield heapq.heappop(heap)


# --------------------------------------------------------------------------------------------
# Blocks and the free queue (vllm/v1/core/kv_cache_utils.py)

class KVCacheBlock:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self):
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """A doubly linked list with fake head and tail, exactly vLLM's."""

    def __init__(self, blocks: list[KVCacheBlock]):
        self.num_free_blocks = len(blocks)
        for i in range(len(blocks)):
            if i > 0:
                blocks[i].prev_free_block = blocks[i - 1]
            if i < len(blocks) - 1:
                blocks[i].next_free_block = blocks[i + 1]
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        if blocks:
            self.head.next_free_block = blocks[0]
            blocks[0].prev_free_block = self.head
            self.tail.prev_free_block = blocks[-1]
            blocks[-1].next_free_block = self.tail
        else:
            self.head.next_free_block = self.tail
            self.tail.prev_free_block = self.head

    def popleft(self) -> KVCacheBlock:
        first = self.head.next_free_block
        assert first is not self.tail, "no free blocks"
        self.head.next_free_block = first.next_free_block
        first.next_free_block.prev_free_block = self.head
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free_block is not None and block.next_free_block is not None
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        for b in blocks:
            self.append(b)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        b = self.head.next_free_block
        while b is not self.tail:
            out.append(b)
            b = b.next_free_block
        return out


# --------------------------------------------------------------------------------------------
# Block pool (vllm/v1/core/block_pool.py)

class BlockHashToBlockMap:
    """Several blocks may hold the same hash (no dedup); lookups return the first inserted."""

    def __init__(self):
        self._cache: dict[int, dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key):
        blocks = self._cache.get(key)
        if blocks:
            return next(iter(blocks.values()))
        return None

    def insert(self, key, block):
        self._cache.setdefault(key, {})[block.block_id] = block

    def pop(self, key, block_id):
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._cache[key]
        return block


class BlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool):
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Block 0 is the null block: popped once, never freed, never cached.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_cached_block(self, block_hash):
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        if num_cached_blocks >= num_full_blocks:
            return
        assert len(request.block_hashes) >= num_full_blocks
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if blk.is_null:
                continue
            assert blk.block_hash is None
            blk.block_hash = request.block_hashes[i]
            self.cached_block_hash_to_block.insert(blk.block_hash, blk)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        assert num_blocks <= self.get_num_free_blocks()
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
        return ret

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        if block.block_hash is None:
            return False
        if self.cached_block_hash_to_block.pop(block.block_hash, block.block_id) is None:
            return False
        block.block_hash = None
        return True

    def touch(self, blocks) -> None:
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks) -> None:
        blocks = list(ordered_blocks)
        for block in blocks:
            block.ref_cnt -= 1
        self.free_block_queue.append_n(
            [b for b in blocks if b.ref_cnt == 0 and not b.is_null])

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks


# --------------------------------------------------------------------------------------------
# KV cache manager: KVCacheManager + UnitaryKVCacheCoordinator + FullAttentionManager

def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        # FullAttentionManager state.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    # -- KVCacheManager.get_computed_blocks + FullAttentionManager.find_longest_cache_hit
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        if not self.enable_caching:
            return [], 0
        # The last token is always recomputed (logits): hits cap at num_tokens - 1.
        max_cache_hit_length = request.num_tokens - 1
        max_num_blocks = max_cache_hit_length // self.block_size
        computed = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            cached = self.block_pool.get_cached_block(block_hash)
            if cached is None:
                break
            computed.append(cached)
        return computed, len(computed) * self.block_size

    # -- SingleTypeKVCacheManager.get_num_blocks_to_allocate (full attention: nothing skipped)
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock]) -> int:
        num_required_blocks = cdiv(num_tokens, self.block_size)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            assert not new_computed_blocks
            return max(num_required_blocks - num_req_blocks, 0)
        num_new_blocks = max(num_required_blocks - (len(new_computed_blocks) + num_req_blocks),
                             0)
        # Hit blocks sitting in the free queue leave it when touched: they count too.
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return num_new_blocks + num_evictable

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       full_sequence_must_fit: bool = False) -> list[KVCacheBlock] | None:
        assert num_new_tokens > 0
        new_computed = list(new_computed_blocks or [])
        num_local_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        total_computed_tokens = min(num_local_computed_tokens, self.max_model_len)
        free = self.block_pool.get_num_free_blocks()
        if full_sequence_must_fit:
            # Admission gate (scheduler_reserve_full_isl): the whole sequence must fit.
            full_num_tokens = min(request.num_tokens, self.max_model_len)
            if self.get_num_blocks_to_allocate(request.request_id, full_num_tokens,
                                               new_computed) > free:
                return None
        num_tokens_main_model = total_computed_tokens + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model, self.max_model_len)
        # (remove_skipped_blocks: nothing is skipped under full attention)
        if self.get_num_blocks_to_allocate(request.request_id, num_tokens_need_slot,
                                           new_computed) > free:
            return None
        if new_computed:
            self._allocate_new_computed_blocks(request.request_id, new_computed)
        new_blocks = self._allocate_new_blocks(request.request_id, num_tokens_need_slot)
        if not self.enable_caching:
            return new_blocks
        # Eager caching, capped at the tokens that are known (request.num_tokens).
        num_tokens_to_cache = min(total_computed_tokens + num_new_tokens, request.num_tokens)
        self.cache_blocks(request, num_tokens_to_cache)
        return new_blocks

    def _allocate_new_computed_blocks(self, request_id, new_computed_blocks) -> None:
        if request_id in self.num_cached_block:
            assert not new_computed_blocks
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)

    def _allocate_new_blocks(self, request_id, num_tokens) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[request.request_id],
                                          num_cached_blocks, num_full_blocks)
        self.num_cached_block[request.request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        # Reverse order: a request's tail blocks are evicted before its head.
        req_blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(req_blocks))
        self.num_cached_block.pop(request.request_id, None)

    def check_invariants(self) -> None:
        free = {b.block_id for b in self.block_pool.free_block_queue.get_all_free_blocks()}
        assert len(free) == self.block_pool.get_num_free_blocks()
        for b in self.block_pool.blocks:
            if b.is_null:
                continue
            assert b.ref_cnt >= 0, b
            assert (b.block_id in free) == (b.ref_cnt == 0), b


# --------------------------------------------------------------------------------------------
# Scheduler (vllm/v1/core/sched/scheduler.py, async_scheduler.py)

@dataclass
class Config:
    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # or "priority"
    scheduler_reserve_full_isl: bool = True
    async_scheduling: bool = False
    pipeline_parallel_size: int = 1


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: list[str]  # in preemption order (vLLM keeps a set)
    sampled: set[str] = field(default_factory=set)  # rows the model samples a token for


class Scheduler:
    def __init__(self, config: Config):
        self.config = config
        self.async_scheduling = config.async_scheduling
        self.priority = config.policy == "priority"
        self.max_num_running_reqs = config.max_num_seqs
        self.max_num_scheduled_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.kv_cache_manager = KVCacheManager(config.num_gpu_blocks, config.block_size,
                                               config.max_model_len,
                                               config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting = PriorityRequestQueue() if self.priority else FCFSRequestQueue()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        # Rules that fired and that tests may want to know about (not vLLM state).
        self.events: set[str] = set()
        self._num_admitted = 0

    # -- queue management
    def add_request(self, request: Request) -> None:
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def has_requests(self) -> bool:
        return bool(len(self.waiting) + len(self.running)) or bool(self.finished_req_ids)

    # -- schedule()
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv_cache_manager
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []
        num_scheduled_tokens: dict[str, int] = {}
        token_budget = self.max_num_scheduled_tokens

        # First, the RUNNING requests, in order.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if (request.num_output_placeholders > 0
                    and request.num_computed_tokens + 2 - request.num_output_placeholders
                    >= request.num_prompt_tokens + request.max_tokens):
                # Async: the step in flight already reaches max_tokens.
                req_index += 1
                continue
            num_new_tokens = (request.num_tokens_with_spec + request.num_output_placeholders
                              - request.num_computed_tokens)
            if 0 < cfg.long_prefill_token_threshold < num_new_tokens:
                num_new_tokens = cfg.long_prefill_token_threshold
            num_new_tokens = min(num_new_tokens, token_budget)
            num_new_tokens = min(num_new_tokens,
                                 self.max_model_len - 1 - request.num_computed_tokens)
            assert num_new_tokens >= 0, request
            if num_new_tokens == 0:
                # PP with the prompt already scheduled, or async at max_model_len.
                req_index += 1
                continue

            while True:
                new_blocks = kv.allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                if self.priority:
                    preempted_req = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                    if (preempted_req not in scheduled_running_reqs
                            and self.running.index(preempted_req) < req_index):
                        # vLLM moves req_index back only for a victim it scheduled this step,
                        # so the request after this one is passed over.
                        self.events.add(VICTIM_SKIPPED_BEFORE_INDEX)
                    self.running.remove(preempted_req)
                    if preempted_req in scheduled_running_reqs:
                        scheduled_running_reqs.remove(preempted_req)
                        token_budget += num_scheduled_tokens.pop(preempted_req.request_id)
                        req_index -= 1
                else:
                    preempted_req = self.running.pop()
                self._preempt_request(preempted_req)
                preempted_reqs.append(preempted_req)
                if preempted_req is request:
                    break
            if new_blocks is None:
                break

            scheduled_running_reqs.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # Next, the WAITING requests, only if nothing was preempted.
        if not preempted_reqs:
            while self.waiting and token_budget > 0:
                if len(self.running) == self.max_num_running_reqs:
                    break
                request = self.waiting.peek_request()
                if request.num_computed_tokens == 0:
                    new_computed_blocks, num_new_local_computed_tokens = (
                        kv.get_computed_blocks(request))
                    num_computed_tokens = num_new_local_computed_tokens
                else:
                    new_computed_blocks, num_new_local_computed_tokens = [], 0
                    num_computed_tokens = request.num_computed_tokens

                num_new_tokens = request.num_tokens - num_computed_tokens
                threshold = cfg.long_prefill_token_threshold
                if 0 < threshold < num_new_tokens:
                    num_new_tokens = threshold
                if not cfg.enable_chunked_prefill and num_new_tokens > token_budget:
                    break  # head-of-line: the head does not fit this step
                num_new_tokens = min(num_new_tokens, token_budget)
                assert num_new_tokens > 0

                new_blocks = kv.allocate_slots(
                    request, num_new_tokens,
                    num_new_computed_tokens=num_new_local_computed_tokens,
                    new_computed_blocks=new_computed_blocks,
                    full_sequence_must_fit=cfg.scheduler_reserve_full_isl)
                if new_blocks is None:
                    break

                request = self.waiting.pop_request()
                self.running.append(request)
                request.admitted_seq = self._num_admitted  # (test bookkeeping)
                self._num_admitted += 1
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
                request.status = RUNNING
                request.num_computed_tokens = num_computed_tokens

        total = sum(num_scheduled_tokens.values())
        assert total <= self.max_num_scheduled_tokens
        assert token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs
        out = SchedulerOutput(num_scheduled_tokens=num_scheduled_tokens,
                              total_num_scheduled_tokens=total,
                              preempted_req_ids=[r.request_id for r in preempted_reqs])
        self._update_after_schedule(out)
        return out

    def _preempt_request(self, request: Request) -> None:
        assert request.status == RUNNING
        self.kv_cache_manager.free(request)
        request.status = PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            request.is_prefill_chunk = request.num_computed_tokens < (
                request.num_tokens + request.num_output_placeholders)
            if not request.is_prefill_chunk:
                out.sampled.add(req_id)
        if self.async_scheduling:
            # AsyncScheduler._update_after_schedule: one output placeholder per sampling row.
            for req_id in out.num_scheduled_tokens:
                request = self.requests[req_id]
                if request.is_prefill_chunk:
                    continue
                request.num_output_placeholders += 1
        self.finished_req_ids = set()

    # -- update_from_output()
    def update_from_output(self, out: SchedulerOutput) -> list[Request]:
        """Apply one executed batch; return the requests that finished."""
        stopped_running: list[Request] = []
        stopped_preempted: list[Request] = []
        finished: list[Request] = []
        for req_id in out.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # finished while this batch was in flight
            if req_id not in out.sampled:
                continue  # partial prefill: no token
            status_before_stop = request.status
            token = EOS if request.num_output_tokens + 1 == request.eos_after else (
                "out", req_id, request.num_output_tokens)
            stopped = self._update_request_with_output(request, token)
            if stopped:
                self._free_request(request)
                finished.append(request)
                if status_before_stop == RUNNING:
                    stopped_running.append(request)
                else:
                    stopped_preempted.append(request)
        if len(finished) > 1 and finished != sorted(finished, key=lambda r: r.admitted_seq):
            # Freed in this batch's row order, which is not the order of their last
            # admissions (one was preempted and re-admitted while this batch was in flight).
            self.events.add(FREED_NOT_IN_RUNNING_ORDER)
        if stopped_running:
            self.running = [r for r in self.running if r not in stopped_running]
        if stopped_preempted:
            self.waiting.remove_requests(stopped_preempted)
        return finished

    def _update_request_with_output(self, request: Request, token) -> bool:
        status_before_update = request.status
        request.append_output_token_ids(token)
        stopped = check_stop(request, self.max_model_len)
        if self.async_scheduling:
            # AsyncScheduler._update_request_with_output
            request.num_output_placeholders -= 1
            assert request.num_output_placeholders >= 0, request
            if status_before_update != RUNNING and self.kv_cache_manager.enable_caching:
                self.events.add(TOKEN_TO_PREEMPTED_NOT_CACHED)
            if status_before_update == RUNNING:
                self.kv_cache_manager.cache_blocks(
                    request, request.num_computed_tokens - request.num_output_placeholders)
        return stopped

    def _free_request(self, request: Request) -> None:
        self.finished_req_ids.add(request.request_id)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]


# --------------------------------------------------------------------------------------------
# Engine loop (vllm/v1/engine/core.py) with simulated time

# Events (Scheduler.events / Result.events): rules that fired, for tests that track them.
VICTIM_SKIPPED_BEFORE_INDEX = "priority victim before req_index, not scheduled this step"
TOKEN_TO_PREEMPTED_NOT_CACHED = "async: a token came back to a preempted request (not cached)"
EMPTY_BATCH_TAKES_A_SLOT = "an empty batch took a batch-queue slot behind two or more"
FREED_NOT_IN_RUNNING_ORDER = "requests stopping together freed in row order != admission order"


class Stall(RuntimeError):
    """The engine has requests but can never schedule them (and no arrival is pending)."""


@dataclass
class Batch:
    time_scheduled: float
    num_scheduled_tokens: dict[str, int]
    preempted: list[str]


@dataclass
class RequestResult:
    finish_time: float
    num_output_tokens: int
    num_preemptions: int
    finish_reason: str


@dataclass
class Result:
    batches: list[Batch]
    requests: dict[str, RequestResult]
    finish_order: list[str]
    events: set[str] = field(default_factory=set)


@dataclass
class _InFlight:
    out: SchedulerOutput
    done: float
    time_scheduled: float


class Engine:
    """``EngineCore``: ``step`` (sync) or ``step_with_batch_queue`` (async or PP)."""

    def __init__(self, config: Config, step_time: float = 1.0, max_steps: int = 100_000,
                 queue_empty_batches: bool = True):
        """``queue_empty_batches``: vLLM 0.22.1 puts an empty ``SchedulerOutput`` into the
        batch queue too (``step_with_batch_queue`` appends whatever ``schedule()`` returned),
        where it holds a slot until the batches before it return. ``False`` is NOT vLLM: it
        drops empty batches (re-scheduling at once after a preemption), only to let tests
        look past that known difference."""
        self.config = config
        self.queue_empty_batches = queue_empty_batches
        self.step_time = step_time
        self.max_steps = max_steps
        self.scheduler = Scheduler(config)
        self.hasher = BlockHasher(config.block_size) if config.enable_prefix_caching else None
        pp = config.pipeline_parallel_size
        # Executors' max_concurrent_batches: pp with PP, else 2 with async scheduling, else 1.
        self.batch_queue_size = pp if pp > 1 else (2 if config.async_scheduling else 1)
        self.batch_queue: deque[_InFlight] | None = (
            deque() if self.batch_queue_size > 1 else None)
        self.occupancy = step_time / pp  # a batch holds the GPU (first stage) this long
        self.now = 0.0
        self.gpu_free = 0.0
        self.batches: list[Batch] = []
        self.finish_order: list[str] = []
        self.all_requests: dict[str, Request] = {}
        self._pending: deque[RequestSpec] = deque()

    # -- time
    def _launch(self, out: SchedulerOutput) -> float:
        """Put a batch on the GPU; return when its result is ready."""
        if out.total_num_scheduled_tokens == 0:
            return self.now
        start = max(self.now, self.gpu_free)
        self.gpu_free = start + self.occupancy
        self.batches.append(Batch(self.now, dict(out.num_scheduled_tokens),
                                  list(out.preempted_req_ids)))
        return start + self.step_time

    def _process_input_queue(self) -> None:
        while self._pending and self._pending[0].arrival_time <= self.now:
            spec = self._pending.popleft()
            req = Request(spec, self.hasher)
            self.all_requests[req.request_id] = req
            self.scheduler.add_request(req)

    def _has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def _finish(self, finished: list[Request]) -> None:
        for r in finished:
            r.finish_time = self.now
            self.finish_order.append(r.request_id)

    def _idle_until_arrival(self) -> None:
        if not self._pending:
            s = self.scheduler
            if not (s.running or s.waiting):
                return  # nothing left: the loop ends
            raise Stall(f"stalled at t={self.now}: {self.scheduler.running} "
                        f"waiting={list(self.scheduler.waiting)}")
        self.now = max(self.now, self._pending[0].arrival_time)

    # -- EngineCore.step
    def step(self) -> None:
        if not self.scheduler.has_requests():
            return
        out = self.scheduler.schedule()
        done = self._launch(out)
        self.now = done
        self._finish(self.scheduler.update_from_output(out))
        if out.total_num_scheduled_tokens == 0 and not out.preempted_req_ids:
            # vLLM would spin on the same empty step until an input arrives.
            self._idle_until_arrival()

    # -- EngineCore.step_with_batch_queue
    def step_with_batch_queue(self) -> None:
        q = self.batch_queue
        assert len(q) < self.batch_queue_size
        was_empty = not q
        if self.scheduler.has_requests():
            out = self.scheduler.schedule()
            model_executed = out.total_num_scheduled_tokens > 0
            if not model_executed and not self.queue_empty_batches:
                if q:
                    b = q.pop()
                    self.now = max(self.now, b.done)
                    self._finish(self.scheduler.update_from_output(b.out))
                elif not out.preempted_req_ids:
                    self._idle_until_arrival()
                return
            done = self._launch(out)
            if not model_executed and len(q) >= 2:
                self.scheduler.events.add(EMPTY_BATCH_TAKES_A_SLOT)
            if not model_executed:
                # An empty batch still takes a queue slot; its (empty) result comes back after
                # the batches before it.
                done = max([done] + [b.done for b in q])
            q.appendleft(_InFlight(out, done, self.now))
            if model_executed and len(q) < self.batch_queue_size and not q[-1].done <= self.now:
                return  # don't block while the queue has room
            if not model_executed and was_empty and not out.preempted_req_ids:
                q.pop()
                self._idle_until_arrival()
                return
        elif not q:
            return
        b = q.pop()
        self.now = max(self.now, b.done)
        self._finish(self.scheduler.update_from_output(b.out))

    # -- the busy loop
    def run(self, specs: list[RequestSpec]) -> Result:
        self._pending = deque(sorted(specs, key=lambda s: s.arrival_time))
        steps = 0
        while self._pending or self._has_work():
            self._process_input_queue()
            if not self._has_work():
                self.now = self._pending[0].arrival_time
                continue
            if self.batch_queue is None:
                self.step()
            else:
                self.step_with_batch_queue()
            steps += 1
            if steps > self.max_steps:
                raise Stall(f"no end after {steps} steps")
        reqs = {
            rid: RequestResult(r.finish_time, r.num_output_tokens, r.num_preemptions,
                               FINISH_REASON[r.status])
            for rid, r in self.all_requests.items()
        }
        return Result(self.batches, reqs, self.finish_order, set(self.scheduler.events))


def simulate(config: Config, specs: list[RequestSpec], step_time: float = 1.0,
             **engine_kw) -> Result:
    return Engine(config, step_time, **engine_kw).run(specs)
