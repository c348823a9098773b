"""The scheduler's queue of requests waiting to run."""

from __future__ import annotations

import heapq
from collections import deque

from treadle.request import Request


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival) for the priority policy."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = 0

    def add(self, request: Request, front: bool = False) -> None:
        if self.policy == "priority":
            # A preempted request keeps its arrival time, so it lands back where it belongs.
            self._counter += 1
            heapq.heappush(self._heap, (request.priority, request.arrival_time, self._counter, request))
        elif front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> Request:
        return self._heap[0][3] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.policy == "priority" else self._fifo.popleft()

    def remove(self, request: Request) -> None:
        if self.policy == "priority":
            self._heap = [e for e in self._heap if e[3] is not request]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __iter__(self):
        return iter([e[3] for e in sorted(self._heap)] if self.policy == "priority" else list(self._fifo))
