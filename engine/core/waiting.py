"""The queue of requests waiting to be admitted, in the scheduling policy's order."""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable

from engine.config import SchedulingPolicy
from engine.core.request import Request


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival) for the priority policy."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[tuple[int, float], int, Request]] = []
        self._tie = itertools.count()

    def add(self, req: Request, front: bool = False) -> None:
        if self.policy is SchedulingPolicy.PRIORITY:
            heapq.heappush(self._heap, (req.sort_key(), next(self._tie), req))
        elif front:
            self._fifo.appendleft(req)
        else:
            self._fifo.append(req)

    def peek(self) -> Request:
        return self._heap[0][2] if self.policy is SchedulingPolicy.PRIORITY else self._fifo[0]

    def sort(self, key) -> int:
        """Reorder a non-empty FIFO queue by `key` (computed once per request; stable: arrival
        order among equals); returns the first request's key."""
        keyed = sorted(((key(r), i, r) for i, r in enumerate(self._fifo)), key=lambda t: t[:2])
        self._fifo = deque(r for _, _, r in keyed)
        return keyed[0][0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2] if self.policy is SchedulingPolicy.PRIORITY else self._fifo.popleft()

    def __iter__(self):
        return (e[2] for e in self._heap) if self.policy is SchedulingPolicy.PRIORITY else iter(self._fifo)

    def remove(self, req: Request) -> bool:
        if self.policy is SchedulingPolicy.PRIORITY:
            kept = [e for e in self._heap if e[2] is not req]
            found = len(kept) != len(self._heap)
            self._heap = kept
            heapq.heapify(self._heap)
            return found
        try:
            self._fifo.remove(req)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self._heap) if self.policy is SchedulingPolicy.PRIORITY else len(self._fifo)


class BlockHolders:
    """One admission pass's count of waiting requests that hold G1 blocks (resuming after an async
    load: their whole prompt's blocks were allocated when it started). While one waits, a fresh
    request at the head that cannot get blocks steps aside instead of stopping admission: the
    blocks it waits for are held by the requests queued behind it, so stopping would stall the
    engine. Counted on first need (a pass usually never asks)."""

    def __init__(self, waiting: WaitingQueue, holds_blocks: Callable[[Request], bool]) -> None:
        self._waiting, self._holds = waiting, holds_blocks
        self._count: int | None = None

    def behind(self) -> bool:
        """Whether a waiting request holds blocks (the head, which has none, asks)."""
        if self._count is None:
            self._count = sum(1 for r in self._waiting if self._holds(r))
        return self._count > 0

    def admitted(self, held_blocks: bool) -> None:
        """A request left the queue for this pass."""
        if held_blocks and self._count is not None:
            self._count -= 1
