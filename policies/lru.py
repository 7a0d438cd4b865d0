"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import ClassVar

from policies.base import BlockInfo, EvictionPolicy, K, check_run
from policies.pins import PinnedAside, as_lookup, check_count


class LRUPolicy(PinnedAside[K], EvictionPolicy[K]):
    """Evicts the least recently inserted, touched or unpinned key first. Priorities are ignored.

    Pinned keys wait outside the order. insert/touch/remove/pin/unpin are O(1); evict is
    O(n + #skipped protected).
    """

    name: ClassVar[str] = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()  # unpinned, oldest first
        self._pinned: set[K] = set()

    def _unrank(self, key: K) -> None:
        del self._order[key]

    def _rerank(self, key: K) -> None:
        self._order[key] = None

    def insert(self, key: K, priority: int = 0) -> None:
        if key in self:
            raise ValueError(f"key already present: {key!r}")
        self._order[key] = None

    def touch(self, key: K, priority: int | None = None) -> None:
        if key not in self._pinned:  # a pinned key is ranked as just used when unpinned anyway
            self._order.move_to_end(key)  # raises KeyError if absent

    def insert_run(self, keys: Sequence[K], info: BlockInfo) -> None:
        check_run(self, keys, present=False)
        order = self._order
        for key in reversed(keys):  # deepest oldest: evicted first
            order[key] = None

    def touch_run(self, keys: Sequence[K], info: BlockInfo) -> None:
        check_run(self, keys, present=True)
        order, pinned = self._order, self._pinned
        for key in reversed(keys):
            if key not in pinned:
                order.move_to_end(key)

    def remove(self, key: K) -> None:
        if key in self._pinned:
            self._pinned.remove(key)
        else:
            del self._order[key]

    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        check_count(n)
        if n == 0:
            return []
        skip = as_lookup(protected)
        victims: list[K] = []
        # Collect first, delete after: a short count must leave the order untouched.
        for key in self._order:
            if key not in skip:
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def __len__(self) -> int:
        return len(self._order) + len(self._pinned)

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._pinned

    def check_integrity(self) -> None:
        self._check_pins(self._order)
