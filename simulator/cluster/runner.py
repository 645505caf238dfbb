"""A cluster run: one SimPy environment with the benchmark client, the router (the proxy /
gateway) and every vLLM instance, each a :class:`~servesim.simulator.engine.Replica` with its
own scheduler, KV cache, cost model and connectors.

The client is ``client.Client`` (``vllm bench serve``: arrivals, max_concurrency, sessions,
rejections) with ``_send`` replaced: it asks the router for an instance (after
``decision_latency_s``) or, disaggregated, drives the P/D proxy flow of :mod:`.disagg`.
Results: the client's view (``result.json``, ``requests.csv``), one run folder per instance
(``instances/<name>-<i>/``: that engine's requests, steps and counters), ``routing.csv`` (where
each request went, P/D transfer times) and cluster extras in ``result.json`` (per-instance
load, per-tier hit rates, router distribution, link utilization).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import simpy
from servesim.costmodels.power import sustained_clock
from servesim.simulator.client import Client
from servesim.simulator.cluster.config import ClusterConfig, InstanceGroup, RouterConfig, group_tree
from servesim.simulator.cluster.disagg import (
    DecodeConnector,
    KVLink,
    MultiConnector,
    PDRecord,
    PrefillConnector,
)
from servesim.simulator.cluster.offload import OffloadConnector
from servesim.simulator.engine import Replica
from servesim.simulator.errors import ConfigError
from servesim.simulator.metrics import (
    STEP_COLUMNS,
    Distribution,
    LazyRequests,
    RequestLog,
    RunResult,
    derive_request_columns,
)
from servesim.simulator.recorder import Recorder
from servesim.simulator.request import FINISHED_REASON, Request, RequestStatus
from servesim.workloads.schema import RequestSpec


class TeeDistribution(Distribution):
    """An instance's ITL samples, also added to the cluster's distribution."""

    def __init__(self, also: Distribution):
        super().__init__()
        self.also = also

    def add(self, values, counts=None, group: int = 0) -> None:
        super().add(values, counts, group)
        self.also.add(values, counts, group)


class InstanceRecorder(Recorder):
    """A Recorder whose request rows are numbered in the order they end on this instance
    (``RequestLog`` wants indices 0..n-1); ``request_id`` keeps the client's id."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.num_rows = 0

    def record_request(self, r: Request, reason: str) -> None:
        idx = r.index
        r.index = self.num_rows
        self.num_rows += 1
        try:
            super().record_request(r, reason)
        finally:
            r.index = idx


class ClusterReplica(Replica):
    """A Replica whose connectors can put a request back at the head of its queue."""

    def requeue(self, req: Request) -> None:
        self.scheduler.waiting.prepend_request(req)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()


class Instance:
    """One vLLM instance of the cluster, as routers and connectors see it."""

    def __init__(self, env, index: int, group: InstanceGroup, local: int, cfg, mem, cost,
                 sched, rec: InstanceRecorder, on_finish: Callable, batches: int,
                 async_sched: bool):
        self.env = env
        self.index = index
        self.group = group.name
        self.role = group.role
        self.name = f"{group.name}-{local}"
        self.cfg = cfg
        self.mem = mem
        self.scheduler = sched
        self.kv = sched.kv
        self.rec = rec
        par = cfg.parallel
        self.gpus = par.tensor_parallel_size * par.pipeline_parallel_size
        self.kv_bytes_per_token = int(mem.kv_bytes_per_token)
        self.in_flight = 0
        self.num_routed = 0
        self.connectors: list = []
        self._on_finish = on_finish
        self.clock = sustained_clock(cost, lambda: env._now)  # (None: burst times)
        clock = self.clock
        self.replica = ClusterReplica(env, sched, clock.step_seconds if clock
                                      else cost.step_seconds, rec, self._finished, index,
                                      max_concurrent_batches=batches,
                                      async_scheduling=async_sched,
                                      decode_seconds=clock.decode_seconds if clock
                                      else cost.decode_step_seconds,
                                      undo_step=clock.undo if clock else None)

    # -- what routers read ---------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """vLLM's waiting gauge: the queue plus requests waiting for remote/CPU KV."""
        return self.scheduler.num_waiting + sum(getattr(c, "loading", 0)
                                                for c in self.connectors)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def kv_usage(self) -> float:
        return self.kv.block_pool.get_usage()

    def cached_prefix_blocks(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` in this instance's GPU prefix cache (llm-d's precise
        view, fed by vLLM's KV events)."""
        if not self.kv.enable_caching:
            return 0
        index = self.kv.block_pool.cached_block_hash_to_block
        n = 0
        for h in hashes:
            if h not in index:
                break
            n += 1
        return n

    # -- plumbing ------------------------------------------------------------------------------
    def connector_of(self, cls):
        for c in self.connectors:
            if isinstance(c, cls):
                return c
        return None

    def attach(self, connector) -> None:
        self.connectors.append(connector)
        self.scheduler.connector = (self.connectors[0] if len(self.connectors) == 1
                                    else MultiConnector(self.connectors))

    def add_request(self, req: Request) -> None:
        self.replica.add_request(req)

    def _finished(self, req: Request) -> None:
        self.rec.record_request(req, FINISHED_REASON.get(req.status, "in_flight"))
        self._on_finish(self, req)


class ClusterClient(Client):
    """``vllm bench serve`` in front of a router: ``client.Client`` with routing and P/D."""

    def __init__(self, env, specs, instances: list[Instance], recorder, *, router,
                 decode_router, link: KVLink | None, decision_latency_s: float,
                 decode_latency_s: float, **kw):
        super().__init__(env, specs, [i.replica for i in instances], recorder, **kw)
        self.instances = instances
        self.router = router
        self.decode_router = decode_router
        self.link = link
        self.latency = decision_latency_s
        self.decode_latency = decode_latency_s
        self.pd = link is not None
        self.front = [i for i in instances if i.role in ("both", "prefill")]
        self.decoders = [i for i in instances if i.role == "decode"]
        self.pd_records: dict[int, PDRecord] = {}
        self.route_log: list[tuple[str, str]] = []  # aggregated: (request id, instance)
        self.num_prefill_reqs = 0
        for inst in instances:
            inst._on_finish = self.instance_finished

    def _send(self, spec: RequestSpec) -> None:
        env = self.env
        req = Request(spec, spec.extra["_index"], self.max_model_len, env.now)
        self.num_sent += 1
        if self._refused(req):
            return
        self.in_flight += 1
        self._live[req.index] = req
        cands = self.front
        inst = cands[self.router.route(req, cands, env.now)]
        inst.in_flight += 1
        inst.num_routed += 1
        if self.pd:
            preq = Request(spec, req.index, self.max_model_len, env.now)
            preq.max_tokens, preq.eos_after = 1, None  # the proxy's max_tokens=1
            self.pd_records[req.index] = PDRecord(req, inst, preq)
            inst.connector_of(PrefillConnector).remote_decode.add(req.index)
            self._dispatch(inst, preq, self.latency)
        else:
            self.route_log.append((req.request_id, inst.name))
            self._dispatch(inst, req, self.latency)

    def _dispatch(self, inst: Instance, req: Request, delay: float) -> None:
        if delay > 0:
            ev = self.env.timeout(delay)
            ev.callbacks.append(lambda _ev: self._arrive(inst, req))
        else:
            inst.add_request(req)

    def _arrive(self, inst: Instance, req: Request) -> None:
        now = self.env.now
        req.arrival_time = now  # when the engine received it
        if self.pd:  # the proxy's own requests: the instance's latencies start here (the
            req.send_time = now  # client's request keeps its send time: TTFT includes routing)
        inst.add_request(req)

    def instance_finished(self, inst: Instance, req: Request) -> None:
        inst.in_flight -= 1
        if inst.role == "decode":
            self.decode_router.on_finish(req, inst)
        else:
            self.router.on_finish(req, inst)
        if not self.pd:
            self.on_finish(req)
            return
        rec = self.pd_records[req.index]
        if inst.role == "prefill":
            rec.prefill_end = self.env.now
            if req.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED):
                self._close(rec, req)
                return
            cands = self.decoders
            dinst = cands[self.decode_router.route(rec.client, cands, self.env.now)]
            dinst.in_flight += 1
            dinst.num_routed += 1
            rec.decode = dinst
            dreq = Request(rec.client.spec, req.index, self.max_model_len, self.env.now)
            rec.decode_req = dreq
            dinst.connector_of(DecodeConnector).pending[req.index] = rec
            self._dispatch(dinst, dreq, self.decode_latency)
            return
        self._close(rec, req)

    def _close(self, rec: PDRecord, last: Request) -> None:
        """The client's request ends with ``last`` (the decode request, or a prefill request
        that did not finish normally)."""
        c, p = rec.client, rec.prefill_req
        c.num_cached_tokens = p.num_cached_tokens
        c.first_scheduled_time = p.first_scheduled_time
        c.num_preemptions = p.num_preemptions + (last.num_preemptions if last is not p else 0)
        if last is p:
            c.status, c.error, c.finish_time = p.status, p.error, p.finish_time
        else:
            c.first_token_time = last.first_token_time
            c.last_token_time = last.last_token_time
            c.finish_time = last.finish_time
            c.num_output_tokens = last.num_output_tokens
            c.num_tokens = last.num_tokens
            c.status, c.error = last.status, last.error
        self.on_finish(c)


def _groups(cfg) -> tuple[ClusterConfig, list[tuple[InstanceGroup, object]]]:
    """(cluster config, [(group, resolved instance config)]). Without ``cluster:`` (a single
    engine with ``cache.kv_offload``): one group of ``data_parallel_size`` replicas behind
    vLLM's DP load balancer."""
    from servesim.simulator.config import (
        check_cluster_engine_features,
        cluster_engine,
        validate_tree,
    )

    cl = cfg.cluster
    if cl is None:  # (vLLM's balancer runs in each of the API servers; a dense model's DP
        # ranks publish no counts, see client.LB_IDLE_PUBLISH_S)
        from servesim.costmodels.specs import load_model_spec
        from servesim.simulator.client import LB_IDLE_PUBLISH_S, LB_REFRESH_S

        g = InstanceGroup(name="engine", replicas=cfg.parallel.data_parallel_size)
        servers = cfg.frontend.api_server_count or cfg.parallel.data_parallel_size
        moe = load_model_spec(cfg.model).is_moe
        cl = ClusterConfig(instances=[g], router=RouterConfig(
            policy="least_load", params={
                "api_servers": servers, "engine_stats": moe,
                "refresh_s": LB_REFRESH_S if moe else LB_IDLE_PUBLISH_S}))
    base = cfg.dump_tree(mode="python")
    base.pop("cluster", None)
    out = []
    engine = cluster_engine(cfg)
    for i, g in enumerate(cl.instances):
        icfg = validate_tree(group_tree(base, g), f"cluster.instances[{i}] ({g.name})")
        check_cluster_engine_features(icfg, engine)  # (a group may set them itself)
        out.append((g, icfg))
    return cl, out


def run_cluster(cfg, *, progress: Callable[[int, int | None], None] | None = None,
                fast_path: bool = True, spool_dir: str | None = None) -> RunResult:
    """Simulate a resolved config that has ``cluster:`` (or ``cache.kv_offload``)."""
    from servesim.costmodels import build_cost_model, load_hardware_spec, plan_memory
    from servesim.simulator.progress import phase
    from servesim.simulator.registry import get_kv_allocator, get_router, get_scheduler
    from servesim.simulator.runner import StepSampler
    from servesim.simulator.scheduler import SchedulerParams
    from servesim.workloads import build_workload

    t0 = time.perf_counter()
    if cfg.frontend.enable:
        import warnings

        warnings.warn("cluster runs model the router and each instance's engine but not yet "
                      "the instances' API-server frontends: client-side TTFT and E2E leave out "
                      "their terms (frontend.enable applies to single-engine runs)", stacklevel=2)
    cl, groups = _groups(cfg)
    router_factory = get_router(cl.router.policy)
    decode_factory = (get_router(cl.decode_router.policy, "cluster.decode_router.policy")
                      if cl.disaggregated else None)
    icfg0 = groups[0][1]
    block_size = icfg0.cache.block_size
    mml = icfg0.model.max_model_len
    workload = build_workload(cfg.workload, block_size=block_size, max_model_len=mml)
    from servesim.simulator.runner import _client_control

    if _client_control(cfg, workload.meta) is not None:
        raise ConfigError("cluster: load stages, warm-up and client timeouts (workload.stages, "
                          "workload.warmup, client.*) are not modelled for cluster runs yet; "
                          "run them on a single engine")
    seed = int(getattr(cfg.workload, "seed", 0) or 0)

    env = simpy.Environment()
    itl = Distribution()
    rec = Recorder(log=RequestLog(spool_dir), itl=itl, steps=None)
    link = None
    if cl.disaggregated:
        p = cl.kv_transfer.resolved()
        link = KVLink(p["bandwidth_gbps"], p["latency_us"], p["overhead_us"], cl.kv_transfer.link)
    instances: list[Instance] = []
    plans = []
    for g, icfg in groups:
        pp = icfg.parallel.pipeline_parallel_size
        async_sched = bool(icfg.scheduler.async_scheduling)
        batches = pp
        if pp > 1 and icfg.scheduler.policy not in ("fcfs", "priority"):
            batches = 1
        sched_factory = get_scheduler(icfg.scheduler.policy)
        kv_factory = get_kv_allocator(icfg.cache.allocator)
        mem = plan_memory(icfg)
        cost = build_cost_model(icfg)
        plans.append((g, icfg, mem))
        params = SchedulerParams(
            max_num_seqs=icfg.scheduler.max_num_seqs,
            max_num_batched_tokens=icfg.scheduler.max_num_batched_tokens,
            max_model_len=mml, block_size=block_size,
            long_prefill_token_threshold=icfg.scheduler.long_prefill_token_threshold,
            enable_chunked_prefill=icfg.scheduler.enable_chunked_prefill,
            policy=icfg.scheduler.policy, reserve_full_isl=icfg.scheduler.reserve_full_isl,
            async_scheduling=async_sched)
        window = cost.spec.sliding_window
        window = window if window and window < mml else None
        off = icfg.cache.kv_offload
        hw = load_hardware_spec(icfg.hardware) if off is not None else None
        for local in range(g.replicas):
            kv = kv_factory(mem.num_gpu_blocks, block_size, icfg.cache.enable_prefix_caching, mml)
            if window and hasattr(kv, "set_sliding_window"):
                kv.set_sliding_window(window, icfg.scheduler.max_num_batched_tokens)
            try:
                sched = sched_factory(params, kv, fast_path=fast_path and batches == 1
                                      and not window)
            except TypeError:
                sched = sched_factory(params, kv)
            irec = InstanceRecorder(log=RequestLog(spool_dir), itl=TeeDistribution(itl),
                                    steps=StepSampler(cfg.output.timeseries_interval_s))
            inst = Instance(env, len(instances), g, local, icfg, mem, cost, sched, irec,
                            lambda i, r: None, batches, async_sched)
            if g.role == "prefill":
                inst.attach(PrefillConnector(inst))
            elif g.role == "decode":
                inst.attach(DecodeConnector(inst, link))
            if off is not None:
                bw = (off.bandwidth_gbps or hw.pcie_bw_gbps) * 1e9
                inst.attach(OffloadConnector(inst, off.cpu_bytes, off.policy, block_size,
                                             off.block_size, bw, off.latency_us * 1e-6))
            instances.append(inst)

    rng = np.random.default_rng([seed, 0x726F75746572])  # "router"
    router = router_factory(dict(cl.router.params), rng)
    decode_router = decode_factory(dict(cl.decode_router.params), rng) if decode_factory else None
    for r in (router, decode_router):
        if r is not None and hasattr(type(r), "block_size"):
            r.block_size = block_size
    total = workload.meta.get("num_prompts")
    min_blocks = min(m.num_gpu_blocks for _, _, m in plans)
    per_req = max(m.blocks_per_request for _, _, m in plans)
    with phase("simulating", total) as tick:
        if progress is None:
            cb = tick
        else:
            def cb(n: int) -> None:
                tick(n)
                progress(n, total)
        client = ClusterClient(
            env, workload, instances, rec, router=router, decode_router=decode_router,
            link=link, decision_latency_s=cl.router.decision_latency_s,
            decode_latency_s=cl.decode_router.decision_latency_s, max_model_len=mml,
            num_gpu_blocks=min_blocks, block_size=block_size, max_request_blocks=per_req,
            max_concurrency=cfg.workload.max_concurrency, on_progress=cb, park_after=None)
        from servesim.simulator.runner import _quiet_gc

        with _quiet_gc():
            env.run()
        client.finalize()
    wall = time.perf_counter() - t0
    return _assemble(cfg, cl, plans, instances, client, rec, itl, link, workload, env, wall)


def _instance_result(inst: Instance, env) -> RunResult:
    r = inst.rec
    r.flush()
    log = r.log
    requests = LazyRequests(log) if log.spilled else derive_request_columns(log.all_rows())
    if r.itl.exact:
        iv, ic, stream = *r.itl.exact_sample(), None
    else:
        iv, ic, stream = np.zeros(0), np.zeros(0, np.int64), r.itl
    kv, sched = inst.kv, inst.scheduler
    st = kv.prefix_cache_stats
    counters = {
        "num_steps": inst.replica.num_steps, "num_preemptions": sched.num_preemptions,
        "prefix_cache_queries": st.queries, "prefix_cache_hits": st.hits,
        "prefix_cache_preempted_queries": st.preempted_queries,
        "prefix_cache_preempted_hits": st.preempted_hits,
        "num_evictions": kv.block_pool.num_evictions, "num_gpu_blocks": inst.mem.num_gpu_blocks,
        "num_replicas": 1, "sim_seconds": float(env.now),
        "gpu_busy_seconds": inst.replica.busy_seconds, "wall_seconds": 0.0,
    }
    if inst.clock is not None:  # the power cap's slowdown charged (costmodels.power)
        counters["power_cap_seconds"] = inst.clock.extra_seconds
    extras = {"instance": inst.name, "role": inst.role, "requests_routed": inst.num_routed}
    extras.update(_tier_extras([inst]))
    meta = {"num_prompts": inst.num_routed, "dataset_name": inst.name}
    return RunResult(config=inst.cfg, requests=requests, itl_values=iv, itl_counts=ic,
                     steps=r.steps.columns(), token_steps=r.steps.token_steps(),
                     counters=counters, workload_meta=meta,
                     capacity=inst.mem.as_dict(), request_log=log if log.spilled else None,
                     itl_stream=stream, extras=extras)


def _tier_extras(instances: list[Instance]) -> dict:
    offs = [c for i in instances for c in i.connectors if isinstance(c, OffloadConnector)]
    if not offs:
        return {}
    q = sum(c.queries for c in offs)
    h = sum(c.hits for c in offs)
    loads = sum(c.num_loads for c in offs)
    return {
        "cpu_prefix_cache_hit_rate": h / q if q else None,
        "cpu_prefix_cache_queries": q, "cpu_prefix_cache_hits": h,
        "cpu_offload_blocks": sum(c.tier.num_blocks for c in offs),
        "cpu_offload_loads": loads,
        "cpu_offload_mean_load_ms": (sum(c.load_seconds for c in offs) / loads * 1e3
                                     if loads else None),
        "cpu_offload_stored_blocks": sum(c.tier.num_stored for c in offs),
        "cpu_offload_evicted_blocks": sum(c.tier.num_evicted for c in offs),
    }


def _assemble(cfg, cl, plans, instances, client, rec, itl, link, workload, env, wall):
    subs = [(inst.name, _instance_result(inst, env)) for inst in instances]
    rec.flush()
    log = rec.log
    requests = LazyRequests(log) if log.spilled else derive_request_columns(log.all_rows())
    if itl.exact:
        iv, ic, stream = *itl.exact_sample(), None
    else:
        iv, ic, stream = np.zeros(0), np.zeros(0, np.int64), itl
    # the cluster timeseries: every instance's rows, by time, with an ``instance`` column
    cols = []
    for k, (_, sub) in enumerate(subs):
        c = dict(sub.steps)
        c["instance"] = np.full(len(c["time_s"]), k, dtype=np.int64)
        cols.append(c)
    steps = {k: np.concatenate([c[k] for c in cols]) for k in (*STEP_COLUMNS, "instance")}
    order = np.argsort(steps["time_s"], kind="stable")
    steps = {k: v[order] for k, v in steps.items()}
    token_steps = None  # every instance's steps, when its rows are sampled
    if all(sub.token_steps is not None for _, sub in subs):
        token_steps = [c for _, sub in subs for c in sub.token_steps]
    kvs = [i.kv for i in instances]
    counters = {
        "num_steps": sum(i.replica.num_steps for i in instances),
        "num_preemptions": sum(i.scheduler.num_preemptions for i in instances),
        "prefix_cache_queries": sum(k.prefix_cache_stats.queries for k in kvs),
        "prefix_cache_hits": sum(k.prefix_cache_stats.hits for k in kvs),
        "prefix_cache_preempted_queries": sum(k.prefix_cache_stats.preempted_queries
                                              for k in kvs),
        "prefix_cache_preempted_hits": sum(k.prefix_cache_stats.preempted_hits for k in kvs),
        "num_evictions": sum(k.block_pool.num_evictions for k in kvs),
        "num_gpu_blocks": sum(i.mem.num_gpu_blocks for i in instances),
        "num_replicas": len(instances),
        "sim_seconds": float(env.now),
        "gpu_busy_seconds": sum(i.replica.busy_seconds for i in instances),
        "wall_seconds": wall,
    }
    if any(i.clock is not None for i in instances):
        counters["power_cap_seconds"] = sum(i.clock.extra_seconds for i in instances
                                            if i.clock is not None)
    sim_s = float(env.now) or math.nan
    hw = sorted({i.cfg.hardware.name for i in instances})
    per_inst = []
    for (name, sub), inst in zip(subs, instances):
        s = sub.steps
        usage = np.asarray(s.get("vllm:kv_cache_usage_perc", ()), dtype=float)
        st = inst.kv.prefix_cache_stats
        row = {"name": name, "group": inst.group, "role": inst.role, "gpu": inst.cfg.hardware.name,
               "gpus": inst.gpus, "requests_routed": inst.num_routed,
               "num_gpu_blocks": inst.mem.num_gpu_blocks,
               "num_preemptions": inst.scheduler.num_preemptions,
               "prefix_cache_hit_rate": st.hits / st.queries if st.queries else None,
               "gpu_busy_frac": inst.replica.busy_seconds / sim_s if sim_s else None,
               "mean_kv_cache_usage_perc": float(usage.mean()) if len(usage) else None,
               "max_kv_cache_usage_perc": float(usage.max()) if len(usage) else None}
        row.update(_tier_extras([inst]))
        per_inst.append(row)
    extras = {
        "gpu": hw[0] if len(hw) == 1 else "+".join(hw),
        "num_gpus": sum(i.gpus for i in instances),
        "data_parallel_size": len(instances),
        "cluster_router": cl.router.policy,
        "cluster_instances": per_inst,
    }
    extras.update(_tier_extras(instances))
    files = {}
    if cl.disaggregated:
        extras["cluster_decode_router"] = cl.decode_router.policy
        extras.update(_pd_extras(client, link, instances, sim_s))
        files["routing.csv"] = _routing_csv_pd(client)
    elif cfg.cluster is not None:
        files["routing.csv"] = _routing_csv(client)
    meta = dict(workload.meta)
    return RunResult(config=cfg, requests=requests, itl_values=iv, itl_counts=ic, steps=steps,
                     token_steps=token_steps, counters=counters, workload_meta=meta,
                     capacity=plans[0][2].as_dict(),
                     request_log=log if log.spilled else None, itl_stream=stream,
                     instances=subs if cfg.cluster is not None else [], extras=extras,
                     files=files)


def _pd_extras(client: ClusterClient, link: KVLink, instances, sim_s: float) -> dict:
    recs = [r for r in client.pd_records.values() if r.xfer_end == r.xfer_end]
    xfer = np.array([r.xfer_end - r.xfer_start for r in recs]) if recs else np.zeros(0)
    wait = np.array([r.xfer_start - r.xfer_wait_from for r in recs]) if recs else np.zeros(0)
    util = {}
    for inst in instances:
        nic = link.nics.get(inst.index)
        if nic is not None:
            util[inst.name] = nic.busy_s / sim_s if sim_s else None
    p = {"kind": link.kind, "bandwidth_gbps": link.bandwidth / 1e9,
         "latency_us": link.latency * 1e6, "overhead_us": link.overhead * 1e6}
    return {
        "kv_transfer_link": p,
        "kv_transfers": len(recs),
        "kv_transfer_bytes_per_gpu": sum(n.bytes for n in link.nics.values()) // 2,
        "mean_kv_transfer_ms": float(xfer.mean() * 1e3) if len(xfer) else None,
        "p99_kv_transfer_ms": float(np.percentile(xfer, 99) * 1e3) if len(xfer) else None,
        "mean_kv_transfer_queue_ms": float(wait.mean() * 1e3) if len(wait) else None,
        "kv_link_utilization": util,
    }


def _csv(header: list[str], rows: list[list]) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    for r in rows:
        w.writerow(["" if (isinstance(v, float) and not math.isfinite(v)) else
                    (repr(v) if isinstance(v, float) else v) for v in r])
    return buf.getvalue()


def _routing_csv(client: ClusterClient) -> str:
    return _csv(["request_id", "instance"], [list(r) for r in client.route_log])


def _routing_csv_pd(client: ClusterClient) -> str:
    rows = []
    for idx in sorted(client.pd_records):
        r = client.pd_records[idx]
        rows.append([r.client.request_id, r.prefill.name, r.decode.name if r.decode else "",
                     r.prefill_end, r.xfer_start, r.xfer_end,
                     r.xfer_end - r.xfer_start, r.xfer_tokens,
                     r.decode_req.first_scheduled_time if r.decode_req else math.nan])
    return _csv(["request_id", "prefill_instance", "decode_instance", "prefill_end_s",
                 "kv_transfer_start_s", "kv_transfer_end_s", "kv_transfer_s",
                 "kv_transfer_tokens", "decode_first_scheduled_s"], rows)

