"""Cluster routers: which instance serves a request.

A router is a plugin (``registry.register_router``, entry point group ``servesim.routers``):
``factory(params: dict, rng: numpy.random.Generator)`` returns an object with
``route(request, instances, now) -> int`` (an index into ``instances``) and, optionally,
``on_finish(request, instance)``. ``instances`` are :class:`~.runner.Instance` objects; what a
router may read of them is what a real router sees: ``in_flight`` (requests it sent and that
have not returned: vllm-router's ``worker.load()``), ``num_waiting`` / ``num_running`` /
``kv_usage`` (the engine's Prometheus gauges, as scraped), ``cached_prefix_blocks(request)``
(the engine's GPU prefix cache, as llm-d's KV-event index sees it) and ``index``.

Built in (sources in each docstring): ``round_robin``, ``random``, ``least_load`` (vLLM's DP
load balancer), ``power_of_two`` (vllm-router), ``session_affinity`` (vLLM production-stack
session router), ``prefix_aware`` (llm-d inference scheduler: prefix-cache scorer blended with
load scorers) and ``cache_aware`` (vllm-router's cache-aware policy). Deterministic: randomness
comes from the seeded ``rng`` the runner derives from the workload seed.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from typing import Any, ClassVar

from servesim.simulator.client import dp_pick, lb_next_publish
from servesim.simulator.cluster.config import MAX_ENGINES
from servesim.simulator.errors import ConfigError
from servesim.simulator.registry import register_router
from servesim.simulator.request import Request, stable_int


class Router:
    """Base class: parameter parsing (unknown keys are an error; numbers finite and within
    ``RANGES``: param → (lowest, highest), both allowed) and the hooks."""

    name = "router"
    PARAMS: ClassVar[dict[str, Any]] = {}
    RANGES: ClassVar[dict[str, tuple[float, float]]] = {}

    def __init__(self, params: dict | None = None, rng=None):
        import numpy as np

        params = dict(params or {})
        unknown = sorted(set(params) - set(self.PARAMS))
        if unknown:
            raise ConfigError(f"router {self.name}: unknown parameter(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(self.PARAMS)) or 'none'}")
        for k, default in self.PARAMS.items():
            v = params.get(k, default)
            if isinstance(default, float) and isinstance(v, int) and not isinstance(v, bool):
                v = float(v) if abs(v) < 1 << 1000 else math.inf if v > 0 else -math.inf
            if default is not None and (not isinstance(v, type(default)) or (
                    isinstance(v, bool) and not isinstance(default, bool))):
                raise ConfigError(f"router {self.name}: {k}: expected "
                                  f"{type(default).__name__}, got {v!r}")
            if k in self.RANGES:
                lo, hi = self.RANGES[k]
                if not lo <= v <= hi or v in (math.inf, -math.inf):  # (NaN fails lo <= v)
                    what = "an integer" if isinstance(default, int) else "a finite number"
                    span = f">= {lo:g}" if hi == math.inf else f"from {lo:g} to {hi:g}"
                    raise ConfigError(f"router {self.name}: {k}: expected {what} {span}, "
                                      f"got {v!r}")
            setattr(self, k, v)
        self.rng = rng if rng is not None else np.random.default_rng(0)

    def route(self, req: Request, instances: list, now: float) -> int:
        raise NotImplementedError

    def on_finish(self, req: Request, instance) -> None:
        """The request routed to ``instance`` has returned (finished, or prefill done)."""


@register_router("round_robin")
class RoundRobinRouter(Router):
    """Instances in turn (vLLM production-stack ``RoundRobinRouter``; the P/D toy proxy's
    ``itertools.cycle`` over prefill and decode clients)."""

    name = "round_robin"

    def __init__(self, params=None, rng=None):
        super().__init__(params, rng)
        self._next = 0

    def route(self, req, instances, now):
        i = self._next % len(instances)
        self._next += 1
        return i


@register_router("random")
class RandomRouter(Router):
    """Uniformly at random (vllm-router ``random``)."""

    name = "random"

    def route(self, req, instances, now):
        return int(self.rng.integers(len(instances)))


@register_router("least_load")
class LeastLoadRouter(Router):
    """vLLM's data-parallel load balancer (``DPLBAsyncMPClient.get_core_engine_for_request``,
    :func:`~servesim.simulator.client.dp_pick`, as ``client.Client._route``): the counts the
    DP coordinator published last (every ``refresh_s``, vLLM's 100 ms), one table per API
    server (``api_servers``, taking requests in turn; 1 for a router in front of instances).
    ``engine_stats: false`` is vLLM 0.22.1's balancer over a dense model's DP ranks, which
    publish no counts: the tables reset to zeros at multiples of ``refresh_s`` (the
    coordinator's 5 s republish) and only the local increments steer the picks.
    """

    name = "least_load"
    PARAMS: ClassVar[dict[str, Any]] = {"refresh_s": 0.1, "api_servers": 1,
                                        "engine_stats": True}
    RANGES: ClassVar[dict[str, tuple[float, float]]] = {"refresh_s": (0, math.inf)}

    def __init__(self, params=None, rng=None):
        super().__init__(params, rng)
        if not isinstance(self.api_servers, int) or not 1 <= self.api_servers <= MAX_ENGINES:
            raise ConfigError("cluster router least_load: params.api_servers must be an "
                              f"integer from 1 to {MAX_ENGINES} (got {self.api_servers!r})")
        self._tables: list[dict[int, list[int]]] = [{} for _ in range(self.api_servers)]
        self._next = 0.0
        self._turn = 0

    def route(self, req, instances, now):
        tables = self._tables
        if now >= self._next or any(inst.index not in tables[0] for inst in instances):
            live, r = self.engine_stats, self.refresh_s
            for counts in tables:
                for inst in instances:
                    counts[inst.index] = [inst.num_waiting, inst.num_running] if live else [0, 0]
            self._next = lb_next_publish(now, live, r)
        server = self._turn
        self._turn = (server + 1) % len(tables)
        rows = [tables[server][inst.index] for inst in instances]
        return dp_pick(rows, server, len(tables))


@register_router("power_of_two")
class PowerOfTwoRouter(Router):
    """Two distinct instances at random, the one with fewer requests in flight (ties: the
    first drawn) — vllm-router ``power_of_two`` (``worker.load()`` = requests in flight)."""

    name = "power_of_two"

    def route(self, req, instances, now):
        n = len(instances)
        if n == 1:
            return 0
        a = int(self.rng.integers(n))
        b = int(self.rng.integers(n - 1))
        b = b + 1 if b >= a else b
        return a if instances[a].in_flight <= instances[b].in_flight else b


@register_router("session_affinity")
class SessionAffinityRouter(Router):
    """Multi-turn sessions stick to one instance: vLLM production-stack ``SessionRouter`` —
    a consistent-hash ring over the instances keyed by the session id (``virtual_nodes``
    points per instance); requests without a session go to the instance with the fewest
    requests in flight (production-stack falls back to QPS-based routing)."""

    name = "session_affinity"
    PARAMS: ClassVar[dict[str, Any]] = {"virtual_nodes": 100}
    # (the ring holds virtual_nodes points per instance)
    RANGES: ClassVar[dict[str, tuple[float, float]]] = {"virtual_nodes": (1, 10_000)}

    def __init__(self, params=None, rng=None):
        super().__init__(params, rng)
        self._rings: dict[tuple, tuple[list[int], list[int]]] = {}

    def _ring(self, instances) -> tuple[list[int], list[int]]:
        key = tuple(inst.index for inst in instances)
        ring = self._rings.get(key)
        if ring is None:
            points = sorted((stable_int(f"{inst.name}#{v}"), i)
                            for i, inst in enumerate(instances)
                            for v in range(self.virtual_nodes))
            ring = self._rings[key] = ([p for p, _ in points], [i for _, i in points])
        return ring

    def route(self, req, instances, now):
        sid = req.spec.session_id
        if sid is None:
            return min(range(len(instances)), key=lambda i: instances[i].in_flight)
        hashes, owners = self._ring(instances)
        k = bisect.bisect(hashes, stable_int(str(sid))) % len(hashes)
        return owners[k]


class ApproxPrefixIndex:
    """The router's own record of which prompt blocks it sent where (an LRU of block hashes
    per instance, ``capacity`` blocks each): llm-d's approximate prefix-cache scorer (GIE
    ``prefix`` plugin, ``lruCapacityPerServer``) and vllm-router's approximate radix tree.
    It never sees evictions in the engine, so it can be stale."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._lru: dict[int, OrderedDict] = {}

    def match(self, hashes: list[int], inst_index: int) -> int:
        lru = self._lru.get(inst_index)
        if not lru:
            return 0
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def insert(self, hashes: list[int], inst_index: int) -> None:
        lru = self._lru.setdefault(inst_index, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)


def prompt_block_hashes(req: Request, block_size: int) -> list[int]:
    """Hashes of the request's full prompt blocks that another request can share (the rest
    are unique to it and can never be a prefix hit elsewhere)."""
    n = min(req.prompt_len // block_size, req.num_shared_blocks(block_size))
    if n <= 0:
        return []
    return req.ensure_block_hashes(n, block_size)[:n]


@register_router("prefix_aware")
class PrefixAwareRouter(Router):
    """llm-d's inference scheduler (the Gateway API Inference Extension endpoint picker):
    every instance gets a weighted sum of scorer values in [0, 1], the highest total wins
    (ties at random, GIE's ``max-score-picker``):

    - ``prefix``: the fraction of the prompt's blocks found, from the first block on, in the
      instance's prefix cache (``prefix-cache-scorer``). ``cache_view: exact`` reads the
      engine's GPU cache (llm-d's precise scorer fed by vLLM KV events); ``approximate``
      (default, GIE's ``prefix`` plugin) reads the router's own LRU of the blocks it routed
      to each instance (``lru_capacity_per_server`` blocks), which does not see evictions.
    - ``queue``: the waiting queue, min-max normalised over the candidates
      ((max − q)/(max − min), 1 when all are equal: GIE ``queue-scorer``), or with
      ``queue_scorer: linear``, 1 − min(q, queue_threshold)/queue_threshold.
    - ``kv``: 1 − KV-cache usage (``kv-cache-utilization-scorer``).

    Gauges are the values scraped every ``metrics_refresh_s`` (GIE's 50 ms). Default weights
    prefix 3, queue 2, kv 2 as llm-d's inference-scheduling guide configures the EPP. A
    request whose prefix sits on instance k goes there unless k's load scores lose more than
    ``w_prefix · (its prefix score − the others')``: that difference is the blend threshold.
    """

    name = "prefix_aware"
    PARAMS: ClassVar[dict[str, Any]] = {"prefix_weight": 3.0, "queue_weight": 2.0, "kv_weight": 2.0,
              "active_weight": 2.0,
              "cache_view": "approximate", "lru_capacity_per_server": 31250,
              "queue_scorer": "minmax", "queue_threshold": 128, "metrics_refresh_s": 0.05}
    RANGES: ClassVar[dict[str, tuple[float, float]]] = {
        "prefix_weight": (0, math.inf), "queue_weight": (0, math.inf),
        "kv_weight": (0, math.inf), "active_weight": (0, math.inf),
        "lru_capacity_per_server": (1, math.inf), "queue_threshold": (1, math.inf),
        "metrics_refresh_s": (0, math.inf)}
    block_size = 16  # the engines' block size (set by the cluster runner)

    def __init__(self, params=None, rng=None):
        super().__init__(params, rng)
        if self.cache_view not in ("exact", "approximate"):
            raise ConfigError(f"router {self.name}: cache_view: expected exact or approximate, "
                              f"got {self.cache_view!r}")
        if self.queue_scorer not in ("minmax", "linear"):
            raise ConfigError(f"router {self.name}: queue_scorer: expected minmax or linear, "
                              f"got {self.queue_scorer!r}")
        self.index = ApproxPrefixIndex(self.lru_capacity_per_server)
        self._gauges: dict[int, tuple[int, float]] = {}
        self._next = 0.0
        self.last_scores: list[float] = []

    def _scrape(self, instances, now) -> None:
        if now >= self._next or any(inst.index not in self._gauges for inst in instances):
            for inst in instances:
                self._gauges[inst.index] = (inst.num_waiting, inst.kv_usage)
            self._next = now + self.metrics_refresh_s

    def prefix_scores(self, req, instances) -> list[float]:
        hashes = prompt_block_hashes(req, self.block_size)
        total = max(req.prompt_len // self.block_size, 1)
        if not hashes:
            return [0.0] * len(instances)
        if self.cache_view == "exact":
            return [inst.cached_prefix_blocks(hashes) / total for inst in instances]
        return [self.index.match(hashes, inst.index) / total for inst in instances]

    def route(self, req, instances, now):
        self._scrape(instances, now)
        prefix = self.prefix_scores(req, instances)
        queues = [self._gauges[inst.index][0] for inst in instances]
        if self.queue_scorer == "minmax":
            lo, hi = min(queues), max(queues)
            qs = [1.0 if hi == lo else (hi - q) / (hi - lo) for q in queues]
        else:
            thr = max(self.queue_threshold, 1)
            qs = [1.0 - min(q, thr) / thr for q in queues]
        act = [inst.in_flight for inst in instances]
        lo, hi = min(act), max(act)
        acts = [1.0 if hi == lo else (hi - a) / (hi - lo) for a in act]
        scores = [self.prefix_weight * p + self.queue_weight * q + self.active_weight * a
                  + self.kv_weight * (1.0 - self._gauges[inst.index][1])
                  for p, q, a, inst in zip(prefix, qs, acts, instances)]
        self.last_scores = scores
        best = max(scores)
        tied = [i for i, s in enumerate(scores) if s >= best - 1e-12]
        pick = tied[0] if len(tied) == 1 else tied[int(self.rng.integers(len(tied)))]
        if self.cache_view == "approximate":
            self.index.insert(prompt_block_hashes(req, self.block_size), instances[pick].index)
        return pick


@register_router("cache_aware")
class CacheAwareRouter(Router):
    """vllm-router's ``cache_aware`` policy (``src/policies/cache_aware.rs``): when the
    instances are *imbalanced* — (max − min) in-flight requests > ``balance_abs_threshold``
    and max > ``balance_rel_threshold`` · min — the one with the fewest requests in flight;
    otherwise the instance with the highest prefix match rate if that rate exceeds
    ``cache_threshold``, else the least loaded. The match rate comes from the router's
    approximate index of what it routed where (its radix tree), in blocks here (characters
    there); ``cache_view: exact`` reads the engines' caches instead. Defaults are
    vllm-router's (0.5, 32, 1.1)."""

    name = "cache_aware"
    PARAMS: ClassVar[dict[str, Any]] = {"cache_threshold": 0.5, "balance_abs_threshold": 32,
              "balance_rel_threshold": 1.1, "cache_view": "approximate",
              "max_tree_blocks": 1 << 20}
    RANGES: ClassVar[dict[str, tuple[float, float]]] = {
        "cache_threshold": (0, 1), "balance_abs_threshold": (0, math.inf),
        "balance_rel_threshold": (0, math.inf), "max_tree_blocks": (1, math.inf)}
    block_size = 16  # the engines' block size (set by the cluster runner)

    def __init__(self, params=None, rng=None):
        super().__init__(params, rng)
        self.index = ApproxPrefixIndex(self.max_tree_blocks)

    def route(self, req, instances, now):
        loads = [inst.in_flight for inst in instances]
        lo, hi = min(loads), max(loads)
        least = loads.index(lo)
        hashes = prompt_block_hashes(req, self.block_size)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            pick = least
        else:
            total = max(req.prompt_len // self.block_size, 1)
            if self.cache_view == "exact":
                rates = [inst.cached_prefix_blocks(hashes) / total for inst in instances]
            else:
                rates = [self.index.match(hashes, inst.index) / total for inst in instances]
            best = max(rates)
            if best > self.cache_threshold:
                cands = [i for i, r in enumerate(rates) if r == best]
                pick = min(cands, key=lambda i: loads[i])
            else:
                pick = least
        self.index.insert(hashes, instances[pick].index)
        return pick
