"""Reference KV-cache manager: prefix-cache lookup, slot allocation, caching and freeing."""

from __future__ import annotations

from .ref_block_pool import BlockPool, KVCacheBlock
from .ref_request import Request

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
