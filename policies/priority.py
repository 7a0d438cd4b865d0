"""Priority eviction: least urgent first, LRU among equals."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import ClassVar

from policies.base import BlockInfo, EvictionPolicy, K, check_run
from policies.pins import PinnedAside, as_lookup, check_count


class PriorityPolicy(PinnedAside[K], EvictionPolicy[K]):
    """Each key carries the most urgent (lowest) priority of the requests that used it.
    Keys with the highest priority value are evicted first; ties go least recently used.

    Layout: one insertion-ordered bucket per live priority, plus a max-heap of bucket
    priorities with lazy deletion (an emptied bucket is dropped from the dict at once and
    from the heap when it surfaces). Pinned keys keep their priority but wait outside the
    buckets; unpinned, they go to the most recently used end of theirs. insert/touch/pin/unpin
    are O(log P) for P distinct priorities, remove O(1), evict O((n + #skipped protected) +
    b log P) over the b buckets visited.
    """

    name: ClassVar[str] = "priority"

    def __init__(self) -> None:
        self._prio: dict[K, int] = {}  # every candidate's, pinned ones included
        self._buckets: dict[int, OrderedDict[K, None]] = {}  # each oldest first, never empty
        self._heap: list[int] = []  # negated priorities: heap top = least urgent
        self._in_heap: set[int] = set()  # priorities with a heap entry (live or stale)
        self._pinned: set[K] = set()

    def _add(self, key: K, priority: int) -> None:
        bucket = self._buckets.get(priority)
        if bucket is None:
            bucket = self._buckets[priority] = OrderedDict()
            if priority not in self._in_heap:  # one entry per priority keeps evict's walk exact
                self._in_heap.add(priority)
                heapq.heappush(self._heap, -priority)
                self._maybe_compact()
        bucket[key] = None
        self._prio[key] = priority

    def _discard(self, key: K, priority: int) -> None:
        bucket = self._buckets[priority]
        del bucket[key]
        if not bucket:
            del self._buckets[priority]  # heap entry goes stale; dropped lazily

    def _maybe_compact(self) -> None:
        # Stale entries are bounded by distinct priorities ever seen; rebuild if they dominate.
        if len(self._heap) > 2 * len(self._buckets) + 16:
            self._heap = [-p for p in self._buckets]
            heapq.heapify(self._heap)
            self._in_heap = set(self._buckets)

    def _unrank(self, key: K) -> None:
        self._discard(key, self._prio[key])

    def _rerank(self, key: K) -> None:
        self._add(key, self._prio[key])

    def insert(self, key: K, priority: int = 0) -> None:
        if key in self._prio:
            raise ValueError(f"key already present: {key!r}")
        self._add(key, priority)

    def touch(self, key: K, priority: int | None = None) -> None:
        old = self._prio[key]  # raises KeyError if absent
        new = old if priority is None or priority >= old else priority
        if key in self._pinned:  # ranked again, with its priority, when unpinned
            self._prio[key] = new
        elif new == old:
            self._buckets[old].move_to_end(key)
        else:
            self._discard(key, old)
            self._add(key, new)

    def insert_run(self, keys: Sequence[K], info: BlockInfo) -> None:
        check_run(self, keys, present=False)
        for key in reversed(keys):  # deepest oldest among equals: evicted first
            self._add(key, info.priority)

    def touch_run(self, keys: Sequence[K], info: BlockInfo) -> None:
        check_run(self, keys, present=True)
        for key in reversed(keys):
            self.touch(key, info.priority)

    def remove(self, key: K) -> None:
        priority = self._prio.pop(key)
        if key in self._pinned:
            self._pinned.remove(key)
        else:
            self._discard(key, priority)

    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        check_count(n)
        if n == 0:
            return []
        skip = as_lookup(protected)
        heap, buckets = self._heap, self._buckets
        victims: list[K] = []
        popped: list[int] = []  # live priorities taken off the heap during the walk
        # Walk buckets least urgent first without touching them; only commit once n found.
        while heap and len(victims) < n:
            p = -heapq.heappop(heap)
            bucket = buckets.get(p)
            if bucket is None:
                self._in_heap.discard(p)  # stale entry: drop for good
                continue
            popped.append(p)
            for key in bucket:
                if key not in skip:
                    victims.append(key)
                    if len(victims) == n:
                        break
        if len(victims) < n:
            victims = []
        for key in victims:
            self._discard(key, self._prio.pop(key))
        for p in popped:
            if p in buckets:
                heapq.heappush(heap, -p)
            else:
                self._in_heap.discard(p)
        return victims or None

    def __len__(self) -> int:
        return len(self._prio)

    def __contains__(self, key: object) -> bool:
        return key in self._prio

    def check_integrity(self) -> None:
        seen = 0
        for p, bucket in self._buckets.items():
            if not bucket:
                raise RuntimeError(f"empty bucket kept for priority {p}")
            for key in bucket:
                if key in self._pinned:
                    raise RuntimeError(f"pinned key {key!r} still ranked in bucket {p}")
                if self._prio.get(key) != p:
                    got = self._prio.get(key)
                    raise RuntimeError(f"{key!r} in bucket {p} but recorded as {got}")
            seen += len(bucket)
        if any(k not in self._prio for k in self._pinned):
            raise RuntimeError("a pinned key has no priority recorded")
        if seen + len(self._pinned) != len(self._prio):
            raise RuntimeError(f"{len(self._prio)} keys recorded, {seen} in buckets, {len(self._pinned)} pinned")
        entries = [-x for x in self._heap]
        if len(entries) != len(set(entries)) or set(entries) != self._in_heap:
            raise RuntimeError("heap entries and their index disagree")
        missing = set(self._buckets) - self._in_heap
        if missing:
            raise RuntimeError(f"live priorities missing from the heap: {sorted(missing)}")
        if any(self._heap[(i - 1) // 2] > self._heap[i] for i in range(1, len(self._heap))):
            raise RuntimeError("heap order broken")
