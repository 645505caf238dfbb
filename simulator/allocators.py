"""Extra KV allocators (registry names in brackets), to A/B against vLLM's ``paged``:

- [``paged_no_prefix``] vLLM's paged block pool with prefix caching off, whatever
  ``cache.enable_prefix_caching`` says.
- [``contiguous``] the pre-PagedAttention baseline (Orca, FasterTransformer): at admission a
  request reserves ``ceil(max_model_len / block_size)`` blocks for its whole possible length;
  blocks are handed out of that reservation as it grows, and the unused rest is returned only
  when it finishes or is preempted. Reserved blocks count as used (``vllm:kv_cache_usage_perc``
  shows the stranded memory). No prefix caching. A running request never runs out of blocks,
  so it is never preempted; admission stops (head-of-line) when a reservation does not fit.
- [``paged_lfu``] the paged pool with prefix caching and a different eviction order for cached
  free blocks: never-cached blocks first, then the block with the fewest prefix hits, then
  least recently freed (vLLM evicts purely LRU: the free-queue front).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from servesim.simulator.kv_cache import BlockPool, KVCacheBlock, KVCacheManager
from servesim.simulator.registry import register_kv_allocator
from servesim.simulator.request import Request


def paged_no_prefix(num_gpu_blocks: int, block_size: int, enable_caching: bool,
                    max_model_len: int) -> KVCacheManager:
    """vLLM's paged allocator with prefix caching forced off."""
    return KVCacheManager(num_gpu_blocks, block_size, False, max_model_len)


# ---------------------------------------------------------------------------------------------
# contiguous (per-request max_model_len reservation)


class ContiguousBlockPool(BlockPool):
    """A block pool where ``num_reserved`` free blocks are promised to running requests."""

    def __init__(self, num_gpu_blocks: int):
        super().__init__(num_gpu_blocks, enable_caching=False)
        self.num_reserved = 0

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue._q) - self.num_reserved

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_gpu_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out blocks from a reservation (every caller holds one)."""
        ret = super().get_new_blocks(num_blocks)
        self.num_reserved -= num_blocks
        assert self.num_reserved >= 0, "contiguous: blocks drawn without a reservation"
        return ret


class ContiguousKVCacheManager(KVCacheManager):
    """Reserve ``ceil(max_model_len / block_size)`` blocks per request at admission."""

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool,
                 max_model_len: int):
        super().__init__(num_gpu_blocks, block_size, False, max_model_len)
        self.block_pool = ContiguousBlockPool(num_gpu_blocks)
        self.blocks_per_request = -(-max_model_len // block_size)
        self._reserved: set[int] = set()  # Request.index of requests holding a reservation

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False) -> list[KVCacheBlock] | None:
        # (The reservation covers max_model_len, so the whole sequence always fits.)
        pool = self.block_pool
        if request.index not in self._reserved:
            rest = self.blocks_per_request - len(request.blocks)
            if rest > pool.get_num_free_blocks():
                return None
            pool.num_reserved += rest
            self._reserved.add(request.index)
        need = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens \
            + num_lookahead_tokens
        need = min(need, self.max_model_len)
        n = -(-need // self.block_size) - len(request.blocks)
        new = pool.get_new_blocks(n) if n > 0 else []
        request.blocks.extend(new)
        return new

    def free(self, request: Request) -> None:
        if request.index in self._reserved:
            self._reserved.discard(request.index)
            self.block_pool.num_reserved -= self.blocks_per_request - len(request.blocks)
        super().free(request)


# ---------------------------------------------------------------------------------------------
# paged_lfu (least-frequently-hit eviction of cached free blocks)


class LFUBlockPool(BlockPool):
    """vLLM's block pool, evicting free blocks by (cached?, prefix hits, freed order).

    A min-heap of (0 if never cached else 1, hits, seq, block_id) with lazy invalidation
    (an entry is live while its block is free and ``seq`` is the block's latest stamp) sits
    beside vLLM's free queue, which still answers membership and counts.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool):
        super().__init__(num_gpu_blocks, enable_caching)
        self.hits = [0] * num_gpu_blocks
        self._stamp = [0] * num_gpu_blocks
        self._seq = 0
        self._heap: list[tuple[int, int, int, int]] = []
        for b in self.free_block_queue.get_all_free_blocks():
            self._push(b)

    def _push(self, b: KVCacheBlock) -> None:
        self._seq += 1
        self._stamp[b.block_id] = self._seq
        cached = 0 if b.block_hash is None else 1
        heapq.heappush(self._heap, (cached, self.hits[b.block_id] if cached else 0, self._seq,
                                    b.block_id))

    def _compact(self) -> None:
        q = self.free_block_queue._q
        self._heap = [e for e in self._heap if e[3] in q and self._stamp[e[3]] == e[2]]
        heapq.heapify(self._heap)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        q = self.free_block_queue._q
        if num_blocks > len(q):
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        if len(self._heap) > 4 * len(q) + 1024:
            self._compact()
        heap, stamp = self._heap, self._stamp
        ret = []
        while len(ret) < num_blocks:
            _, _, seq, bid = heapq.heappop(heap)
            if bid not in q or stamp[bid] != seq:
                continue
            block = q.pop(bid)
            if block.block_hash is not None:
                self._evict(block)
            self.hits[bid] = 0
            block.ref_cnt += 1
            ret.append(block)
        return ret

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(blocks)
        for b in blocks:
            self.hits[b.block_id] += 1
        super().touch(blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        q = self.free_block_queue._q
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                q[block.block_id] = block
                self._push(block)


class LFUKVCacheManager(KVCacheManager):
    """vLLM's KV cache manager on an :class:`LFUBlockPool`."""

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool,
                 max_model_len: int):
        super().__init__(num_gpu_blocks, block_size, enable_caching, max_model_len)
        self.block_pool = LFUBlockPool(num_gpu_blocks, enable_caching)


register_kv_allocator("paged_no_prefix", paged_no_prefix)
register_kv_allocator("contiguous", ContiguousKVCacheManager)
register_kv_allocator("paged_lfu", LFUKVCacheManager)
