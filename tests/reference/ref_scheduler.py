"""Reference scheduler: vLLM's ``Scheduler`` / ``AsyncScheduler`` and their config."""

from __future__ import annotations

from dataclasses import dataclass, field

from .ref_kv_cache_manager import KVCacheManager
from .ref_request import EOS, PREEMPTED, RUNNING, Request, check_stop
from .ref_request_queue import FCFSRequestQueue, PriorityRequestQueue

# Events (Scheduler.events / Result.events): rules that fired, for tests that track them.
VICTIM_SKIPPED_BEFORE_INDEX = "priority victim before req_index, not scheduled this step"
TOKEN_TO_PREEMPTED_NOT_CACHED = "async: a token came back to a preempted request (not cached)"
EMPTY_BATCH_TAKES_A_SLOT = "an empty batch took a batch-queue slot behind two or more"
FREED_NOT_IN_RUNNING_ORDER = "requests stopping together freed in row order != admission order"


# --------------------------------------------------------------------------------------------
# Scheduler (vllm/v1/core/sched/scheduler.py, async_scheduler.py)

@dataclass
class Config:
    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    policy: str = "fcfs"  # or "priority"
    scheduler_reserve_full_isl: bool = True
    async_scheduling: bool = False
    pipeline_parallel_size: int = 1


@dataclass
class SchedulerOutput:
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: list[str]  # in preemption order (vLLM keeps a set)
    sampled: set[str] = field(default_factory=set)  # rows the model samples a token for


class Scheduler:
    def __init__(self, config: Config):
        self.config = config
        self.async_scheduling = config.async_scheduling
        self.priority = config.policy == "priority"
        self.max_num_running_reqs = config.max_num_seqs
        self.max_num_scheduled_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.kv_cache_manager = KVCacheManager(config.num_gpu_blocks, config.block_size,
                                               config.max_model_len,
                                               config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting = PriorityRequestQueue() if self.priority else FCFSRequestQueue()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        # Rules that fired and that tests may want to know about (not vLLM state).
        self.events: set[str] = set()
        self._num_admitted = 0

    # -- queue management
    def add_request(self, request: Request) -> None:
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def has_requests(self) -> bool:
        return bool(len(self.waiting) + len(self.running)) or bool(self.finished_req_ids)

    # -- schedule()
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv_cache_manager
        scheduled_running_reqs: list[Request] = []
        preempted_reqs: list[Request] = []
        num_scheduled_tokens: dict[str, int] = {}
        token_budget = self.max_num_scheduled_tokens

        # First, the RUNNING requests, in order.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if (request.num_output_placeholders > 0
                    and request.num_computed_tokens + 2 - request.num_output_placeholders
                    >= request.num_prompt_tokens + request.max_tokens):
                # Async: the step in flight already reaches max_tokens.
                req_index += 1
                continue
            num_new_tokens = (request.num_tokens_with_spec + request.num_output_placeholders
                              - request.num_computed_tokens)
            if 0 < cfg.long_prefill_token_threshold < num_new_tokens:
                num_new_tokens = cfg.long_prefill_token_threshold
            num_new_tokens = min(num_new_tokens, token_budget)
            num_new_tokens = min(num_new_tokens,
                                 self.max_model_len - 1 - request.num_computed_tokens)
            assert num_new_tokens >= 0, request
            if num_new_tokens == 0:
                # PP with the prompt already scheduled, or async at max_model_len.
                req_index += 1
                continue

            while True:
                new_blocks = kv.allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                if self.priority:
                    preempted_req = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                    if (preempted_req not in scheduled_running_reqs
                            and self.running.index(preempted_req) < req_index):
                        # vLLM moves req_index back only for a victim it scheduled this step,
                        # so the request after this one is passed over.
                        self.events.add(VICTIM_SKIPPED_BEFORE_INDEX)
                    self.running.remove(preempted_req)
                    if preempted_req in scheduled_running_reqs:
                        scheduled_running_reqs.remove(preempted_req)
                        token_budget += num_scheduled_tokens.pop(preempted_req.request_id)
                        req_index -= 1
                else:
                    preempted_req = self.running.pop()
                self._preempt_request(preempted_req)
                preempted_reqs.append(preempted_req)
                if preempted_req is request:
                    break
            if new_blocks is None:
                break

            scheduled_running_reqs.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # Next, the WAITING requests, only if nothing was preempted.
        if not preempted_reqs:
            while self.waiting and token_budget > 0:
                if len(self.running) == self.max_num_running_reqs:
                    break
                request = self.waiting.peek_request()
                if request.num_computed_tokens == 0:
                    new_computed_blocks, num_new_local_computed_tokens = (
                        kv.get_computed_blocks(request))
                    num_computed_tokens = num_new_local_computed_tokens
                else:
                    new_computed_blocks, num_new_local_computed_tokens = [], 0
                    num_computed_tokens = request.num_computed_tokens

                num_new_tokens = request.num_tokens - num_computed_tokens
                threshold = cfg.long_prefill_token_threshold
                if 0 < threshold < num_new_tokens:
                    num_new_tokens = threshold
                if not cfg.enable_chunked_prefill and num_new_tokens > token_budget:
                    break  # head-of-line: the head does not fit this step
                num_new_tokens = min(num_new_tokens, token_budget)
                assert num_new_tokens > 0

                new_blocks = kv.allocate_slots(
                    request, num_new_tokens,
                    num_new_computed_tokens=num_new_local_computed_tokens,
                    new_computed_blocks=new_computed_blocks,
                    full_sequence_must_fit=cfg.scheduler_reserve_full_isl)
                if new_blocks is None:
                    break

                request = self.waiting.pop_request()
                self.running.append(request)
                request.admitted_seq = self._num_admitted  # (test bookkeeping)
                self._num_admitted += 1
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
                request.status = RUNNING
                request.num_computed_tokens = num_computed_tokens

        total = sum(num_scheduled_tokens.values())
        assert total <= self.max_num_scheduled_tokens
        assert token_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs
        out = SchedulerOutput(num_scheduled_tokens=num_scheduled_tokens,
                              total_num_scheduled_tokens=total,
                              preempted_req_ids=[r.request_id for r in preempted_reqs])
        self._update_after_schedule(out)
        return out

    def _preempt_request(self, request: Request) -> None:
        assert request.status == RUNNING
        self.kv_cache_manager.free(request)
        request.status = PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.waiting.prepend_request(request)

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            request.is_prefill_chunk = request.num_computed_tokens < (
                request.num_tokens + request.num_output_placeholders)
            if not request.is_prefill_chunk:
                out.sampled.add(req_id)
        if self.async_scheduling:
            # AsyncScheduler._update_after_schedule: one output placeholder per sampling row.
            for req_id in out.num_scheduled_tokens:
                request = self.requests[req_id]
                if request.is_prefill_chunk:
                    continue
                request.num_output_placeholders += 1
        self.finished_req_ids = set()

    # -- update_from_output()
    def update_from_output(self, out: SchedulerOutput) -> list[Request]:
        """Apply one executed batch; return the requests that finished."""
        stopped_running: list[Request] = []
        stopped_preempted: list[Request] = []
        finished: list[Request] = []
        for req_id in out.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue  # finished while this batch was in flight
            if req_id not in out.sampled:
                continue  # partial prefill: no token
            status_before_stop = request.status
            token = EOS if request.num_output_tokens + 1 == request.eos_after else (
                "out", req_id, request.num_output_tokens)
            stopped = self._update_request_with_output(request, token)
            if stopped:
                self._free_request(request)
                finished.append(request)
                if status_before_stop == RUNNING:
                    stopped_running.append(request)
                else:
                    stopped_preempted.append(request)
        if len(finished) > 1 and finished != sorted(finished, key=lambda r: r.admitted_seq):
            # Freed in this batch's row order, which is not the order of their last
            # admissions (one was preempted and re-admitted while this batch was in flight).
            self.events.add(FREED_NOT_IN_RUNNING_ORDER)
        if stopped_running:
            self.running = [r for r in self.running if r not in stopped_running]
        if stopped_preempted:
            self.waiting.remove_requests(stopped_preempted)
        return finished

    def _update_request_with_output(self, request: Request, token) -> bool:
        status_before_update = request.status
        request.append_output_token_ids(token)
        stopped = check_stop(request, self.max_model_len)
        if self.async_scheduling:
            # AsyncScheduler._update_request_with_output
            request.num_output_placeholders -= 1
            assert request.num_output_placeholders >= 0, request
            if status_before_update != RUNNING and self.kv_cache_manager.enable_caching:
                self.events.add(TOKEN_TO_PREEMPTED_NOT_CACHED)
            if status_before_update == RUNNING:
                self.kv_cache_manager.cache_blocks(
                    request, request.num_computed_tokens - request.num_output_placeholders)
        return stopped

    def _free_request(self, request: Request) -> None:
        self.finished_req_ids.add(request.request_id)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
