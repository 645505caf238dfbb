"""An independent, plainly written reference of vLLM 0.22.1's V1 scheduling, for differential
testing of ``servesim.simulator``.

Written from vLLM's source (``/tmp/src/vllm-0.22.1``), function by function, keeping vLLM's
names; it imports nothing from servesim and shares no code with it. Speed is no concern here:
every structure is the obvious one (a linked free list like vLLM's, dicts, lists, a heap).

This module is the entry point: the engine loop (``Engine``, ``simulate``) and its results.
The parts it drives live beside it, one per vLLM file or pair of files: ``ref_request.py``
(request.py, sched/utils.py), ``ref_request_queue.py``, ``ref_block_pool.py``
(kv_cache_utils.py, block_pool.py), ``ref_kv_cache_manager.py`` and ``ref_scheduler.py``.

What it models (one full-attention KV-cache group, no spec decode, no connectors, no LoRA, no
multimodal, no structured output)::

    vllm/v1/request.py                Request (counters, block hashes, __lt__)
    vllm/v1/core/sched/utils.py       check_stop (EOS first, then max_model_len / max_tokens)
    vllm/v1/core/kv_cache_utils.py    KVCacheBlock, FreeKVCacheBlockQueue, block hash chain
    vllm/v1/core/block_pool.py        BlockHashToBlockMap, BlockPool
    vllm/v1/core/single_type_kv_cache_manager.py + kv_cache_coordinator.py
                                      FullAttentionManager (unitary coordinator)
    vllm/v1/core/kv_cache_manager.py  KVCacheManager (get_computed_blocks, allocate_slots with
                                      full_sequence_must_fit, free, cache_blocks)
    vllm/v1/core/sched/request_queue.py   FCFS deque / PRIORITY heap
    vllm/v1/core/sched/scheduler.py   Scheduler.schedule, _preempt_request,
                                      _update_after_schedule, update_from_output
    vllm/v1/core/sched/async_scheduler.py AsyncScheduler (output placeholders)
    vllm/v1/engine/core.py            EngineCore.step / step_with_batch_queue, the busy loop
    vllm/v1/executor/*                max_concurrent_batches (2 for async, pp for PP)

Time (not vLLM's, the simulator's model): every non-empty batch takes ``step_time`` seconds of
latency and holds the GPU for ``step_time / pipeline_parallel_size`` (so PP stages overlap);
batches run back to back in the order they were scheduled; host time is zero. A request is
seen by the first ``schedule()`` call at or after its arrival time (the engine processes its
input queue before every step). The model emits a token for a scheduled request iff the
scheduler did not consider that row a partial prefill (``not request.is_prefill_chunk``); the
``eos_after``-th output token is EOS.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .ref_request import FINISH_REASON, BlockHasher, Request, RequestSpec
from .ref_scheduler import EMPTY_BATCH_TAKES_A_SLOT, Config, Scheduler, SchedulerOutput

# --------------------------------------------------------------------------------------------
# Engine loop (vllm/v1/engine/core.py) with simulated time


class Stall(RuntimeError):
    """The engine has requests but can never schedule them (and no arrival is pending)."""


@dataclass
class Batch:
    time_scheduled: float
    num_scheduled_tokens: dict[str, int]
    preempted: list[str]


@dataclass
class RequestResult:
    finish_time: float
    num_output_tokens: int
    num_preemptions: int
    finish_reason: str


@dataclass
class Result:
    batches: list[Batch]
    requests: dict[str, RequestResult]
    finish_order: list[str]
    events: set[str] = field(default_factory=set)


@dataclass
class _InFlight:
    out: SchedulerOutput
    done: float
    time_scheduled: float


class Engine:
    """``EngineCore``: ``step`` (sync) or ``step_with_batch_queue`` (async or PP)."""

    def __init__(self, config: Config, step_time: float = 1.0, max_steps: int = 100_000,
                 queue_empty_batches: bool = True):
        """``queue_empty_batches``: vLLM 0.22.1 puts an empty ``SchedulerOutput`` into the
        batch queue too (``step_with_batch_queue`` appends whatever ``schedule()`` returned),
        where it holds a slot until the batches before it return. ``False`` is NOT vLLM: it
        drops empty batches (re-scheduling at once after a preemption), only to let tests
        look past that known difference."""
        self.config = config
        self.queue_empty_batches = queue_empty_batches
        self.step_time = step_time
        self.max_steps = max_steps
        self.scheduler = Scheduler(config)
        self.hasher = BlockHasher(config.block_size) if config.enable_prefix_caching else None
        pp = config.pipeline_parallel_size
        # Executors' max_concurrent_batches: pp with PP, else 2 with async scheduling, else 1.
        self.batch_queue_size = pp if pp > 1 else (2 if config.async_scheduling else 1)
        self.batch_queue: deque[_InFlight] | None = (
            deque() if self.batch_queue_size > 1 else None)
        self.occupancy = step_time / pp  # a batch holds the GPU (first stage) this long
        self.now = 0.0
        self.gpu_free = 0.0
        self.batches: list[Batch] = []
        self.finish_order: list[str] = []
        self.all_requests: dict[str, Request] = {}
        self._pending: deque[RequestSpec] = deque()

    # -- time
    def _launch(self, out: SchedulerOutput) -> float:
        """Put a batch on the GPU; return when its result is ready."""
        if out.total_num_scheduled_tokens == 0:
            return self.now
        start = max(self.now, self.gpu_free)
        self.gpu_free = start + self.occupancy
        self.batches.append(Batch(self.now, dict(out.num_scheduled_tokens),
                                  list(out.preempted_req_ids)))
        return start + self.step_time

    def _process_input_queue(self) -> None:
        while self._pending and self._pending[0].arrival_time <= self.now:
            spec = self._pending.popleft()
            req = Request(spec, self.hasher)
            self.all_requests[req.request_id] = req
            self.scheduler.add_request(req)

    def _has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def _finish(self, finished: list[Request]) -> None:
        for r in finished:
            r.finish_time = self.now
            self.finish_order.append(r.request_id)

    def _idle_until_arrival(self) -> None:
        if not self._pending:
            s = self.scheduler
            if not (s.running or s.waiting):
                return  # nothing left: the loop ends
            raise Stall(f"stalled at t={self.now}: {self.scheduler.running} "
                        f"waiting={list(self.scheduler.waiting)}")
        self.now = max(self.now, self._pending[0].arrival_time)

    # -- EngineCore.step
    def step(self) -> None:
        if not self.scheduler.has_requests():
            return
        out = self.scheduler.schedule()
        done = self._launch(out)
        self.now = done
        self._finish(self.scheduler.update_from_output(out))
        if out.total_num_scheduled_tokens == 0 and not out.preempted_req_ids:
            # vLLM would spin on the same empty step until an input arrives.
            self._idle_until_arrival()

    # -- EngineCore.step_with_batch_queue
    def step_with_batch_queue(self) -> None:
        q = self.batch_queue
        assert len(q) < self.batch_queue_size
        was_empty = not q
        if self.scheduler.has_requests():
            out = self.scheduler.schedule()
            model_executed = out.total_num_scheduled_tokens > 0
            if not model_executed and not self.queue_empty_batches:
                if q:
                    b = q.pop()
                    self.now = max(self.now, b.done)
                    self._finish(self.scheduler.update_from_output(b.out))
                elif not out.preempted_req_ids:
                    self._idle_until_arrival()
                return
            done = self._launch(out)
            if not model_executed and len(q) >= 2:
                self.scheduler.events.add(EMPTY_BATCH_TAKES_A_SLOT)
            if not model_executed:
                # An empty batch still takes a queue slot; its (empty) result comes back after
                # the batches before it.
                done = max([done] + [b.done for b in q])
            q.appendleft(_InFlight(out, done, self.now))
            if model_executed and len(q) < self.batch_queue_size and not q[-1].done <= self.now:
                return  # don't block while the queue has room
            if not model_executed and was_empty and not out.preempted_req_ids:
                q.pop()
                self._idle_until_arrival()
                return
        elif not q:
            return
        b = q.pop()
        self.now = max(self.now, b.done)
        self._finish(self.scheduler.update_from_output(b.out))

    # -- the busy loop
    def run(self, specs: list[RequestSpec]) -> Result:
        self._pending = deque(sorted(specs, key=lambda s: s.arrival_time))
        steps = 0
        while self._pending or self._has_work():
            self._process_input_queue()
            if not self._has_work():
                self.now = self._pending[0].arrival_time
                continue
            if self.batch_queue is None:
                self.step()
            else:
                self.step_with_batch_queue()
            steps += 1
            if steps > self.max_steps:
                raise Stall(f"no end after {steps} steps")
        reqs = {
            rid: RequestResult(r.finish_time, r.num_output_tokens, r.num_preemptions,
                               FINISH_REASON[r.status])
            for rid, r in self.all_requests.items()
        }
        return Result(self.batches, reqs, self.finish_order, set(self.scheduler.events))


def simulate(config: Config, specs: list[RequestSpec], step_time: float = 1.0,
             **engine_kw) -> Result:
    return Engine(config, step_time, **engine_kw).run(specs)
