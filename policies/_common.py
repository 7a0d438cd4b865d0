"""Helpers shared by the built-in policies (not part of the public interface)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Set
from typing import Generic

from policies.base import K


class PinMixin(Generic[K]):
    """Pin bookkeeping over a `_pinned` set; the host class provides `__contains__`."""

    _pinned: set[K]

    def pin(self, key: K) -> None:
        if key not in self:  # type: ignore[operator]
            raise KeyError(key)
        self._pinned.add(key)

    def unpin(self, key: K) -> None:
        if key not in self:  # type: ignore[operator]
            raise KeyError(key)
        self._pinned.discard(key)

    def _check_pins(self) -> None:
        stray = [k for k in self._pinned if k not in self]  # type: ignore[operator]
        if stray:
            raise RuntimeError(f"pinned keys that are not candidates: {stray!r}")


def check_count(n: int) -> None:
    if n < 0:
        raise ValueError(f"cannot evict a negative number of keys: {n}")


def as_lookup(protected: Collection[K]) -> Collection[K]:
    # Callers often pass a list; membership tests on it would make evict O(n * |protected|).
    return protected if isinstance(protected, (Set, Mapping)) else set(protected)
