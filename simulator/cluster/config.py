"""The ``cluster:`` section and ``cache.kv_offload`` (config keys documented in README "The
config", section "Clusters").

A cluster is a list of instance groups (each with optional ``model``/``hardware``/``parallel``/
``cache``/``scheduler``/``compilation`` overrides of the top-level sections and a replica
count), a router, and for prefill/decode disaggregation a decode router and a KV-transfer link.
``resolve_config`` resolves every group (vLLM's defaults for *its* hardware) and writes the
resolved sections back into the group, so ``config.resolved.yaml`` shows each instance's
engine arguments and a resolved config resolves to itself.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator
from servesim.costmodels.config import HardwareConfig, ModelConfig, parse_bytes

# Engines one simulation may hold (data-parallel ranks, or a cluster's instances): each is a
# scheduler and a block pool (~1 MB of simulator memory per 28k KV blocks).
MAX_ENGINES = 1024
# cache.kv_offload.cpu_bytes: at most 1 PiB (far above any host's memory)
MAX_CPU_BYTES = 1 << 50

class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class KVOffloadConfig(_Section):
    """``cache.kv_offload``: vLLM's ``OffloadingConnector`` with the CPU backend
    (``--kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": ..., "eviction_policy": ...}}'``)."""

    cpu_bytes: int = Field(description="CPU memory for offloaded KV blocks (vLLM "
                           "cpu_bytes_to_use), bytes or a string such as '8GiB'; at most 1PiB")
    policy: Literal["lru", "arc"] = Field("lru", description="vLLM eviction_policy")
    block_size: PositiveInt | None = Field(
        None, description="Offloaded block size in tokens, a multiple of cache.block_size "
        "(vLLM's kv_connector_extra_config block_size); default: cache.block_size")
    bandwidth_gbps: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="Host link per direction and GPU, GB/s; "
        "default: the hardware spec's pcie_bw_gbps")
    latency_us: float = Field(10.0, ge=0, allow_inf_nan=False,
                              description="Fixed cost per load/store job, us")

    @field_validator("cpu_bytes", mode="before")
    @classmethod
    def _bytes(cls, v):
        n = parse_bytes(v)
        if n > MAX_CPU_BYTES:
            raise ValueError(f"at most 1PiB ({MAX_CPU_BYTES} bytes) of CPU memory")
        return n


class RouterConfig(_Section):
    """A routing policy (registry name, entry point group ``servesim.routers``)."""

    policy: str = Field("least_load", description="round_robin | least_load | power_of_two | "
                        "random | session_affinity | prefix_aware | cache_aware | registered")
    decision_latency_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                                      description="Router time per request, s")
    params: dict[str, Any] = Field(default_factory=dict,
                                   description="Policy parameters (see simulator/cluster/"
                                   "routers.py)")


LINK_PRESETS: dict[str, dict[str, float]] = {
    # Per GPU and direction. Sources: NVIDIA H100 SXM datasheet (NVLink 4: 900 GB/s
    # bidirectional); NVIDIA ConnectX-7 (400 Gb/s NDR InfiniBand, one NIC per GPU as in DGX
    # H100); 100 GbE for TCP. Latencies and per-transfer overheads are priors (NIXL posts one
    # READ per transfer after the one-time handshake; UCX over TCP adds a software stack).
    "nvlink": {"bandwidth_gbps": 450.0, "latency_us": 3.0, "overhead_us": 20.0},
    "rdma": {"bandwidth_gbps": 50.0, "latency_us": 5.0, "overhead_us": 50.0},
    "tcp": {"bandwidth_gbps": 12.5, "latency_us": 50.0, "overhead_us": 200.0},
}


class KVTransferConfig(_Section):
    """The P→D KV link (vLLM ``NixlConnector``): a preset, any field overridable."""

    link: Literal["nvlink", "rdma", "tcp"] = "rdma"
    bandwidth_gbps: float | None = Field(None, gt=0, allow_inf_nan=False,
                                         description="Per GPU and direction, GB/s")
    latency_us: float | None = Field(None, ge=0, allow_inf_nan=False)
    overhead_us: float | None = Field(None, ge=0, allow_inf_nan=False,
                                      description="Fixed cost per transfer, us")

    def resolved(self) -> dict[str, float]:
        p = dict(LINK_PRESETS[self.link])
        for k in ("bandwidth_gbps", "latency_us", "overhead_us"):
            v = getattr(self, k)
            if v is not None:
                p[k] = float(v)
        return p


class InstanceGroup(_Section):
    """``cluster.instances[i]``: ``replicas`` identical vLLM instances."""

    name: str = Field(description="Instance folder prefix (instances/<name>-<i>/)")
    role: Literal["both", "prefill", "decode"] = Field(
        "both", description="both: aggregated serving; prefill/decode: disaggregated (NIXL)")
    replicas: PositiveInt = 1
    model: ModelConfig | None = None
    hardware: HardwareConfig | None = None
    parallel: dict[str, Any] | None = None
    cache: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    compilation: dict[str, Any] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v):
            raise ValueError("use letters, digits, '-', '_' or '.' (it names a folder)")
        return v


class ClusterConfig(_Section):
    """``cluster:`` — instance groups, the router, and for P/D the decode router and link."""

    name: str | None = Field(None, description="A label (plans name candidates after it)")
    instances: list[InstanceGroup] = Field(min_length=1)
    router: RouterConfig = RouterConfig()
    decode_router: RouterConfig = Field(
        default_factory=lambda: RouterConfig(policy="least_load"),
        description="P/D: picks the decode instance (llm-d's decode profile)")
    kv_transfer: KVTransferConfig = KVTransferConfig()

    @model_validator(mode="after")
    def _shape(self):
        names = [g.name for g in self.instances]
        if len(set(names)) != len(names):
            raise ValueError(f"instance group names must be unique, got {names}")
        roles = {g.role for g in self.instances}
        if ("prefill" in roles) != ("decode" in roles):
            raise ValueError("prefill/decode disaggregation needs at least one group with "
                             "role: prefill and one with role: decode")
        if "both" in roles and "prefill" in roles:
            raise ValueError("mixing role: both with prefill/decode groups is not supported")
        if self.num_instances > MAX_ENGINES:
            raise ValueError(f"{self.num_instances} instances in all: at most {MAX_ENGINES} "
                             "engines are simulated at once")
        return self

    @property
    def disaggregated(self) -> bool:
        return any(g.role == "prefill" for g in self.instances)

    @property
    def num_instances(self) -> int:
        return sum(g.replicas for g in self.instances)


SECTIONS = ("model", "hardware", "parallel", "cache", "scheduler", "compilation")


def group_tree(base: dict, group: InstanceGroup) -> dict:
    """The experiment config tree of one instance of ``group``: ``base`` (a config dump without
    ``cluster``) with the group's sections merged over it key by key (a group that names
    another model or GPU replaces that section); data_parallel_size 1 (replicas count)."""
    import copy

    tree = copy.deepcopy(base)
    for sec in SECTIONS:
        over = getattr(group, sec)
        if over is None:
            continue
        if isinstance(over, BaseModel):
            over = over.model_dump(mode="python", exclude_unset=True)
        cur = dict(tree.get(sec) or {})
        if sec in ("model", "hardware") and "name" in over and over["name"] != cur.get("name"):
            cur = {}
        cur.update(copy.deepcopy(over))
        tree[sec] = cur
    tree.setdefault("parallel", {})["data_parallel_size"] = 1
    tree.pop("cluster", None)
    return tree


def resolve_cluster(raw, resolved) -> None:
    """Resolve every group of ``raw.cluster`` (the unresolved config) and write the resolved
    sections into ``resolved.cluster``'s groups; check what all instances must share."""
    from servesim.simulator.config import omit_defaults, resolve_config, validate_tree
    from servesim.simulator.errors import ConfigError, ServesimError

    def resolve(tree: dict, where: str):
        try:
            return resolve_config(validate_tree(tree, where))
        except ServesimError as e:  # (a resolve-time error: say which group it is in)
            if str(e).startswith(where):
                raise
            raise type(e)(f"{where}: {e}") from None

    groups = raw.cluster.instances
    where = [f"cluster.instances[{i}] ({g.name})" for i, g in enumerate(groups)]
    if raw.parallel.data_parallel_size != 1:
        raise ConfigError(
            f"parallel.data_parallel_size: {raw.parallel.data_parallel_size} is not used in a "
            "cluster (each instance is one engine); set cluster.instances[i].replicas instead")
    for g, w in zip(groups, where):
        dp = (g.parallel or {}).get("data_parallel_size", 1)
        if dp != 1:
            raise ConfigError(
                f"{w}: parallel.data_parallel_size: {dp!r} is not used in a cluster (each "
                "instance is one engine); set the group's replicas instead")
    base = raw.dump_tree(mode="python")
    base.pop("cluster", None)
    trees = [group_tree(base, g) for g in groups]
    cfgs = [resolve(t, w) for t, w in zip(trees, where)]
    # Groups left at vLLM's default KV block size on different GPUs (an MLA model's backend
    # takes 32 on Blackwell, 64 on Hopper with fp8 KV, else 16) share the largest: every one
    # of those backends takes it (multiples of 16, or 32 and 64), and prefix ids are per block.
    unset = [(t.get("cache") or {}).get("block_size") is None for t in trees]
    sizes = {c.cache.block_size for c in cfgs}
    if len(sizes) > 1 and all(unset):
        for t in trees:
            t.setdefault("cache", {})["block_size"] = max(sizes)
        cfgs = [resolve(t, w) for t, w in zip(trees, where)]
    # vLLM P/D (NixlConnector) hands the prefill's KV cache to the decode instance as is:
    # both must run the same model
    pd = [(w, c.model.name) for g, w, c in zip(groups, where, cfgs) if g.role != "both"]
    for w, name in pd[1:]:
        if name != pd[0][1]:
            raise ConfigError(
                f"{w}: serves model {name} but {pd[0][0]} serves {pd[0][1]}: prefill and decode "
                "groups must serve the same model (the KV cache moves between them as is)")
    shared = None
    for i, (g_raw, g_res, cfg) in enumerate(zip(raw.cluster.instances,
                                                resolved.cluster.instances, cfgs)):
        key = (cfg.cache.block_size, cfg.model.max_model_len)
        if shared is None:
            shared = key
        elif key != shared:
            auto = "" if key[0] != shared[0] or raw.model.max_model_len != -1 else (
                f"; max_model_len auto fitted each group's KV cache: set it to at most "
                f"{min(key[1], shared[1])}")
            raise ConfigError(
                f"cluster.instances[{i}] ({g_raw.name}): cache.block_size and "
                f"model.max_model_len must be the same in every group (got {key}, first group "
                f"{shared}): request prefix ids are per block{auto}")
        g_res.model = ModelConfig.model_validate(cfg.model.model_dump(mode="python"))
        g_res.hardware = HardwareConfig.model_validate(cfg.hardware.model_dump(mode="python"))
        for sec in ("parallel", "cache", "scheduler", "compilation"):
            d = getattr(cfg, sec).model_dump(mode="python")
            if sec == "parallel":
                d.pop("data_parallel_size", None)
            omit_defaults(d, sec)  # (unused extension keys, as ExperimentConfig.dump_tree)
            setattr(g_res, sec, d)
