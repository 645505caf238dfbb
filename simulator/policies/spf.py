"""``spf``: shortest-prompt-first admission with an aging bound (size-aware scheduling, as in
the SJF/SRPT family; BLIS ships an SJF policy).

Running requests are served exactly as vLLM V1 ``fcfs`` does (running first, chunked prefill,
budget clamps, FCFS preemption, decode-group fast path): only the *waiting* order changes.

Waiting order:

1. Requests put back at the front (preempted, or skipped when chunking is off) first, as vLLM.
2. Aged requests first, oldest first: a request is *aged* once ``aging_admissions`` requests
   have been admitted since it arrived (default ``AGING_ADMISSIONS`` = 256). So at most that
   many requests can overtake it: no starvation, whatever the traffic.
3. Otherwise the shortest prompt (``prompt_len``), ties by arrival.

The scheduler never sees time, so the aging clock counts admissions, not seconds.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable

from servesim.simulator.kv_cache import KVCacheManager
from servesim.simulator.request import Request
from servesim.simulator.scheduler import Scheduler, SchedulerParams

AGING_ADMISSIONS = 256


class SPFWaitingQueue:
    """Waiting queue: front list, then aged FIFO, then a min-heap on (prompt_len, index)."""

    def __init__(self, aging_admissions: int = AGING_ADMISSIONS):
        self.aging_admissions = aging_admissions
        self._front: deque[Request] = deque()
        self._heap: list[tuple[int, int, Request]] = []
        self._fifo: deque[tuple[int, Request]] = deque()
        self._live: set[int] = set()  # indices of requests in heap/fifo
        self.num_admissions = 0

    def __len__(self) -> int:
        return len(self._front) + len(self._live)

    def add_request(self, req: Request) -> None:
        self._live.add(req.index)
        heapq.heappush(self._heap, (req.prompt_len, req.index, req))
        self._fifo.append((self.num_admissions, req))

    def prepend_request(self, req: Request) -> None:
        self._front.appendleft(req)

    def prepend_requests(self, reqs: Iterable[Request]) -> None:
        for r in reversed(list(reqs)):
            self._front.appendleft(r)

    def peek_request(self) -> Request:
        if self._front:
            return self._front[0]
        fifo, live = self._fifo, self._live
        while fifo[0][1].index not in live:
            fifo.popleft()
        stamp, oldest = fifo[0]
        if self.num_admissions - stamp >= self.aging_admissions:
            return oldest
        heap = self._heap
        while heap[0][1] not in live:
            heapq.heappop(heap)
        return heap[0][2]

    def pop_request(self) -> Request:
        req = self.peek_request()
        if self._front and self._front[0] is req:
            self._front.popleft()
        else:
            self._live.discard(req.index)  # lazily dropped from heap and fifo
        self.num_admissions += 1
        return req


class SPFScheduler(Scheduler):
    """vLLM V1 running phase + shortest-prompt-first waiting queue with aging."""

    policy_name = "spf"

    def __init__(self, params: SchedulerParams, kv_cache_manager: KVCacheManager,
                 fast_path: bool = True, record_schedules: bool = False,
                 aging_admissions: int = AGING_ADMISSIONS):
        from dataclasses import replace

        super().__init__(replace(params, policy="fcfs"), kv_cache_manager, fast_path=fast_path,
                         record_schedules=record_schedules)
        self.params = replace(params, policy="spf")
        self.waiting = SPFWaitingQueue(aging_admissions)
