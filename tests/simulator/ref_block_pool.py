"""A straightforward reference of vLLM V1's block pool and KV cache manager (v0.22.1,
``v1/core/block_pool.py``, ``kv_cache_utils.py``, ``kv_cache_manager.py``,
``single_type_kv_cache_manager.py``), for tests: one object per block, vLLM's doubly linked
free queue, every full block hashed and put in the index (request-unique content under a key
no other request has), per-block reference counts. ``servesim.simulator.kv_cache`` must make
exactly the same decisions (``test_block_pool.py``).

The manager keeps its per-request state in its own dicts (keyed by ``request_id``), so the
same ``Request`` objects can drive it and the production manager side by side.

One rule is servesim's, not vLLM's: under a sliding window a request finds its own
request-unique blocks through its previous block table (``prev_tables``), whose out-of-window
entries are the null block, so it misses those (vLLM's index would still hold them).
"""

from __future__ import annotations


class RefBlock:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash = None
        self.prev_free = None
        self.next_free = None
        self.is_null = False


class RefFreeQueue:
    """vLLM's ``FreeKVCacheBlockQueue``: a doubly linked list with fake head and tail."""

    def __init__(self, blocks: list[RefBlock]):
        self.num_free_blocks = len(blocks)
        self.head = RefBlock(-1)
        self.tail = RefBlock(-1)
        prev = self.head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = self.tail
        self.tail.prev_free = prev

    def popleft(self) -> RefBlock:
        b = self.head.next_free
        assert b is not self.tail, "no free block"
        self.remove(b)
        return b

    def remove(self, b: RefBlock) -> None:
        b.prev_free.next_free = b.next_free
        b.next_free.prev_free = b.prev_free
        b.prev_free = b.next_free = None
        self.num_free_blocks -= 1

    def append(self, b: RefBlock) -> None:
        last = self.tail.prev_free
        last.next_free = b
        b.prev_free = last
        b.next_free = self.tail
        self.tail.prev_free = b
        self.num_free_blocks += 1

    def ids(self) -> list[int]:
        out = []
        b = self.head.next_free
        while b is not self.tail:
            out.append(b.block_id)
            b = b.next_free
        return out


class RefBlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool):
        self.blocks = [RefBlock(i) for i in range(num_gpu_blocks)]
        self.enable_caching = enable_caching
        self.queue = RefFreeQueue(self.blocks)
        self.index: dict = {}  # hash -> {block_id: block}
        self.null_block = self.queue.popleft()
        self.null_block.is_null = True
        self.num_evictions = 0

    def get_cached_block(self, h):
        d = self.index.get(h)
        return next(iter(d.values())) if d else None

    def _maybe_evict_cached_block(self, b: RefBlock) -> None:
        if b.block_hash is None:
            return
        d = self.index.get(b.block_hash)
        if d is not None:
            d.pop(b.block_id, None)
            if not d:
                del self.index[b.block_hash]
        b.block_hash = None
        self.num_evictions += 1

    def get_new_blocks(self, n: int) -> list[RefBlock]:
        assert n <= self.queue.num_free_blocks
        ret = [self.queue.popleft() for _ in range(n)]
        for b in ret:
            if self.enable_caching:
                self._maybe_evict_cached_block(b)
            assert b.ref_cnt == 0
            b.ref_cnt += 1
        return ret

    def touch(self, blocks) -> None:
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null:
                self.queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered) -> None:
        ordered = list(ordered)
        for b in ordered:
            b.ref_cnt -= 1
        for b in ordered:
            if b.ref_cnt == 0 and not b.is_null:
                self.queue.append(b)

    def cache_full_blocks(self, blocks, hashes, num_cached: int, num_full: int) -> None:
        for i in range(num_cached, num_full):
            b = blocks[i]
            if b.is_null:
                continue
            assert b.block_hash is None
            b.block_hash = hashes[i]
            self.index.setdefault(hashes[i], {})[b.block_id] = b


class RefKVCacheManager:
    """vLLM's ``KVCacheManager`` (one group; full attention or a sliding window)."""

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_caching: bool,
                 max_model_len: int, sliding_window: int | None = None,
                 max_num_batched_tokens: int = 0):
        self.pool = RefBlockPool(num_gpu_blocks, enable_caching)
        self.bs = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.window = sliding_window
        if sliding_window:
            tokens = min(sliding_window - 1 + max_num_batched_tokens, max_model_len)
            self.admission_cap = -(-tokens // block_size) + 1
        self.req_blocks: dict[str, list[RefBlock]] = {}
        self.prev_tables: dict[str, list[RefBlock]] = {}  # block table when last freed
        self.num_cached: dict[str, int] = {}
        self.queries = self.hits = self.preempted_queries = self.preempted_hits = 0
        self.requests = self.preempted_requests = 0  # lookups (vLLM PrefixCacheStats)

    # Block content: workload prefix ids, else prompt token ids, else unique to the request.
    def block_hashes(self, req, n: int) -> list:
        out, parent = [], ("root", req.spec.lora, req.spec.cache_salt)
        ids, toks, bs = req.prefix_block_ids, req.prompt_token_ids, self.bs
        n_tok = req.prompt_len // bs if toks is not None else 0
        for i in range(n):
            if i < len(ids):
                key = ("id", ids[i])
            elif i < n_tok:
                key = ("tok", tuple(toks[i * bs:(i + 1) * bs]))
            else:
                key = ("unique", req.request_id, i)
            parent = (parent, key)
            out.append(parent)
        return out

    def num_shared(self, req) -> int:
        """Leading blocks whose content another request can hold (prefix ids, prompt tokens)."""
        n_tok = req.prompt_len // self.bs if req.prompt_token_ids is not None else 0
        return max(len(req.prefix_block_ids), n_tok)

    def _record(self, req, num_hit: int) -> None:
        if req.num_preemptions > 0:
            self.preempted_requests += 1
            self.preempted_queries += req.num_tokens
            self.preempted_hits += num_hit
        else:
            self.requests += 1
            self.queries += req.num_tokens
            self.hits += num_hit

    def get_computed_blocks(self, req):
        if not self.enable_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.bs
        hashes = self.block_hashes(req, max_blocks)
        if self.window:
            need = -(-(self.window - 1) // self.bs)
            n_shared = self.num_shared(req)
            prev = self.prev_tables.get(req.request_id, [])
            run, computed = [], None
            for i in range(max_blocks - 1, -1, -1):
                if i < n_shared:
                    b = self.pool.get_cached_block(hashes[i])
                else:  # own content: through the previous table
                    b = prev[i] if i < len(prev) and not prev[i].is_null and \
                        prev[i].block_hash == hashes[i] else None
                if b is None:
                    run = []
                    continue
                run.append(b)
                if len(run) >= need:
                    computed = [self.pool.null_block] * i + run[::-1]
                    break
            if computed is None:
                computed = run[::-1]
        else:
            computed = []
            for h in hashes:
                b = self.pool.get_cached_block(h)
                if b is None:
                    break
                computed.append(b)
        self._record(req, len(computed) * self.bs)
        return computed, len(computed) * self.bs

    def _skipped(self, computed: int) -> int:
        return max(0, computed - self.window + 1) // self.bs

    def _to_allocate(self, req, num_tokens: int, hits, total_computed: int,
                     admission: bool) -> int:
        blocks = self.req_blocks.get(req.request_id, [])
        required = -(-num_tokens // self.bs)
        if self.window and admission and required > self.admission_cap:
            required = self.admission_cap
        if self.window:
            if blocks:
                return max(required - len(blocks), 0)
            skipped = self._skipped(total_computed)
            new = max(required - max(skipped, len(hits)), 0)
            return new + sum(1 for b in hits[skipped:] if b.ref_cnt == 0 and not b.is_null)
        new = max(required - len(blocks) - len(hits), 0)
        return new + sum(1 for b in hits if b.ref_cnt == 0 and not b.is_null)

    def allocate_slots(self, req, num_new_tokens: int, num_new_computed: int = 0, hits=None,
                       lookahead: int = 0, full: bool = False):
        rid = req.request_id
        hits = list(hits or [])
        blocks = self.req_blocks.setdefault(rid, [])
        mml = self.max_model_len
        local = req.num_computed_tokens + num_new_computed
        total_computed = min(local, mml)
        if full and self._to_allocate(req, min(req.num_tokens, mml), hits, total_computed,
                                      True) > self.pool.queue.num_free_blocks:
            return None
        need = min(total_computed + num_new_tokens + lookahead, mml)
        if self.window:  # remove_skipped_blocks, even if the allocation then fails
            skip = min(self._skipped(total_computed), len(blocks))
            removed = []
            for i in range(skip - 1, -1, -1):
                if blocks[i].is_null:
                    break
                removed.append(blocks[i])
                blocks[i] = self.pool.null_block
            self.pool.free_blocks(removed)
        if self._to_allocate(req, need, hits, local, False) > self.pool.queue.num_free_blocks:
            return None
        if hits and not blocks:
            skipped = self._skipped(local) if self.window else 0
            kept = hits[skipped:]
            self.pool.touch(kept)
            blocks.extend([self.pool.null_block] * skipped)
            blocks.extend(kept)
            if self.num_cached.get(rid, 0) == 0:
                self.num_cached[rid] = len(hits)
        n = -(-need // self.bs) - len(blocks)
        new = self.pool.get_new_blocks(n) if n > 0 else []
        blocks.extend(new)
        if self.enable_caching:
            num_full = min(total_computed + num_new_tokens, req.num_tokens) // self.bs
            cached = self.num_cached.get(rid, 0)
            if num_full > cached:
                hashes = self.block_hashes(req, num_full)
                self.pool.cache_full_blocks(blocks, hashes, cached, num_full)
                self.num_cached[rid] = num_full
        return new

    def free(self, req) -> None:
        blocks = self.req_blocks.pop(req.request_id, [])
        self.pool.free_blocks(reversed(blocks))
        self.prev_tables[req.request_id] = blocks
        self.num_cached[req.request_id] = 0

    def table(self, req) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req.request_id, [])]
