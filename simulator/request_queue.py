"""The scheduler's waiting queue (vLLM ``v1/core/sched/request_queue.py``): FCFS and
PRIORITY orders."""

from __future__ import annotations

import heapq
from collections import deque

from servesim.simulator.request import Request


class _FCFSQueue(deque):
    """FCFS waiting queue: a deque (victims are prepended); ``len`` and membership in C."""

    add_request = deque.append
    prepend_request = deque.appendleft
    pop_request = deque.popleft

    def peek_request(self) -> Request:
        return self[0]


class _PriorityQueue:
    """PRIORITY waiting queue: a heap ordered as vLLM's ``Request.__lt__``:
    (priority, arrival_time, request_id) — ids compare as strings."""

    def __init__(self):
        self._heap: list[tuple[int, float, str, int, Request]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def add_request(self, req: Request) -> None:
        heapq.heappush(self._heap,
                       (req.priority, req.arrival_time, req.request_id, req.index, req))

    prepend_request = add_request

    def peek_request(self) -> Request:
        return self._heap[0][4]

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[4]

    def __contains__(self, req: Request) -> bool:
        return any(e[4] is req for e in self._heap)

    def remove(self, req: Request) -> None:
        self._heap = [e for e in self._heap if e[4] is not req]
        heapq.heapify(self._heap)


def _WaitingQueue(priority: bool):  # (a factory where a class used to be)
    """FCFS: a deque (victims are prepended). PRIORITY: a heap ordered as vLLM's
    ``Request.__lt__``: (priority, arrival_time, request_id) — ids compare as strings."""
    return _PriorityQueue() if priority else _FCFSQueue()
