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

The block pool (blocks as ints, the positioned free queue, the prefix-cache index) is
``block_pool.py``; this module is vLLM's ``kv_cache_manager.py``: prefix hits, slot
allocation, caching and freeing per request.
"""

from __future__ import annotations

from collections.abc import Callable

from servesim.simulator.block_pool import NULL, BlockPool
from servesim.simulator.request import Request


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
    """vLLM's ``KVCacheManager`` for one full-attention KV-cache group.

    Block tables are lists of block ids (``Request.block_ids``); ``get_computed_blocks``
    returns hit block ids, ``allocate_slots`` the new block ids (None when the pool is short).
    """

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool,
                 max_model_len: int):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.prefix_cache_stats = PrefixCacheStats()
        self.sliding_window: int | None = None
        self.admission_cap: int | None = None
        # EAGLE / EAGLE-3 / MTP speculative decoding (vLLM ``use_eagle``): a prefix hit drops
        # its last matched block (the draft head needs that block's hidden states recomputed)
        self.use_eagle = False
        # Async scheduling (one batch in flight, counters advanced at schedule time): the
        # batch in flight; a request that sampled in it has one output vLLM does not know
        # yet, which eager caching must not cover (vLLM caps it at ``request.num_tokens``).
        self.inflight_seq = -1
        # ``on_cache(request, start, end)``: table entries [start, end) of ``request`` were
        # cached just now (vLLM ``cache_full_blocks``), request-unique ones included — a KV
        # connector's write-through stores (cluster/offload.py). While one is set every caching
        # step is taken when vLLM takes it, none implicitly (``Scheduler._cache_eager``).
        self.on_cache: Callable[[Request, int, int], None] | None = None

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
        return self.block_pool.get_num_free_blocks()

    # -- prefix hits -----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest prefix hit in full blocks, capped at ``num_tokens - 1`` tokens."""
        if not self.enable_caching:
            return [], 0
        if self.sliding_window:
            return self._sliding_window_hit(request)
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        n_shared = request.num_shared_blocks(bs)
        computed: list[int] = []
        m = max_blocks if max_blocks < n_shared else n_shared
        if m:
            hashes = request.ensure_block_hashes(m, bs)
            index = self.block_pool.cached_block_hash_to_block
            for i in range(m):
                v = index.get(hashes[i])
                if v is None:
                    break
                computed.append(v if type(v) is int else next(iter(v)))
        if len(computed) == m and request.prev_blocks and max_blocks > m:
            # Past the shareable prefix, only this request's own earlier blocks can match
            # (it was preempted): those that still hold their content are hits.
            prev = request.prev_blocks
            stop = min(max_blocks, len(prev), request.prev_cached)
            pos0 = request.prev_pos
            pool = self.block_pool
            head, tombs = pool._head, pool._tombs
            for i in range(m, stop):
                pos = pos0 - i
                if pos < head or pos in tombs or prev[i] == NULL:
                    break
                computed.append(prev[i])
        if self.use_eagle and computed:  # (FullAttentionManager.find_longest_cache_hit)
            computed.pop()
        num_hit = len(computed) * bs
        self.prefix_cache_stats.record(request.num_tokens, num_hit, request.num_preemptions > 0)
        return computed, num_hit

    def _own_block(self, request: Request, i: int) -> int | None:
        """Entry ``i`` (request-unique content) of the request's previous block table if that
        block still holds its cached content, else None."""
        prev = request.prev_blocks
        if i < len(prev) and i < request.prev_cached:
            b = prev[i]
            if b != NULL:
                pos = request.prev_pos - i
                pool = self.block_pool
                if pos >= pool._head and pos not in pool._tombs:
                    return b
        return None

    def _sliding_window_hit(self, request: Request) -> tuple[list[int], int]:
        """``SlidingWindowManager.find_longest_cache_hit``: scanning from the right, the first
        run of ceil((window − 1) / block_size) contiguous cached blocks ends the hit (the
        blocks before it are out of the window: null blocks); without such a run, the run of
        cached blocks at the very start (if any) is the hit. Shareable blocks are looked up
        in the hash index, request-unique ones in the request's previous block table (whose
        out-of-window entries are null blocks: misses). With EAGLE the run needed is one block
        longer and the hit then drops its last block."""
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        n_shared = request.num_shared_blocks(bs)
        hashes = request.ensure_block_hashes(min(max_blocks, n_shared), bs)
        need = -(-(self.sliding_window - 1) // bs) + self.use_eagle
        index = self.block_pool.cached_block_hash_to_block
        run: list[int] = []
        computed: list[int] | None = None
        for i in range(max_blocks - 1, -1, -1):
            if i < n_shared:
                v = index.get(hashes[i])
                blk = v if v is None or type(v) is int else next(iter(v))
            else:
                blk = self._own_block(request, i)
            if blk is None:
                run = []
                continue
            run.append(blk)
            if len(run) >= need:
                computed = [NULL] * i + run[::-1]
                break
        if computed is None:
            computed = run[::-1]
        if self.use_eagle and computed:
            computed.pop()
        num_hit = len(computed) * bs
        self.prefix_cache_stats.record(request.num_tokens, num_hit, request.num_preemptions > 0)
        return computed, num_hit

    def _num_evictable(self, request: Request, hits, start: int = 0) -> int:
        """Hit blocks ``hits[start:]`` that sit in the free queue (reviving takes them out):
        indexed ones that are free, and every own (request-unique) hit."""
        n_shared = request.num_shared_blocks(self.block_size)
        pos = self.block_pool._pos
        n = 0
        for i in range(start, len(hits)):
            b = hits[i]
            if b != NULL and (i >= n_shared or b in pos):
                n += 1
        return n

    def _touch(self, request: Request, hits, start: int = 0) -> None:
        """vLLM ``touch`` on ``hits[start:]`` (table indices ``start``...)."""
        pool = self.block_pool
        n_shared = request.num_shared_blocks(self.block_size)
        pos0 = request.prev_pos
        for i in range(start, len(hits)):
            b = hits[i]
            if b == NULL:
                continue
            if i < n_shared:
                pool.revive(b)
            else:
                pool.revive_own(pos0 - i)
        if pool.track_hits:
            pool.note_hits([b for b in hits[start:] if b != NULL])

    # -- caching ---------------------------------------------------------------------------------
    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's full blocks within its first ``num_tokens`` tokens
        (``SingleTypeKVCacheManager.cache_blocks``)."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        if num_full > request.num_cached_blocks:
            self._cache(request, num_full)

    def _cache(self, request: Request, num_full: int) -> None:
        """Entries [num_cached_blocks, num_full) become cached (``cache_full_blocks``): those
        of shareable content are hashed and indexed (another request may hit them this very
        step); request-unique ones are cached implicitly by ``num_cached_blocks``."""
        bs = self.block_size
        start = request.num_cached_blocks
        n_shared = request.num_shared_blocks(bs)
        end = num_full if num_full < n_shared else n_shared
        if start < end:
            hashes = request.ensure_block_hashes(end, bs)
            table = request.block_ids
            pool = self.block_pool
            for i in range(start, end):
                b = table[i]
                if b != NULL:
                    pool.cache_block(b, hashes[i])
        request.num_cached_blocks = num_full
        if self.on_cache is not None:
            self.on_cache(request, start, num_full)

    # -- sliding window --------------------------------------------------------------------------
    def _skipped_blocks(self, num_computed_tokens: int) -> int:
        """Whole blocks before the window of the next token (``get_num_skipped_tokens``)."""
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _sw_blocks_to_allocate(self, request: Request, num_tokens: int, hits,
                               total_computed: int, admission: bool) -> int:
        """``SingleTypeKVCacheManager.get_num_blocks_to_allocate`` for a sliding window."""
        required = -(-num_tokens // self.block_size)
        if admission and required > self.admission_cap:
            required = self.admission_cap
        held = len(request.block_ids)
        if held:  # running: no new prefix hits
            return max(required - held, 0)
        skipped = self._skipped_blocks(total_computed)
        new = max(required - max(skipped, len(hits)), 0)
        return new + self._num_evictable(request, hits, skipped)

    def _allocate_slots_sw(self, request: Request, num_new_tokens: int,
                           num_new_computed_tokens: int, hits, num_lookahead_tokens: int,
                           full_sequence_must_fit: bool) -> list[int] | None:
        """``allocate_slots`` for a sliding-window model: free the blocks that left the window
        (``remove_skipped_blocks``, done even if the allocation then fails), pad skipped hit
        blocks with the null block, allocate the rest."""
        bs = self.block_size
        pool = self.block_pool
        blocks = request.block_ids
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
        lo = skip
        while lo > 0 and blocks[lo - 1] != NULL:
            lo -= 1
        if lo < skip:
            pool.free_table(blocks, lo, skip, request.num_cached_blocks,
                            request.num_shared_blocks(bs))
            blocks[lo:skip] = [NULL] * (skip - lo)
        if self._sw_blocks_to_allocate(request, need_slot, hits, local,
                                       False) > pool.get_num_free_blocks():
            return None
        if hits and not blocks:
            skipped = self._skipped_blocks(local)
            self._touch(request, hits, skipped)
            blocks.extend([NULL] * skipped)
            blocks.extend(hits[skipped:])
            if request.num_cached_blocks == 0:
                request.num_cached_blocks = len(hits)
        n = -(-need_slot // bs) - len(blocks)
        new_blocks = pool.get_new_blocks(n) if n > 0 else []
        blocks += new_blocks
        request.kv_pool = pool
        if self.enable_caching:
            known = request.num_tokens - (request.sched_seq == self.inflight_seq)
            num_full = min(total_computed + num_new_tokens, known) // bs
            if num_full > request.num_cached_blocks:
                self._cache(request, num_full)
        return new_blocks

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[int] | None = None,
                       num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False) -> list[int] | None:
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
        blocks = request.block_ids
        hits = new_computed_blocks or ()
        evictable = self._num_evictable(request, hits) if hits else 0
        num_free = pool._nfree
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
            self._touch(request, hits)
            blocks += hits
            if request.num_cached_blocks == 0:
                request.num_cached_blocks = len(hits)
        if num_new_blocks > 0:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            blocks += new_blocks
        else:
            new_blocks = []
        request.kv_pool = pool
        if self.enable_caching:
            num_full = num_computed + num_new_tokens
            known = request.num_tokens - (request.sched_seq == self.inflight_seq)
            if num_full > known:  # only tokens vLLM knows (not those in flight)
                num_full = known
            num_full //= bs
            if num_full > request.num_cached_blocks:
                if (request.num_cached_blocks < request.num_shared_blocks(bs)
                        or self.on_cache is not None):
                    self._cache(request, num_full)
                else:  # request-unique content: cached implicitly
                    request.num_cached_blocks = num_full
        return new_blocks

    def append_decode_blocks(self, members: list[Request]) -> None:
        """One new block for each request of ``members`` (in that order): decode-group members
        crossing a block boundary (the scheduler caches their content, see
        ``Scheduler._cache_members`` and ``Scheduler._sync``)."""
        for r, b in zip(members, self.block_pool.get_new_blocks(len(members))):
            r.block_ids.append(b)

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks, tail first."""
        blocks = request.block_ids
        if blocks:
            request.prev_pos = self.block_pool.free_table(
                blocks, 0, len(blocks), request.num_cached_blocks,
                request.num_shared_blocks(self.block_size))
            request.prev_cached = request.num_cached_blocks if self.enable_caching else 0
        else:
            request.prev_cached = 0
        request.prev_blocks = blocks  # for its own prefix hits if it was preempted
        request.block_ids = []
        request.num_cached_blocks = 0

    def check_invariants(self) -> None:
        """free ⟺ ref_cnt == 0 (null block excluded), and the pool's own bookkeeping; tests."""
        pool = self.block_pool
        pool.check()
        free_ids = set(pool.free_ids())
        for b in range(1, pool.num_gpu_blocks):
            ref = pool._ref.get(b, 0 if b in free_ids else 1)
            assert (b in free_ids) == (ref == 0), pool.blocks[b]
            assert ref >= 0, pool.blocks[b]
