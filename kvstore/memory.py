"""MemoryBackend: the plain in-process reference backend (tests, and a model for plugin authors)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.backend import (
    BackendError,
    BackendStats,
    Buffer,
    StorageBackend,
    check_blocks,
    check_keys,
    check_outs,
)
from kvstore.keys import BlockKey
from policies import PolicySpecLike, check_candidates, make_policy


class MemoryBackend(StorageBackend):
    """A dict of immutable `bytes`, bounded by `capacity_bytes` of payload, evicting through
    an eviction policy (`lru` by default, or any `policies.make_policy` spec)."""

    def __init__(self, capacity_bytes: int = 1 << 30, policy: PolicySpecLike = "lru") -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = BackendStats()
        self._policy = make_policy(policy)
        self._data: dict[BlockKey, bytes] = {}
        self._used = 0
        self._closed = False
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def occupancy(self) -> tuple[int, int | None]:
        return self._used, self.capacity_bytes

    def __len__(self) -> int:
        return len(self._data)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("MemoryBackend is closed")

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        check_keys(keys)
        with self._lock:
            self._check_open()
            return [k in self._data for k in keys]

    def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        check_keys(keys)
        with self._lock:
            self._check_open()
            out = [self._lookup(k) for k in keys]
        return out

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[Buffer]) -> list[bool]:
        views = check_outs(keys, outs)
        with self._lock:
            self._check_open()
            values = [self._data.get(k) for k in keys]
        filled = []
        for key, value, out in zip(keys, values, views):
            ok = value is not None and len(value) == out.nbytes
            if ok:
                out[:] = value  # `bytes` are immutable: safe to copy outside the lock
            with self._lock:
                self._count(key, value if ok else None)
            filled.append(ok)
        return filled

    def _lookup(self, key: BlockKey) -> bytes | None:
        value = self._data.get(key)
        self._count(key, value)
        return value

    def _count(self, key: BlockKey, value: bytes | None) -> None:
        if value is None:
            self.stats.misses += 1
            return
        self.stats.hits += 1
        self.stats.bytes_read += len(value)
        if key in self._policy:  # it may have been evicted since the caller looked it up
            self._policy.touch(key)

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Buffer]) -> list[bool]:
        views = check_blocks(keys, blocks)
        self._check_open()
        values = [v.tobytes() for v in views]  # copy now: the caller reuses its buffers
        with self._lock:
            self._check_open()
            return [self._store(k, v) for k, v in zip(keys, values)]

    def _store(self, key: BlockKey, value: bytes) -> bool:
        if len(value) > self.capacity_bytes:
            return False
        old = self._data.pop(key, None)
        if old is not None:
            self._used -= len(old)
            self._policy.remove(key)
        while self._used + len(value) > self.capacity_bytes:
            victims = self._policy.evict(1)
            if victims is None:  # only pinned entries left (none today): refuse
                return False
            self._used -= len(self._data.pop(victims[0]))
            self.stats.evictions += 1
        self._data[key] = value
        self._policy.insert(key)
        self._used += len(value)
        self.stats.bytes_written += len(value)
        return True

    def delete(self, keys: Sequence[BlockKey]) -> None:
        check_keys(keys)
        with self._lock:
            self._check_open()
            for key in keys:
                old = self._data.pop(key, None)
                if old is not None:
                    self._used -= len(old)
                    self._policy.remove(key)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._data.clear()
            self._used = 0

    def check_integrity(self) -> None:
        """Raise RuntimeError if the dict, the byte count and the policy disagree."""
        with self._lock:
            used = sum(len(v) for v in self._data.values())
            if used != self._used:
                raise RuntimeError(f"used_bytes is {self._used}, entries hold {used}")
            if used > self.capacity_bytes:
                raise RuntimeError(f"{used} bytes stored over capacity {self.capacity_bytes}")
            check_candidates(self._policy, self._data.keys(), "MemoryBackend")
