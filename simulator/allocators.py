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

from servesim.simulator.block_pool import BlockPool
from servesim.simulator.kv_cache import KVCacheManager
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
        return self._nfree - self.num_reserved

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_gpu_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
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
                       new_computed_blocks: list[int] | None = None,
                       num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False) -> list[int] | None:
        # (The reservation covers max_model_len, so the whole sequence always fits.)
        pool = self.block_pool
        if request.index not in self._reserved:
            rest = self.blocks_per_request - len(request.block_ids)
            if rest > pool.get_num_free_blocks():
                return None
            pool.num_reserved += rest
            self._reserved.add(request.index)
        need = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens \
            + num_lookahead_tokens
        need = min(need, self.max_model_len)
        n = -(-need // self.block_size) - len(request.block_ids)
        new = pool.get_new_blocks(n) if n > 0 else []
        request.block_ids.extend(new)
        request.kv_pool = pool
        return new

    def free(self, request: Request) -> None:
        if request.index in self._reserved:
            self._reserved.discard(request.index)
            self.block_pool.num_reserved -= self.blocks_per_request - len(request.block_ids)
        super().free(request)


# ---------------------------------------------------------------------------------------------
# paged_lfu (least-frequently-hit eviction of cached free blocks)


class LFUBlockPool(BlockPool):
    """vLLM's block pool, evicting free blocks by (cached?, prefix hits, freed order).

    A min-heap of (0 if never cached else 1, hits, position, block_id) with lazy invalidation
    (an entry is live while the free queue still holds the block at that position) sits beside
    the free queue, which still answers counts and own-content survival: a block taken from
    the middle leaves a tombstone there.
    """

    track_hits = True

    def __init__(self, num_gpu_blocks: int, enable_caching: bool):
        super().__init__(num_gpu_blocks, enable_caching)
        self.hits = [0] * num_gpu_blocks
        self._heap: list[tuple[int, int, int, int]] = []
        for pos, b in enumerate(self._fq):
            self._heap.append((0, 0, pos, b))
        heapq.heapify(self._heap)

    def _live(self, pos: int, b: int) -> bool:
        i = pos - self._base
        return pos >= self._head and i < len(self._fq) and self._fq[i] == b

    def _append_run(self, ids: list[int], num_cached: int) -> int:
        p = super()._append_run(ids, num_cached)
        first_cached = len(ids) - num_cached
        for j, b in enumerate(ids):
            cached = 1 if j >= first_cached else 0
            heapq.heappush(self._heap, (cached, self.hits[b] if cached else 0, p + j, b))
        return p

    def _free_one(self, b: int) -> None:
        pos = self._base + len(self._fq)
        n = len(self._fq)
        super()._free_one(b)
        if len(self._fq) > n:  # it reached the queue
            cached = 1 if b in self._hash else 0
            heapq.heappush(self._heap, (cached, self.hits[b] if cached else 0, pos, b))

    def note_hits(self, ids) -> None:
        for b in ids:
            self.hits[b] += 1

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        if num_blocks > self._nfree:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        if len(self._heap) > 4 * self._nfree + 1024:
            self._heap = [e for e in self._heap if self._live(e[2], e[3])]
            heapq.heapify(self._heap)
        heap = self._heap
        ret = []
        while len(ret) < num_blocks:
            _, _, pos, b = heapq.heappop(heap)
            if not self._live(pos, b):
                continue
            in_run = self._in_cached_run(pos)
            self._take(pos, in_run)
            if in_run:  # request-unique cached content
                self.num_evictions += 1
            elif b in self._pos:  # indexed content
                del self._pos[b]
                self._unindex(b)
                self.num_evictions += 1
            self.hits[b] = 0
            ret.append(b)
        # Let the front pass the tombstones at its head (bounded queue).
        fq, tombs, th = self._fq, self._tombs, self._tomb_heap
        while th and th[0] == self._head:
            heapq.heappop(th)
            del tombs[self._head]
            self._head += 1
        cr = self._cr
        while self._cri < len(cr) and cr[self._cri][1] <= self._head:
            self._cri += 1
        if self._cri < len(cr) and cr[self._cri][0] < self._head:
            cr[self._cri][0] = self._head
        if self._head - self._base > 4096 and (self._head - self._base) * 2 > len(fq):
            del fq[:self._head - self._base]
            self._base = self._head
        return ret


class LFUKVCacheManager(KVCacheManager):
    """vLLM's KV cache manager on an :class:`LFUBlockPool`."""

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool,
                 max_model_len: int):
        super().__init__(num_gpu_blocks, block_size, enable_caching, max_model_len)
        self.block_pool = LFUBlockPool(num_gpu_blocks, enable_caching)


register_kv_allocator("paged_no_prefix", paged_no_prefix)
register_kv_allocator("contiguous", ContiguousKVCacheManager)
register_kv_allocator("paged_lfu", LFUKVCacheManager)
