"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from typing import ClassVar

from policies._common import PinMixin, as_lookup, check_count
from policies.base import EvictionPolicy, K


class LRUPolicy(PinMixin[K], EvictionPolicy[K]):
    """Evicts the least recently inserted or touched key first. Priorities are ignored.

    insert/touch/remove/pin/unpin are O(1); evict is O(n + #skipped pinned/protected).
    """

    name: ClassVar[str] = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()  # oldest first
        self._pinned: set[K] = set()

    def insert(self, key: K, priority: int = 0) -> None:
        if key in self._order:
            raise ValueError(f"key already present: {key!r}")
        self._order[key] = None

    def touch(self, key: K, priority: int | None = None) -> None:
        self._order.move_to_end(key)  # raises KeyError if absent

    def remove(self, key: K) -> None:
        del self._order[key]
        self._pinned.discard(key)

    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        check_count(n)
        if n == 0:
            return []
        skip = as_lookup(protected)
        pinned = self._pinned
        victims: list[K] = []
        # Collect first, delete after: a short count must leave the order untouched.
        for key in self._order:
            if key not in pinned and key not in skip:
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return None
        for key in victims:
            del self._order[key]
        return victims

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def check_integrity(self) -> None:
        self._check_pins()
