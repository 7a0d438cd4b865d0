"""The eviction-policy interface.

A policy ranks opaque, hashable keys (block hashes, G1 block ids) and chooses which to drop. It
never owns data: the tier that holds the blocks calls `insert` (or `insert_block`) when a block
becomes a candidate, `touch` (or `touch_block`) when it is used again, `pin` while a request or a
copy holds it, `remove` when it stops being a candidate, and `evict` when it needs room.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Generic, Self, TypeVar

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What a tier knows of a block when it inserts or touches it. Every field is a hint: a
    tier passes what it has and leaves the rest at the defaults."""

    depth: int = 0  # the block's index in its prompt, 0 = the first block
    parent: Hashable | None = None  # the tier's key of the prompt's previous block; None for the first
    arrival: float = 0.0  # the using request's arrival time, seconds on some monotonic clock
    priority: int = 0  # the using request's priority; lower is more urgent (vLLM's convention)
    session: str | None = None  # a conversation hint: the request's prompt_cache_key, else its OpenAI `user`

    def __post_init__(self) -> None:
        if self.depth < 0:
            raise ValueError(f"BlockInfo.depth must be >= 0; got {self.depth}")


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

    @classmethod
    def from_config(cls, capacity: int | None, options: Mapping[str, object]) -> Self:
        """The policy a tier of `capacity` blocks asks for with `options` (the `options` of a
        `{"name": ..., "options": {...}}` spec). `capacity` is None where the tier cannot say,
        and when a spec is only being checked (`kvtier serve` does that at start-up), so a policy
        that sizes itself from it must accept None. ValueError for options it does not take,
        naming them. This default takes none and ignores `capacity`."""
        if options:
            raise ValueError(f"eviction policy {getattr(cls, 'name', cls.__name__)!r} takes no options; "
                             f"got {sorted(options)}")
        return cls()

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

    def insert_block(self, key: K, info: BlockInfo) -> None:
        """`insert` with what the tier knows of the block. Tiers call this (not `insert`) where
        they know the metadata; a policy may use any of it or none. Same errors as `insert`.
        The default is `insert(key, info.priority)`."""
        self.insert(key, info.priority)

    def touch_block(self, key: K, info: BlockInfo) -> None:
        """`touch` with what the tier knows of this use of the block (the using request's
        arrival, priority, session). Same errors and priority rule as `touch`. The default is
        `touch(key, info.priority)`."""
        self.touch(key, info.priority)

    def insert_run(self, keys: Sequence[K], info: BlockInfo) -> None:
        """Insert a run of one prompt's consecutive blocks in one call (a request's new blocks):
        `keys[0]` is the block `info` describes, `keys[i]` sits at depth `info.depth + i` with
        parent `keys[i - 1]`. Ranked as just used, the deepest to go first: a block is no use
        once its parent is gone. ValueError, changing nothing, if a key is present or repeated.
        The default calls `insert_block` per key, deepest first."""
        check_run(self, keys, present=False)
        for i in range(len(keys) - 1, -1, -1):
            self.insert_block(keys[i], _nth(info, keys, i))

    def touch_run(self, keys: Sequence[K], info: BlockInfo) -> None:
        """`touch_block` for a run laid out as in `insert_run` (a request's prefix hit).
        KeyError, changing nothing, if a key is absent. The default calls `touch_block` per
        key, deepest first."""
        check_run(self, keys, present=True)
        for i in range(len(keys) - 1, -1, -1):
            self.touch_block(keys[i], _nth(info, keys, i))

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
        nest). A pinned key is still a candidate: it may be touched. Tiers pin the blocks
        requests or copies hold, possibly many, so `evict` should not walk pinned keys (the
        built-ins keep them out of their ranking). Raises KeyError if `key` is absent."""

    @abstractmethod
    def unpin(self, key: K) -> None:
        """Make `key` evictable again; a no-op if it is not pinned. Where it then ranks is the
        policy's choice: the built-ins rank it as just used (most recently used), since a
        tier unpins a block when the request that held it lets go. Raises KeyError if `key`
        is absent."""

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


def check_run(policy: EvictionPolicy[K], keys: Sequence[K], present: bool) -> None:
    """`insert_run`'s ValueError (a key present or repeated) or, with `present`,
    `touch_run`' KeyError (a key absent), before anything changes."""
    if present:
        missing = [k for k in keys if k not in policy]
        if missing:
            raise KeyError(missing[0])
    elif len(set(keys)) != len(keys) or any(k in policy for k in keys):
        raise ValueError(f"keys already present or repeated in {list(keys)!r}")


def _nth(info: BlockInfo, keys: Sequence[K], i: int) -> BlockInfo:
    return info if i == 0 else replace(info, depth=info.depth + i, parent=keys[i - 1])
