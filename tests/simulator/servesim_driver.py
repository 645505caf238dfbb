"""Drive the real servesim engine (``Replica`` under SimPy) on a reference workload and return
the same shape of result as ``reference.vllm_ref.simulate``: every non-empty batch as
(time scheduled, {request_id: tokens}, [preempted ids]), and per request its finish time,
outputs, preemptions and finish reason.

A workload is a list of :class:`reference.ref_request.RequestSpec`. Requests with ``eos_after``
map to ``ignore_eos=False`` (servesim then takes vLLM's API default ``max_tokens =
max_model_len - prompt_len``), the others to ``ignore_eos=True`` with ``output_len =
max_tokens``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import simpy
from servesim.simulator.engine import Replica
from servesim.simulator.kv_cache import KVCacheManager
from servesim.simulator.recorder import Recorder
from servesim.simulator.request import FINISHED_REASON, Request
from servesim.simulator.scheduler import Scheduler, SchedulerParams
from servesim.workloads.schema import RequestSpec as ServesimSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reference.ref_request import RequestSpec
from reference.ref_scheduler import Config
from reference.vllm_ref import Batch, RequestResult, Result


def servesim_spec(spec: RequestSpec, max_model_len: int) -> ServesimSpec:
    if spec.eos_after is None:
        output_len, ignore_eos = spec.max_tokens, True
    else:
        assert spec.max_tokens == max(max_model_len - len(spec.prompt_token_ids), 1)
        output_len, ignore_eos = spec.eos_after, False
    return ServesimSpec(arrival_s=spec.arrival_time, prompt_len=len(spec.prompt_token_ids),
                        output_len=output_len, request_id=spec.request_id,
                        prompt_token_ids=tuple(spec.prompt_token_ids), priority=spec.priority,
                        ignore_eos=ignore_eos)


def scheduler_params(cfg: Config) -> SchedulerParams:
    return SchedulerParams(
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len, block_size=cfg.block_size,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        enable_chunked_prefill=cfg.enable_chunked_prefill, policy=cfg.policy,
        reserve_full_isl=cfg.scheduler_reserve_full_isl, async_scheduling=cfg.async_scheduling)


def run_servesim(cfg: Config, specs: list[RequestSpec], *, fast_path: bool = True,
                 step_time: float = 1.0, max_time: float = 1e6) -> Result:
    env = simpy.Environment()
    kv = KVCacheManager(cfg.num_gpu_blocks, cfg.block_size, cfg.enable_prefix_caching,
                        cfg.max_model_len)
    pp = cfg.pipeline_parallel_size
    sched = Scheduler(scheduler_params(cfg), kv, fast_path=fast_path, record_schedules=True)
    results: dict[str, RequestResult] = {}
    order: list[str] = []

    def on_finish(req: Request) -> None:
        results[req.request_id] = RequestResult(req.finish_time, req.num_output_tokens,
                                                req.num_preemptions,
                                                FINISHED_REASON[req.status])
        order.append(req.request_id)

    replica = Replica(env, sched, lambda shape: step_time, Recorder(), on_finish,
                      max_concurrent_batches=pp, async_scheduling=cfg.async_scheduling)
    replica.trace = []

    ordered = sorted(specs, key=lambda s: s.arrival_time)

    def arrivals():
        for i, spec in enumerate(ordered):
            if spec.arrival_time > env.now:
                yield env.timeout(spec.arrival_time - env.now)
            sspec = servesim_spec(spec, cfg.max_model_len)
            replica.add_request(Request(sspec, i, cfg.max_model_len, env.now))

    env.process(arrivals())
    env.run(until=max_time)
    batches = [Batch(t, dict(d), list(p)) for t, d, p in replica.trace]
    return Result(batches, results, order)
