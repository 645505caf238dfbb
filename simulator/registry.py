"""Plugin registries: scheduler policies, KV allocators and cluster routers, selected by name
in config.

Built-ins register on import; third-party packages add theirs through Python entry points
(groups ``servesim.schedulers``, ``servesim.kv_allocators`` and ``servesim.routers``) — no fork
needed::

    [project.entry-points."servesim.schedulers"]
    my_policy = "my_pkg.policies:MyScheduler"

A scheduler factory is called as ``factory(params: SchedulerParams, kv_cache_manager, **kw)``
and returns an object with the ``Scheduler`` interface (``add_request``, ``has_requests``,
``schedule``, ``update_from_output``, ``num_running``, ``num_waiting``, ``num_preemptions``).
A KV allocator factory is called as ``factory(num_gpu_blocks, block_size, enable_caching,
max_model_len)`` and returns a ``KVCacheManager``-like object. A router factory is called as
``factory(params: dict, rng: numpy.random.Generator)`` and returns an object with the
``simulator.cluster.routers.Router`` interface (``route(request, instances, now)``).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

from servesim.simulator.errors import ConfigError

SCHEDULERS: dict[str, Callable] = {}
KV_ALLOCATORS: dict[str, Callable] = {}
ROUTERS: dict[str, Callable] = {}

_GROUPS = {"servesim.schedulers": SCHEDULERS, "servesim.kv_allocators": KV_ALLOCATORS,
           "servesim.routers": ROUTERS}
_loaded: set[str] = set()


def register_scheduler(name: str, factory: Callable | None = None):
    """Register a scheduler policy factory under ``name`` (usable as a decorator)."""
    def deco(f):
        SCHEDULERS[name] = f
        return f
    return deco(factory) if factory is not None else deco


def register_kv_allocator(name: str, factory: Callable | None = None):
    """Register a KV allocator factory under ``name`` (usable as a decorator)."""
    def deco(f):
        KV_ALLOCATORS[name] = f
        return f
    return deco(factory) if factory is not None else deco


def register_router(name: str, factory: Callable | None = None):
    """Register a cluster router factory under ``name`` (usable as a decorator)."""
    def deco(f):
        ROUTERS[name] = f
        return f
    return deco(factory) if factory is not None else deco


def _load_builtins() -> None:
    import servesim.simulator.builtin_plugins  # noqa: F401  (registers fcfs, priority, paged)


def _load_entry_points(group: str) -> None:
    if group in _loaded:
        return
    _loaded.add(group)
    for ep in metadata.entry_points(group=group):
        if ep.name not in _GROUPS[group]:
            try:
                _GROUPS[group][ep.name] = ep.load()
            except Exception as e:  # noqa: BLE001  (report any plugin failure in one line)
                raise ConfigError(f"entry point {group}:{ep.name} failed to load: {e}") from None


def _get(group: str, name: str, key: str) -> Callable:
    _load_builtins()
    reg = _GROUPS[group]
    if name not in reg:
        _load_entry_points(group)
    if name not in reg:
        raise ConfigError(f"{key}: unknown name {name!r}; available: {', '.join(sorted(reg))}")
    return reg[name]


def get_scheduler(name: str) -> Callable:
    return _get("servesim.schedulers", name, "scheduler.policy")


def get_kv_allocator(name: str) -> Callable:
    return _get("servesim.kv_allocators", name, "cache.allocator")


def get_router(name: str, key: str = "cluster.router.policy") -> Callable:
    import servesim.simulator.cluster.routers  # noqa: F401  (registers the built-in routers)

    return _get("servesim.routers", name, key)


def available() -> dict[str, list[str]]:
    _load_builtins()
    import servesim.simulator.cluster.routers  # noqa: F401

    for g in _GROUPS:
        _load_entry_points(g)
    return {"schedulers": sorted(SCHEDULERS), "kv_allocators": sorted(KV_ALLOCATORS),
            "routers": sorted(ROUTERS)}
