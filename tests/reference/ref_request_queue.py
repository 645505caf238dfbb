"""Reference waiting queues: vLLM's FCFS deque and PRIORITY heap."""

from __future__ import annotations

import heapq
from collections import deque

from .ref_request import Request

# --------------------------------------------------------------------------------------------
# Request queues (vllm/v1/core/sched/request_queue.py)

class FCFSRequestQueue(deque):
    def add_request(self, request):
        self.append(request)

    def pop_request(self):
        return self.popleft()

    def peek_request(self):
        return self[0]

    def prepend_request(self, request):
        self.appendleft(request)

    def remove_requests(self, requests):
        keep = [r for r in self if r not in requests]
        self.clear()
        self.extend(keep)


class PriorityRequestQueue:
    def __init__(self):
        self._heap: list[Request] = []

    def add_request(self, request):
        heapq.heappush(self._heap, request)

    def pop_request(self):
        return heapq.heappop(self._heap)

    def peek_request(self):
        return self._heap[0]

    def prepend_request(self, request):
        self.add_request(request)

    def remove_requests(self, requests):
        self._heap = [r for r in self._heap if r not in requests]
        heapq.heapify(self._heap)

    def __len__(self):
        return len(self._heap)

    def __bool__(self):
        return bool(self._heap)

    def __iter__(self):
        heap = self._heap[:]
        while heap:
            yield heapq.heappop(heap)
