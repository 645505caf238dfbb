"""Paged KV cache with prefix caching, as vLLM V1's ``v1/core`` implements it.

Names follow vLLM (``kv_cache_utils.py``, ``block_pool.py``, ``kv_cache_manager.py``); rules and
line references are in the course digest §3:

- block 0 is the reserved ``null_block`` (never cached, excluded from usage);
- free ⟺ ``ref_cnt == 0``; freed blocks keep their hash (lazy eviction) and are evicted LRU from
  the front of the free queue when reallocated;
- a request's blocks are freed in reverse order, so tails are evicted before shared heads;
- only full blocks are hashed; hashes chain parent hash + content (+ LoRA/salt at the root);
- prefix hits are capped at ``num_tokens - 1`` (the last token is recomputed for logits);
- blocks are cached eagerly at allocation, so requests admitted in one step already share;
- sliding-window models (``SlidingWindowManager``): blocks that fall out of the window are
  freed and replaced by the null block, prefix hits need a window's worth of contiguous cached
  blocks, and admission reserves at most the window's blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from servesim.simulator.request import Request


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "is_null", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.is_null = False

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction (LRU) order: O(1) ``popleft``, ``append`` and middle ``remove``.

    vLLM hand-rolls a doubly linked list; an ``OrderedDict`` keyed by block id has the same
    operations and order, implemented in C.
    """

    __slots__ = ("_q",)

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._q: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._q)

    def popleft(self) -> KVCacheBlock:
        return self._q.popitem(last=False)[1]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        pop = self._q.popitem
        return [pop(last=False)[1] for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        del self._q[block.block_id]

    def append(self, block: KVCacheBlock) -> None:
        self._q[block.block_id] = block

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        q = self._q
        for b in blocks:
            q[b.block_id] = b

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self._q.values())


class BlockPool:
    """All KV blocks of one replica, the free queue and the prefix-cache index."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool):
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (block 0 is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> block, or {block_id: block} when several blocks hold the same content
        # (vLLM's BlockHashToBlockMap: no dedup, so block ids stay stable).
        self.cached_block_hash_to_block: dict[int, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Sliding-window block tables hold the null block in place of freed blocks; it is
        # referenced and released like any block but must never reach 0 (never freed).
        self.null_block.ref_cnt = 1 << 62
        self.num_evictions = 0

    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue._q)

    def get_usage(self) -> float:
        """KV-cache usage in [0, 1]: used / (total - null block), vLLM's ``get_usage``."""
        return 1.0 - len(self.free_block_queue._q) / (self.num_gpu_blocks - 1)

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        v = self.cached_block_hash_to_block.get(block_hash)
        if v is None or type(v) is KVCacheBlock:
            return v
        return next(iter(v.values()))

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the free queue front, evicting their cached hashes."""
        q = self.free_block_queue._q
        if num_blocks > len(q):
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        pop = q.popitem
        ret = [pop(False)[1] for _ in range(num_blocks)]
        if self.enable_caching:
            index = self.cached_block_hash_to_block
            for block in ret:
                h = block.block_hash
                if h is not None:  # _maybe_evict_cached_block, inlined (hot path)
                    v = index.get(h)
                    if v is block:
                        del index[h]
                    elif v is not None:
                        self._evict_from_entry(block, h, v)
                    block.block_hash = None
                    self.num_evictions += 1
                block.ref_cnt += 1
        else:
            for block in ret:
                block.ref_cnt += 1
        return ret

    def _evict_from_entry(self, block: KVCacheBlock, h: int, v) -> None:
        if type(v) is dict:
            v.pop(block.block_id, None)
            if len(v) == 1:
                self.cached_block_hash_to_block[h] = next(iter(v.values()))
            elif not v:
                del self.cached_block_hash_to_block[h]

    def _evict(self, block: KVCacheBlock) -> None:
        """vLLM ``_maybe_evict_cached_block``: drop the block from the hash index."""
        h = block.block_hash
        v = self.cached_block_hash_to_block.get(h)
        if v is block:
            del self.cached_block_hash_to_block[h]
        elif v is not None:
            self._evict_from_entry(block, h, v)
        block.block_hash = None
        self.num_evictions += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving free ones from the queue middle."""
        q = self.free_block_queue._q
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                del q[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 go to the queue tail, keeping hashes."""
        q = self.free_block_queue._q
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if not block.ref_cnt:
                q[block.block_id] = block

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[int],
                          num_cached_blocks: int, num_full_blocks: int,
                          num_shared: int | None = None) -> None:
        """Mark ``blocks[num_cached_blocks:num_full_blocks]`` cached under their hashes.

        Blocks ``i < num_shared`` (content another request can hold: workload prefix ids,
        token ids) go into the hash index. Content unique to the request can only ever be hit
        by the request itself after a preemption; such blocks keep their hash on the block and
        are found through the request's previous block table (``KVCacheManager``) — the same
        hits vLLM's index would give, without indexing millions of never-shared blocks.
        """
        index = self.cached_block_hash_to_block
        end_shared = num_full_blocks if num_shared is None else min(num_shared, num_full_blocks)
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if blk.is_null:  # out of the sliding window
                continue
            h = block_hashes[i]
            blk.block_hash = h
            if i < end_shared:
                v = index.get(h)
                if v is None:
                    index[h] = blk
                elif type(v) is dict:
                    v[blk.block_id] = blk
                else:
                    index[h] = {v.block_id: v, blk.block_id: blk}


class PrefixCacheStats:
    """vLLM's ``PrefixCacheStats``: queries and hits in tokens; preempted requests apart."""

    __slots__ = (
        "hits",
        "preempted_hits",
        "preempted_queries",
        "preempted_requests",
        "queries",
        "requests",
    )

    def __init__(self):
        self.requests = self.queries = self.hits = 0
        self.preempted_requests = self.preempted_queries = self.preempted_hits = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class KVCacheManager:
    """vLLM's ``KVCacheManager`` for one full-attention KV-cache group."""

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool,
                 max_model_len: int):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self.sliding_window: int | None = None
        self.admission_cap: int | None = None
        # Async scheduling (one batch in flight, counters advanced at schedule time): the
        # batch in flight; a request that sampled in it has one output vLLM does not know
        # yet, which eager caching must not cover (vLLM caps it at ``request.num_tokens``).
        self.inflight_seq = -1

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's full blocks within its first ``num_tokens`` tokens
        (``SingleTypeKVCacheManager.cache_blocks``)."""
        if not self.enable_caching:
            return
        bs = self.block_size
        num_full = min(num_tokens, request.num_tokens) // bs
        if num_full > request.num_cached_blocks:
            hashes = request.ensure_block_hashes(num_full, bs)
            self.block_pool.cache_full_blocks(request.blocks, hashes, request.num_cached_blocks,
                                              num_full, request.num_shared_blocks(bs))
            request.num_cached_blocks = num_full

    def set_sliding_window(self, window: int, max_num_batched_tokens: int) -> None:
        """Every layer attends over the last ``window`` tokens (Mistral-7B v0.1): vLLM's
        ``SlidingWindowManager``. Admission reserves at most ``SlidingWindowSpec.
        max_admission_blocks_per_request`` = ceil(min(window − 1 + max_num_batched_tokens,
        max_model_len) / block_size) + 1 blocks."""
        self.sliding_window = window
        tokens = min(window - 1 + max_num_batched_tokens, self.max_model_len)
        self.admission_cap = -(-tokens // self.block_size) + 1

    @property
    def num_gpu_blocks(self) -> int:
        return self.block_pool.num_gpu_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_num_free_blocks(self) -> int:
        return len(self.block_pool.free_block_queue._q)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest prefix hit in full blocks, capped at ``num_tokens - 1`` tokens."""
        if not self.enable_caching:
            return [], 0
        if self.sliding_window:
            return self._sliding_window_hit(request)
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = request.ensure_block_hashes(max_blocks, bs)
        n_shared = request.num_shared_blocks(bs)
        pool = self.block_pool
        index = pool.cached_block_hash_to_block
        computed: list[KVCacheBlock] = []
        for i in range(min(max_blocks, n_shared)):
            v = index.get(hashes[i])
            if v is None:
                break
            computed.append(v if type(v) is KVCacheBlock else next(iter(v.values())))
        else:
            # Past the shareable prefix, only this request's own earlier blocks can match
            # (it was preempted): those that still hold their content are hits.
            prev = request.prev_blocks
            for i in range(len(computed), min(max_blocks, len(prev))):
                blk = prev[i]
                if blk.block_hash != hashes[i]:
                    break
                computed.append(blk)
        num_hit = len(computed) * bs
        self.prefix_cache_stats.record(request.num_tokens, num_hit, request.num_preemptions > 0)
        return computed, num_hit

    def _cached_block(self, request: Request, i: int, hashes: list[int],
                      n_shared: int) -> KVCacheBlock | None:
        """Block ``i`` of ``request`` if its content is cached: the hash index for shareable
        blocks, the request's own previous block table for content unique to it."""
        if i < n_shared:
            v = self.block_pool.cached_block_hash_to_block.get(hashes[i])
            return v if v is None or type(v) is KVCacheBlock else next(iter(v.values()))
        prev = request.prev_blocks
        if i < len(prev) and prev[i].block_hash == hashes[i]:
            return prev[i]
        return None

    def _sliding_window_hit(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """``SlidingWindowManager.find_longest_cache_hit``: scanning from the right, the first
        run of ceil((window − 1) / block_size) contiguous cached blocks ends the hit (the
        blocks before it are out of the window: null blocks); without such a run, the run of
        cached blocks at the very start (if any) is the hit."""
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = request.ensure_block_hashes(max_blocks, bs)
        n_shared = request.num_shared_blocks(bs)
        need = -(-(self.sliding_window - 1) // bs)
        run: list[KVCacheBlock] = []
        computed: list[KVCacheBlock] | None = None
        for i in range(max_blocks - 1, -1, -1):
            blk = self._cached_block(request, i, hashes, n_shared)
            if blk is None:
                run = []
                continue
            run.append(blk)
            if len(run) >= need:
                computed = [self.block_pool.null_block] * i + run[::-1]
                break
        if computed is None:
            computed = run[::-1]
        num_hit = len(computed) * bs
        self.prefix_cache_stats.record(request.num_tokens, num_hit, request.num_preemptions > 0)
        return computed, num_hit

    def _skipped_blocks(self, num_computed_tokens: int) -> int:
        """Whole blocks before the window of the next token (``get_num_skipped_tokens``)."""
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _sw_blocks_to_allocate(self, request: Request, num_tokens: int,
                               hits: list[KVCacheBlock] | tuple, total_computed: int,
                               admission: bool) -> int:
        """``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` for a sliding window."""
        required = -(-num_tokens // self.block_size)
        if admission and required > self.admission_cap:
            required = self.admission_cap
        held = len(request.blocks)
        if held:  # running: no new prefix hits
            return max(required - held, 0)
        skipped = self._skipped_blocks(total_computed)
        new = max(required - max(skipped, len(hits)), 0)
        evictable = sum(1 for b in hits[skipped:] if b.ref_cnt == 0 and not b.is_null)
        return new + evictable

    def _allocate_slots_sw(self, request: Request, num_new_tokens: int,
                           num_new_computed_tokens: int, hits, num_lookahead_tokens: int,
                           full_sequence_must_fit: bool) -> list[KVCacheBlock] | None:
        """``allocate_slots`` for a sliding-window model: free the blocks that left the window
        (``remove_skipped_blocks``, done even if the allocation then fails), pad skipped hit
        blocks with the null block, allocate the rest."""
        bs = self.block_size
        pool = self.block_pool
        blocks = request.blocks
        hits = hits or ()
        mml = self.max_model_len
        local = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(local, mml)
        if full_sequence_must_fit:
            full = min(request.num_tokens, mml)
            if self._sw_blocks_to_allocate(request, full, hits, total_computed,
                                           True) > pool.get_num_free_blocks():
                return None
        need_slot = min(total_computed + num_new_tokens + num_lookahead_tokens, mml)
        skip = min(self._skipped_blocks(total_computed), len(blocks))
        removed = []
        for i in range(skip - 1, -1, -1):
            if blocks[i].is_null:
                break
            removed.append(blocks[i])
            blocks[i] = pool.null_block
        if removed:
            pool.free_blocks(removed)
        if self._sw_blocks_to_allocate(request, need_slot, hits, local,
                                       False) > pool.get_num_free_blocks():
            return None
        if hits and not blocks:
            skipped = self._skipped_blocks(local)
            kept = list(hits[skipped:])
            pool.touch(kept)
            blocks.extend([pool.null_block] * skipped)
            blocks.extend(kept)
            if request.num_cached_blocks == 0:
                request.num_cached_blocks = len(hits)
        n = -(-need_slot // bs) - len(blocks)
        new_blocks = pool.get_new_blocks(n) if n > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            known = request.num_tokens - (request.sched_seq == self.inflight_seq)
            num_full = min(total_computed + num_new_tokens, known) // bs
            if num_full > request.num_cached_blocks:
                hashes = request.ensure_block_hashes(num_full, bs)
                pool.cache_full_blocks(blocks, hashes, request.num_cached_blocks, num_full,
                                       request.num_shared_blocks(bs))
                request.num_cached_blocks = num_full
        return new_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` (+ lookahead); None when the pool is short.

        Blocks needed = ceil(min(computed + hits + new + lookahead, max_model_len) / block_size)
        − blocks held − hit blocks, plus hit blocks that sit in the free queue (reviving them
        takes them out of it). On success the newly full blocks are cached at once (eager).

        ``full_sequence_must_fit`` (vLLM 0.22's admission gate for new and resumed requests,
        ``SchedulerConfig.scheduler_reserve_full_isl``): refuse unless the free blocks also
        cover the whole sequence so far, ceil(min(num_tokens, max_model_len) / block_size)
        − blocks held − hit blocks (≥ 0) + evictable hit blocks, not only this chunk
        (``KVCacheManager.allocate_slots`` → ``get_num_blocks_to_allocate``).
        """
        if self.sliding_window:
            return self._allocate_slots_sw(request, num_new_tokens, num_new_computed_tokens,
                                           new_computed_blocks, num_lookahead_tokens,
                                           full_sequence_must_fit)
        bs = self.block_size
        pool = self.block_pool
        blocks = request.blocks
        hits = new_computed_blocks or ()
        # Hit blocks sitting in the free queue leave it when touched: they count too.
        evictable = sum(1 for b in hits if b.ref_cnt == 0 and not b.is_null) if hits else 0
        num_free = len(pool.free_block_queue._q)
        if full_sequence_must_fit:
            full = request.num_tokens
            if full > self.max_model_len:
                full = self.max_model_len
            full_blocks = -(-full // bs) - len(blocks) - len(hits)
            if (full_blocks if full_blocks > 0 else 0) + evictable > num_free:
                return None
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        need_tokens = num_computed + num_new_tokens + num_lookahead_tokens
        if need_tokens > self.max_model_len:
            need_tokens = self.max_model_len
        num_new_blocks = -(-need_tokens // bs) - len(blocks) - len(hits)
        if num_new_blocks + evictable > num_free:
            return None
        if hits:
            pool.touch(hits)
            blocks.extend(hits)
            if request.num_cached_blocks == 0:
                request.num_cached_blocks = len(hits)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        if new_blocks:
            blocks.extend(new_blocks)
        if self.enable_caching:
            num_tokens_to_cache = num_computed + num_new_tokens
            known = request.num_tokens - (request.sched_seq == self.inflight_seq)
            if num_tokens_to_cache > known:  # only tokens vLLM knows (not those in flight)
                num_tokens_to_cache = known
            num_full = num_tokens_to_cache // bs
            if num_full > request.num_cached_blocks:
                hashes = request.ensure_block_hashes(num_full, bs)
                pool.cache_full_blocks(blocks, hashes, request.num_cached_blocks, num_full,
                                       request.num_shared_blocks(bs))
                request.num_cached_blocks = num_full
        return new_blocks

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks, tail first."""
        blocks = request.blocks
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
        request.prev_blocks = blocks  # for its own prefix hits if it was preempted
        request.blocks = []
        request.num_cached_blocks = 0

    def check_invariants(self) -> None:
        """free ⟺ ref_cnt == 0 (null block excluded); used by tests."""
        free_ids = set(self.block_pool.free_block_queue._q)
        for b in self.block_pool.blocks:
            if b.is_null:
                continue
            assert (b.block_id in free_ids) == (b.ref_cnt == 0), b
            assert b.ref_cnt >= 0, b
