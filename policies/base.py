"""The eviction-policy interface.

A policy ranks opaque, hashable keys (block hashes) and chooses which to drop. It never
owns data: the tier that holds the blocks calls `insert` when a block becomes evictable,
`touch` when it is used again, `remove` when it stops being a candidate (freed, or taken
by a running request), and `evict` when it needs room.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Hashable
from typing import ClassVar, Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(ABC, Generic[K]):
    """Contract shared by every policy.

    State: a set of candidate keys, each optionally pinned. Priorities are ints where a
    LOWER value is MORE urgent to keep (vLLM's convention); policies that do not rank by
    priority accept and ignore the argument.

    Errors: inserting a present key raises ValueError; touch/remove/pin/unpin of an absent
    key raise KeyError; `evict` with n < 0 raises ValueError. A call that raises changes
    nothing.

    Implementations need not be thread-safe: the owning tier serialises calls.
    """

    #: Registry name ("lru", "priority", ...). Plugins set their own.
    name: ClassVar[str]

    @abstractmethod
    def insert(self, key: K, priority: int = 0) -> None:
        """Add `key` as an evictable candidate, most recently used.

        Raises ValueError if `key` is already present (state unchanged).
        """

    @abstractmethod
    def touch(self, key: K, priority: int | None = None) -> None:
        """Mark `key` as just used.

        If `priority` is given the key keeps the most urgent (lowest) of its old and new
        priority, so a block shared by an urgent request stays urgent. Pins are unchanged.
        Raises KeyError if `key` is absent.
        """

    @abstractmethod
    def remove(self, key: K) -> None:
        """Drop `key` from the candidates, clearing its pin. Raises KeyError if absent."""

    @abstractmethod
    def evict(self, n: int, protected: Collection[K] = ()) -> list[K] | None:
        """Choose, remove and return `n` victims, first victim first.

        Victims are never pinned and never in `protected` (which may also hold keys that
        are not candidates). All-or-nothing: if fewer than `n` keys are eligible, return
        None and leave the policy exactly as it was. `n == 0` returns []. Raises
        ValueError if `n < 0`.
        """

    @abstractmethod
    def pin(self, key: K) -> None:
        """Exempt `key` from eviction until `unpin` or `remove`. Idempotent (pins do not
        nest). Raises KeyError if `key` is absent."""

    @abstractmethod
    def unpin(self, key: K) -> None:
        """Make `key` evictable again; a no-op if it is not pinned. Raises KeyError if
        `key` is absent."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of candidates, pinned ones included."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether `key` is a candidate (pinned or not)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Verify internal invariants; raise RuntimeError (never AssertionError, so it
        still works under `python -O`) if any is broken. O(n); meant for tests."""
