"""Helpers for eviction-policy authors (the built-ins use them): pins kept out of the ranking,
`evict`'s and the run methods' argument checks, and the check a tier runs on its policy. Pure
stdlib."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Set
from typing import Generic

from policies.base import EvictionPolicy, K, check_run  # noqa: F401  (re-exported for authors)


class PinnedAside(Generic[K]):
    """`pin`/`unpin` for a policy that takes pinned keys out of its ranking, so `evict` never walks
    them: tiers pin every block a running request holds, which may be most of them.

    The host class keeps `_pinned: set[K]` and provides `_unrank(key)` (take a ranked key out of
    the ranking, keeping whatever it needs to rank it again; KeyError if it is no candidate) and
    `_rerank(key)` (rank it again, as just used). Its `__len__`/`__contains__` count `_pinned`,
    and its `touch`/`remove` handle pinned keys."""

    _pinned: set[K]

    def _unrank(self, key: K) -> None:
        raise NotImplementedError

    def _rerank(self, key: K) -> None:
        raise NotImplementedError

    def pin(self, key: K) -> None:
        if key not in self._pinned:
            self._unrank(key)
            self._pinned.add(key)

    def unpin(self, key: K) -> None:
        if key in self._pinned:
            self._pinned.remove(key)
            self._rerank(key)
        elif key not in self:  # type: ignore[operator]
            raise KeyError(key)

    def _check_pins(self, ranked: Collection[K]) -> None:
        both = [k for k in self._pinned if k in ranked]
        if both:
            raise RuntimeError(f"pinned keys still ranked: {both!r}")


def check_count(n: int) -> None:
    """`evict`'s ValueError for a negative count."""
    if n < 0:
        raise ValueError(f"cannot evict a negative number of keys: {n}")


def as_lookup(protected: Collection[K]) -> Collection[K]:
    """`protected` as something with O(1) membership: callers often pass a list, and testing
    membership in it would make evict O(n * |protected|)."""
    return protected if isinstance(protected, (Set, Mapping)) else set(protected)


def check_candidates(policy: EvictionPolicy[K], keys: Collection[K], tier: str) -> None:
    """A tier's integrity check of its policy: RuntimeError naming `tier` unless the policy's
    candidates are exactly `keys`; then the policy's own `check_integrity`."""
    if len(policy) != len(keys) or any(k not in policy for k in keys):
        raise RuntimeError(f"{tier}: eviction policy candidates ({len(policy)}) differ from its entries ({len(keys)})")
    policy.check_integrity()
