"""Reference KV-cache blocks: the block, the LRU free queue, the hash map and the pool."""

from __future__ import annotations

from .ref_request import Request

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
