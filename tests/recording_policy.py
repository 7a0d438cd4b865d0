"""A recording eviction policy for the tests of the tiers that drive one (issue 18).

`RecordingLRU` is LRU that logs every call a tier makes, `insert_block`/`touch_block` with their
BlockInfo and without the plain calls the defaults would add. As a spec it is
`recording_policy:RecordingLRU` (tests/ is on sys.path), with an optional `tag` option; every
instance `from_config` builds is in `RecordingLRU.made`, in order.
"""
from __future__ import annotations

from collections.abc import Hashable

from policies import BlockInfo, LRUPolicy


class RecordingLRU(LRUPolicy):
    name = "recording"
    made: list[RecordingLRU] = []

    def __init__(self, tag: str | None = None, capacity: int | None = None) -> None:
        super().__init__()
        self.tag, self.capacity = tag, capacity
        self.calls: list[tuple] = []

    @classmethod
    def from_config(cls, capacity, options):  # type: ignore[no-untyped-def]
        unknown = sorted(set(options) - {"tag"})
        if unknown:
            raise ValueError(f"policy 'recording' does not take {unknown}")
        policy = cls(options.get("tag"), capacity)
        cls.made.append(policy)
        return policy

    @classmethod
    def tagged(cls, tag: str) -> RecordingLRU:
        """The last one made with `tag` (a start-up check builds one before the tier's)."""
        return [p for p in cls.made if p.tag == tag][-1]

    def insert(self, key, priority=0):  # type: ignore[no-untyped-def]
        self.calls.append(("insert", key, priority))
        super().insert(key, priority)

    def touch(self, key, priority=None):  # type: ignore[no-untyped-def]
        self.calls.append(("touch", key, priority))
        super().touch(key, priority)

    def insert_block(self, key, info):  # type: ignore[no-untyped-def]
        self.calls.append(("insert_block", key, info))
        LRUPolicy.insert(self, key, info.priority)

    def touch_block(self, key, info):  # type: ignore[no-untyped-def]
        self.calls.append(("touch_block", key, info))
        LRUPolicy.touch(self, key, info.priority)

    def remove(self, key):  # type: ignore[no-untyped-def]
        self.calls.append(("remove", key))
        super().remove(key)

    def pin(self, key):  # type: ignore[no-untyped-def]
        self.calls.append(("pin", key))
        super().pin(key)

    def unpin(self, key):  # type: ignore[no-untyped-def]
        self.calls.append(("unpin", key))
        super().unpin(key)

    def names(self) -> list[tuple]:
        """(call, key) of every call."""
        return [c[:2] for c in self.calls]

    def of(self, kind: str, keys: list[Hashable]) -> list[BlockInfo]:
        """The infos the `kind` calls ("insert_block", "touch_block") got for `keys`, in order."""
        return [c[2] for c in self.calls if c[0] == kind and c[1] in keys]
