"""The CPU KV-offload tier (``cache.kv_offload``): vLLM 0.22's ``OffloadingConnector`` with the
CPU backend (``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py``,
``v1/kv_offload/cpu/{manager,policies/lru,policies/arc}.py``).

What is modelled, as vLLM does it:

- **Stores are write-through.** Every offloaded block (``block_size`` tokens, a multiple of the
  GPU block) is copied to CPU as soon as the GPU holds it in full
  (``_build_store_jobs``: each step, the newly full blocks of every scheduled request), not when
  the GPU evicts it. Blocks already in CPU are not stored again; when the CPU tier is full the
  policy evicts blocks no load is reading (``CPUOffloadingManager.prepare_store``). A stored
  block becomes readable when its device→host copy is done (``complete_store``); the copies
  queue on the instance's host link (one direction of PCIe per GPU).
- **Loads at admission.** For the head of the waiting queue, after the GPU prefix lookup, the
  connector counts the offloaded blocks that continue the GPU hit, from the first missing
  block on (``_maximal_prefix_lookup``, capped at the prompt; at least one offloaded block or
  nothing). If there are any, the scheduler allocates slots for GPU hit + CPU hit (the whole
  prompt must fit, ``full_sequence_must_fit``), the request leaves the queue
  (``WAITING_FOR_REMOTE_KVS``), the host→device copy runs, and the request returns to the
  queue head with those tokens computed (all of them: its last token is recomputed,
  ``_update_waiting_for_remote_kv``). The loaded blocks enter the GPU prefix cache only when
  they have arrived (``delay_cache_blocks``). Lookups touch the request's blocks (MRU).
- **Transfer time** = ``latency_us`` + bytes / bandwidth per GPU (the hardware's
  ``pcie_bw_gbps`` unless overridden), bytes = tokens × KV bytes per token per GPU (each TP
  rank copies its own shard in parallel); loads and stores each queue FIFO on their direction.
- **Hit rates per tier**: GPU hits in the engine's prefix-cache counters, CPU hits in
  ``cpu_prefix_cache_queries/hits`` (vLLM's ``connector_prefix_cache_stats``: queries = tokens
  the GPU missed, hits = tokens loaded from CPU).

Simplifications: a block whose store is still in flight counts as a miss (vLLM defers the
request a step); two requests needing the same CPU blocks both load them (vLLM delays the
second until the first has loaded, then it hits on GPU); copies do not slow the engine's steps
(vLLM runs them on separate CUDA streams).
"""

from __future__ import annotations

from collections import OrderedDict

from servesim.simulator.block_pool import NULL
from servesim.simulator.request import Request


class HostLink:
    """One direction of a host or network link: FIFO transfers, busy time for utilization."""

    def __init__(self, bandwidth_Bps: float, latency_s: float):
        self.bandwidth = bandwidth_Bps
        self.latency = latency_s
        self.free_at = 0.0
        self.busy_s = 0.0
        self.num_transfers = 0
        self.bytes = 0

    def transfer(self, now: float, nbytes: int, extra_s: float = 0.0) -> float:
        """Queue a copy of ``nbytes`` at ``now``; return its end time."""
        dur = self.latency + extra_s + nbytes / self.bandwidth
        start = now if now > self.free_at else self.free_at
        self.free_at = start + dur
        self.busy_s += dur
        self.num_transfers += 1
        self.bytes += nbytes
        return self.free_at


class LRUPolicy:
    """vLLM ``LRUCachePolicy``: insertion/touch order; evicts the oldest unreferenced."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[int, list] = OrderedDict()  # key -> [ready_at, ref_cnt]

    def get(self, key):
        return self.blocks.get(key)

    def insert(self, key, block) -> None:
        self.blocks[key] = block

    def touch(self, keys) -> None:
        blocks = self.blocks
        for key in reversed(keys):
            if key in blocks:
                blocks.move_to_end(key)

    def evict(self, n: int, protected: set) -> list | None:
        out = []
        for key, block in self.blocks.items():
            if block[1] == 0 and key not in protected:
                out.append(key)
                if len(out) == n:
                    break
        if len(out) < n:
            return None
        for key in out:
            del self.blocks[key]
        return out

    def __len__(self) -> int:
        return len(self.blocks)


class ARCPolicy:
    """vLLM ``ARCCachePolicy`` (Megiddo & Modha's adaptive replacement cache): T1 (seen once)
    and T2 (seen again) with ghost lists B1/B2 steering the target size of T1."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.t1: OrderedDict[int, list] = OrderedDict()
        self.t2: OrderedDict[int, list] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()
        self.target_t1 = 0.0

    def get(self, key):
        b = self.t1.get(key)
        return b if b is not None else self.t2.get(key)

    def insert(self, key, block) -> None:
        c = self.capacity
        if key in self.b1:  # ghost hit: recency is worth more
            self.target_t1 = min(c, self.target_t1 + max(1.0, len(self.b2) / max(len(self.b1), 1)))
            del self.b1[key]
            self.t2[key] = block
        elif key in self.b2:  # ghost hit: frequency is worth more
            self.target_t1 = max(0.0, self.target_t1 - max(1.0, len(self.b1) / max(len(self.b2), 1)))
            del self.b2[key]
            self.t2[key] = block
        else:
            self.t1[key] = block
        while len(self.b1) > c:
            self.b1.popitem(last=False)
        while len(self.b2) > c:
            self.b2.popitem(last=False)

    def touch(self, keys) -> None:
        for key in reversed(keys):
            b = self.t1.pop(key, None)
            if b is not None:
                self.t2[key] = b
            elif key in self.t2:
                self.t2.move_to_end(key)

    def evict(self, n: int, protected: set) -> list | None:
        out = []
        for _ in range(n):
            first, second = ((self.t1, self.b1), (self.t2, self.b2))
            if len(self.t1) < max(1.0, self.target_t1):
                first, second = second, first
            key = None
            for lst, ghost in (first, second):
                for k, b in lst.items():
                    if b[1] == 0 and k not in protected:
                        key = k
                        break
                if key is not None:
                    del lst[key]
                    ghost[key] = None
                    break
            if key is None:
                return None
            out.append(key)
        return out

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


class CPUTier:
    """vLLM ``CPUOffloadingManager``: ``num_blocks`` offloaded blocks keyed by block hash."""

    def __init__(self, num_blocks: int, policy: str = "lru"):
        self.num_blocks = num_blocks
        self.policy = ARCPolicy(num_blocks) if policy == "arc" else LRUPolicy(num_blocks)
        self.num_stored = 0
        self.num_evicted = 0

    def lookup(self, key, now: float) -> bool:
        b = self.policy.get(key)
        return b is not None and b[0] <= now

    def store(self, keys: list, ready_at: float) -> list:
        """``prepare_store``: the keys not yet stored get a block (evicting if needed);
        returns them (empty when nothing can be evicted, as vLLM skips the store)."""
        pol = self.policy
        new = [k for k in keys if pol.get(k) is None]
        if not new:
            return []
        if len(new) > self.num_blocks:
            new = new[-self.num_blocks:]
        over = len(pol) + len(new) - self.num_blocks
        if over > 0:
            evicted = pol.evict(over, set(keys))
            if evicted is None:
                return []
            self.num_evicted += len(evicted)
        for k in new:
            pol.insert(k, [ready_at, 0])
        self.num_stored += len(new)
        return new


class OffloadConnector:
    """The scheduler-side ``OffloadingConnector`` of one instance (see the module docstring).

    ``instance`` provides ``env`` (SimPy), ``replica`` (for ``requeue``), ``kv`` and
    ``kv_bytes_per_token`` (per GPU)."""

    def __init__(self, instance, cpu_bytes: int, policy: str, gpu_block_size: int,
                 offload_block_size: int | None, bandwidth_Bps: float, latency_s: float):
        self.inst = instance
        self.env = instance.env
        bs = gpu_block_size
        obs = offload_block_size or bs
        if obs % bs:
            from servesim.simulator.errors import ConfigError

            raise ConfigError(f"cache.kv_offload.block_size: {obs} is not a multiple of "
                              f"cache.block_size ({bs})")
        self.bs, self.obs, self.factor = bs, obs, obs // bs
        self.block_bytes = obs * instance.kv_bytes_per_token  # per GPU
        world = max(instance.gpus, 1)
        num_blocks = int(cpu_bytes) // max(self.block_bytes * world, 1)
        self.tier = CPUTier(num_blocks, policy)
        self.d2h = HostLink(bandwidth_Bps, latency_s)
        self.h2d = HostLink(bandwidth_Bps, latency_s)
        self.queries = 0  # vLLM connector_prefix_cache_stats, tokens
        self.hits = 0
        self.num_loads = 0
        self.load_seconds = 0.0
        self.loading = 0  # requests waiting for a load
        self._queried: set[int] = set()  # requests whose lookup was counted (once each)
        instance.kv.on_cache = self._on_blocks_full  # write-through hook

    # -- stores --------------------------------------------------------------------------------
    def _on_blocks_full(self, req: Request, num_cached_blocks: int, num_full_blocks: int):
        """GPU blocks [num_cached_blocks, num_full_blocks) of ``req`` were just cached (vLLM
        ``cache_full_blocks``, request-unique content included)."""
        f = self.factor
        first = -(-num_cached_blocks // f)  # offloaded blocks completed by this call
        last = num_full_blocks // f
        if last <= first:
            return
        block_hashes = req.ensure_block_hashes(num_full_blocks, self.bs, unique=True)
        table = req.block_ids
        keys = [block_hashes[i * f + f - 1] for i in range(first, last)
                if table[i * f + f - 1] != NULL]
        if not keys or not self.tier.num_blocks:
            return
        now = self.env.now
        pol = self.tier.policy
        new = [k for k in keys if pol.get(k) is None]
        if not new:
            return
        end = self.d2h.transfer(now, len(new) * self.block_bytes)
        self.tier.store(new, end)

    # -- loads ---------------------------------------------------------------------------------
    def start_load(self, sched, req: Request, hits, num_computed: int) -> bool | None:
        kv = self.inst.kv
        if not self.tier.num_blocks or not kv.enable_caching or kv.sliding_window:
            return None  # (sliding-window lookups, vLLM's _sliding_window_lookup: not modelled)
        obs, f = self.obs, self.factor
        n_off = req.num_tokens // obs
        start = num_computed // obs
        if n_off - start < 1:
            return None
        hashes = req.ensure_block_hashes(n_off * f, self.bs, unique=True)
        keys = [hashes[i * f + f - 1] for i in range(n_off)]
        now = self.env.now
        tier = self.tier
        n_hit = 0
        for i in range(start, n_off):
            if not tier.lookup(keys[i], now):
                break
            n_hit += 1
        tier.policy.touch(keys[:start + n_hit])
        ext = min(req.num_tokens, (start + n_hit) * obs) - num_computed
        if ext < obs:
            self._count(req, num_computed, 0)
            return None
        if not allocate_delayed(sched, req, ext, num_computed, hits):
            return False
        sched.waiting.pop_request()
        req.num_computed_tokens = num_computed + ext
        self._count(req, num_computed, ext)
        for k in keys[start:start + n_hit]:
            tier.policy.get(k)[1] += 1  # pinned while loading
        end = self.h2d.transfer(now, -(-ext // obs) * self.block_bytes)
        self.num_loads += 1
        self.load_seconds += end - now
        self.loading += 1
        pinned = keys[start:start + n_hit]
        self.env.timeout(end - now).callbacks.append(
            lambda _ev: self._loaded(sched, req, pinned))
        return True

    def _count(self, req: Request, num_computed: int, ext: int) -> None:
        """vLLM ``connector_prefix_cache_stats``: every request looked up once, queries =
        tokens the GPU missed, hits = tokens loaded from CPU."""
        if req.index in self._queried:
            return
        self._queried.add(req.index)
        self.queries += req.num_tokens - num_computed
        self.hits += ext

    def _loaded(self, sched, req: Request, pinned: list) -> None:
        for k in pinned:
            b = self.tier.policy.get(k)
            if b is not None:
                b[1] -= 1
        self.loading -= 1
        finish_load(self.inst, sched, req)

    def request_finished(self, req: Request) -> bool:
        self._queried.discard(req.index)
        return False


def allocate_delayed(sched, req: Request, ext: int, num_computed: int, hits) -> bool:
    """``allocate_slots`` for a request whose ``ext`` tokens after its ``num_computed`` local
    hits will arrive from outside, with ``delay_cache_blocks``: the new blocks do not enter
    the prefix cache before their content has arrived (:func:`finish_load` caches them)."""
    kv = sched.kv
    caching = kv.enable_caching
    kv.enable_caching = False
    try:
        new = kv.allocate_slots(req, ext, num_computed, hits, 0, sched.reserve_full_isl)
    finally:
        kv.enable_caching = caching
    if new is None:
        return False
    if hits and req.num_cached_blocks == 0:
        req.num_cached_blocks = len(hits)
    if req.num_cached_tokens < 0:  # vLLM PrefillStats: local + external cached tokens
        req.num_cached_tokens = num_computed + ext
    return True


def finish_load(inst, sched, req: Request) -> None:
    """``_update_waiting_for_remote_kv``: cache the arrived blocks, recompute the last token
    of a full hit, and put the request back at the head of the waiting queue."""
    kv = sched.kv
    kv.cache_blocks(req, req.num_computed_tokens)
    if req.num_computed_tokens >= req.num_tokens:
        req.num_computed_tokens = req.num_tokens - 1
    inst.replica.requeue(req)
