"""The block pool: all KV blocks of one replica, the free queue and the prefix-cache index, as
vLLM V1's ``v1/core/block_pool.py`` (with ``kv_cache_utils.py``'s ``KVCacheBlock`` and
``FreeKVCacheBlockQueue`` as read-only views); ``kv_cache.py``'s ``KVCacheManager`` drives it.

Representation (speed; same decisions, ``tests/simulator/test_block_pool.py`` checks it against
a straightforward per-block implementation): blocks are ints, a request's block table is a list
of ids (``Request.block_ids``), and work is per request, not per block:

- The free queue is a list of block ids indexed by *position* (positions only grow: a block
  freed later sits further back). Allocation slices ``n`` ids off the front; a request's free
  appends its table reversed in one ``extend``. Taking a free block out of the middle (a prefix
  hit reviving it) leaves a tombstone (-1) that the front skips.
- Content that another request can hold (workload prefix ids, prompt token ids: the leading
  ``Request.num_shared_blocks`` blocks) is hashed and indexed eagerly, block by block, as vLLM
  does: those blocks carry explicit reference counts (``_ref``) and, while free, their
  position (``_pos``). Content unique to a request can only be hit by the request itself after
  a preemption (through its previous block table, ``Request.prev_blocks``; under a sliding
  window the entries that left the window are null blocks there, so it misses those), so it
  is not hashed at all: a request's first ``num_cached_blocks`` blocks are cached, a freed
  request's unique blocks occupy a known run of positions, and a block of that run still holds
  its content iff the front has not passed its position (nor a tombstone replaced it).
  Evictions of such content are counted per run of cached positions (``_cr``).
- ``KVCacheBlock`` objects (``pool.blocks``, ``Request.blocks``) are read-only views for tests
  and tools.
"""

from __future__ import annotations

from bisect import bisect_right
from heapq import heappop, heappush
from operator import itemgetter

NULL = 0  # the null block's id
_TOMB = -1  # a free-queue slot whose block was taken out of the middle
_first = itemgetter(0)


class KVCacheBlock:
    """A read-only view of one block: ``block_id``, ``is_null``, ``ref_cnt`` and the
    ``block_hash`` it is indexed under (None for request-unique content, which is not hashed)."""

    __slots__ = ("_pool", "block_id", "is_null")

    def __init__(self, pool: BlockPool, block_id: int):
        self._pool = pool
        self.block_id = block_id
        self.is_null = block_id == NULL

    @property
    def ref_cnt(self) -> int:
        return self._pool.ref_cnt(self.block_id)

    @property
    def block_hash(self) -> int | None:
        return self._pool._hash.get(self.block_id)

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """The free queue as vLLM exposes it (read-only view): count and blocks in eviction order."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool):
        self._pool = pool

    @property
    def num_free_blocks(self) -> int:
        return self._pool._nfree

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        views = self._pool.blocks
        return [views[b] for b in self._pool.free_ids()]


class BlockPool:
    """All KV blocks of one replica, the free queue and the prefix-cache index."""

    track_hits = False  # subclasses that count prefix hits per block (paged_lfu)

    def __init__(self, num_gpu_blocks: int, enable_caching: bool):
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (block 0 is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        # Free queue: _fq[pos - _base] for absolute positions pos >= _head (front).
        self._fq: list[int] = list(range(1, num_gpu_blocks))
        self._base = 0
        self._head = 0
        self._nfree = num_gpu_blocks - 1
        self._tombs: dict[int, bool] = {}  # position -> it lay in a cached run
        self._tomb_heap: list[int] = []
        # Runs [start, end) of positions whose (request-unique) blocks hold cached content.
        self._cr: list[list[int]] = []
        self._cri = 0
        # hash -> block id, or {block_id: None} when several blocks hold the same content
        # (vLLM's BlockHashToBlockMap: no dedup, so block ids stay stable).
        self.cached_block_hash_to_block: dict[int, int | dict[int, None]] = {}
        self._hash: dict[int, int] = {}  # indexed block -> its hash
        self._ref: dict[int, int] = {}  # indexed block in use -> reference count
        self._pos: dict[int, int] = {}  # indexed free block -> its position
        self.num_evictions = 0
        self._views: list[KVCacheBlock] | None = None
        self.free_block_queue = FreeKVCacheBlockQueue(self)

    # -- views (tests, tools) --------------------------------------------------------------------
    @property
    def blocks(self) -> list[KVCacheBlock]:
        if self._views is None:
            self._views = [KVCacheBlock(self, i) for i in range(self.num_gpu_blocks)]
        return self._views

    @property
    def null_block(self) -> KVCacheBlock:
        return self.blocks[NULL]

    def free_ids(self) -> list[int]:
        """Free block ids in eviction order (front first)."""
        return [b for b in self._fq[self._head - self._base:] if b >= 0]

    def ref_cnt(self, block_id: int) -> int:
        if block_id == NULL:
            return 1 << 62  # referenced by sliding-window tables, never freed
        r = self._ref.get(block_id)
        if r is not None:
            return r
        return 0 if block_id in set(self.free_ids()) else 1

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        b = self.cached_block_id(block_hash)
        return None if b is None else self.blocks[b]

    def cached_block_id(self, block_hash: int) -> int | None:
        v = self.cached_block_hash_to_block.get(block_hash)
        if v is None or type(v) is int:
            return v
        return next(iter(v))

    # -- counts ----------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self._nfree

    def get_usage(self) -> float:
        """KV-cache usage in [0, 1]: used / (total - null block), vLLM's ``get_usage``."""
        return 1.0 - self._nfree / (self.num_gpu_blocks - 1)

    # -- the free queue --------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` from the free queue front, evicting their cached content."""
        if num_blocks > self._nfree:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        h = self._head
        end = h + num_blocks
        th = self._tomb_heap
        if th and th[0] < end:
            return self._get_past_tombs(num_blocks)
        base = self._base
        ids = self._fq[h - base:end - base]
        self._head = end
        self._nfree -= num_blocks
        if self.enable_caching:
            cr = self._cr
            i = self._cri
            if i < len(cr):
                run = cr[i]
                if run[0] < end:
                    if run[1] > end:  # (common) the popped blocks end inside one cached run
                        self.num_evictions += end - run[0]
                        run[0] = end
                    else:
                        self._evict_runs(end, ())
            if self._pos:
                self._evict_indexed(ids)
        if end - base > 4096 and (end - base) * 2 > len(self._fq):
            del self._fq[:end - base]
            self._base = end
        return ids

    def _get_past_tombs(self, num_blocks: int) -> list[int]:
        """``get_new_blocks`` when tombstones lie in the way (blocks taken from the middle)."""
        fq, base, h = self._fq, self._base, self._head
        end = h + num_blocks
        th = self._tomb_heap
        skipped = []
        while th and th[0] < end:
            skipped.append(heappop(th))
            end += 1
        ids = [b for b in fq[h - base:end - base] if b >= 0]
        self._head = end
        self._nfree -= num_blocks
        if self.enable_caching:
            cr = self._cr
            i = self._cri
            if i < len(cr) and cr[i][0] < end:
                self._evict_runs(end, skipped)
            if self._pos:
                self._evict_indexed(ids)
        tombs = self._tombs
        for t in skipped:
            del tombs[t]
        if end - base > 4096 and (end - base) * 2 > len(fq):
            del fq[:end - base]
            self._base = end
        return ids

    def _evict_runs(self, end: int, skipped) -> None:
        """The front reached position ``end``: cached request-unique content before it is
        evicted (tombstoned positions ``skipped`` were taken out before, not evicted)."""
        cr = self._cr
        i = self._cri
        n = len(cr)
        ev = 0
        while i < n:
            run = cr[i]
            s, e = run
            if s >= end:
                break
            if e <= end:
                ev += e - s
                i += 1
            else:
                ev += end - s
                run[0] = end
                break
        self._cri = i
        if skipped:
            tombs = self._tombs
            ev -= sum(1 for t in skipped if tombs[t])
        self.num_evictions += ev
        if i > 1024 and i * 2 > n:
            del cr[:i]
            self._cri = 0

    def _evict_indexed(self, ids: list[int]) -> None:
        """Indexed (shareable) content of the popped ``ids`` is evicted."""
        pos = self._pos
        for b in [*filter(pos.__contains__, ids)]:
            del pos[b]
            self._unindex(b)
            self.num_evictions += 1

    def _unindex(self, b: int) -> None:
        """vLLM ``_maybe_evict_cached_block``: drop block ``b`` from the hash index."""
        h = self._hash.pop(b)
        index = self.cached_block_hash_to_block
        v = index[h]
        if type(v) is int:
            del index[h]
        else:
            del v[b]
            if len(v) == 1:
                index[h] = next(iter(v))

    def _in_cached_run(self, pos: int) -> bool:
        cr = self._cr
        i = bisect_right(cr, pos, lo=self._cri, key=_first) - 1
        return i >= self._cri and cr[i][1] > pos

    def _take(self, pos: int, cached: bool) -> None:
        """Take the free block at ``pos`` out of the middle of the queue (tombstone)."""
        self._fq[pos - self._base] = _TOMB
        self._tombs[pos] = cached
        heappush(self._tomb_heap, pos)
        self._nfree -= 1

    def _append_run(self, ids: list[int], num_cached: int) -> int:
        """Append ``ids`` (already in eviction order) at the tail; the last ``num_cached`` of
        them hold cached request-unique content. Returns the position of the first."""
        fq = self._fq
        p = self._base + len(fq)
        fq += ids
        n = len(ids)
        self._nfree += n
        if num_cached > 0:
            s = p + n - num_cached
            cr = self._cr
            if len(cr) > self._cri and cr[-1][1] == s:
                cr[-1][1] = p + n
            else:
                cr.append([s, p + n])
        return p

    def _free_one(self, b: int) -> None:
        """Drop one reference on a block at a shareable position (or a sliding-window block)."""
        r = self._ref.get(b)
        if r is not None:
            if r > 1:
                self._ref[b] = r - 1
                return
            del self._ref[b]
            self._pos[b] = self._base + len(self._fq)
        self._fq.append(b)
        self._nfree += 1

    def free_table(self, table: list[int], lo: int, hi: int, num_cached: int,
                   num_shared: int) -> int:
        """Free ``table[lo:hi]`` in reverse order (vLLM's ``free_blocks(reversed(...))``):
        the request-unique part ``[max(lo, num_shared), hi)`` as one run, its first
        ``num_cached`` table entries cached; then the shareable part block by block. Null
        entries (sliding window) form a prefix and are skipped. Returns the position that
        table index 0 would have in the run (index i sits at ``returned - i``)."""
        while lo < hi and table[lo] == NULL:
            lo += 1
        u0 = lo if lo > num_shared else num_shared
        p = self._base + len(self._fq)
        if hi > u0:
            run = table[u0:hi]
            run.reverse()
            c = (num_cached if num_cached < hi else hi) - u0 if self.enable_caching else 0
            p = self._append_run(run, c)
        pos0 = p + hi - 1  # position of table index i (>= u0): pos0 - i
        for i in range((hi if hi < num_shared else num_shared) - 1, lo - 1, -1):
            b = table[i]
            if b != NULL:
                self._free_one(b)
        return pos0

    def revive(self, b: int) -> None:
        """Take a reference on an indexed block hit by a request (vLLM ``touch``)."""
        r = self._ref.get(b)
        if r is not None:
            self._ref[b] = r + 1
        else:
            self._take(self._pos.pop(b), False)
            self._ref[b] = 1

    def revive_own(self, pos: int) -> None:
        """Take a request's own surviving cached block at ``pos`` back (its own prefix hit)."""
        self._take(pos, True)

    def note_hits(self, ids) -> None:
        """Hook for pools that count prefix hits per block."""

    def cache_block(self, b: int, h: int) -> None:
        """Index a full block of shareable content (eager, at allocation)."""
        index = self.cached_block_hash_to_block
        self._hash[b] = h
        self._ref[b] = 1
        v = index.get(h)
        if v is None:
            index[h] = b
        elif type(v) is int:
            index[h] = {v: None, b: None}
        else:
            v[b] = None

    def check(self) -> None:
        """Internal consistency (tests)."""
        live = self.free_ids()
        assert len(live) == self._nfree, (len(live), self._nfree)
        assert len(set(live)) == len(live), "a block is free twice"
        assert NULL not in live
        for pos, cached in self._tombs.items():
            assert pos >= self._head and self._fq[pos - self._base] == _TOMB
            assert cached == self._in_cached_run(pos)
        assert sorted(self._tomb_heap) == sorted(self._tombs)
        for b, pos in self._pos.items():
            assert self._fq[pos - self._base] == b and pos >= self._head, b
            assert b in self._hash and b not in self._ref
        for b, r in self._ref.items():
            assert r >= 1 and b in self._hash and b not in self._pos, b
        assert not (set(self._ref) & set(live))
        assert set(self._pos) == set(live) & set(self._hash)
        prev = self._head
        for s, e in self._cr[self._cri:]:
            assert prev <= s < e <= self._base + len(self._fq), (s, e)
            prev = e
