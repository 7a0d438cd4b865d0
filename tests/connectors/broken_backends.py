"""Deliberately broken backends: each breaks one part of the StorageBackend contract, so the
conformance kit can be shown to catch it (tests/connectors/test_broken_backends.py)."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence

from connectors.backend import (BackendError, Scatter, ScatterReads, StorageBackend, check_blocks, check_keys,
                                check_scatter_outs)


class DictBackend(StorageBackend):
    """A correct, minimal backend; each broken one below overrides one method."""

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError("closed")

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        check_keys(keys)
        self._check_open()
        return [k in self._data for k in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        check_keys(keys)
        self._check_open()
        return [self._read(k) for k in keys]

    def _read(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def put(self, keys, blocks) -> list[bool]:
        views = check_blocks(keys, blocks)
        self._check_open()
        return [self._write(k, v) for k, v in zip(keys, views)]

    def _write(self, key: bytes, view: memoryview) -> bool:
        with self._lock:
            self._data[key] = view.tobytes()
        return True

    def delete(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        self._check_open()
        with self._lock:
            for k in keys:
                self._data.pop(k, None)

    def close(self) -> None:
        self._closed = True


class StaleBackend(DictBackend):
    """Ignores overwrites: serves the first value ever stored (a stale cache)."""

    def _write(self, key, view):
        with self._lock:
            self._data.setdefault(key, view.tobytes())
        return True


class WrongBytesBackend(DictBackend):
    """Flips a byte in the middle of large values on read (a silent bit-rot)."""

    def _read(self, key):
        value = self._data.get(key)
        if value is None or len(value) < 65_536:
            return value
        mid = len(value) // 2
        return value[:mid] + bytes([value[mid] ^ 1]) + value[mid + 1 :]


class LossyBackend(DictBackend):
    """Says True to every put but silently drops every 7th new key."""

    def __init__(self) -> None:
        super().__init__()
        self._puts = 0

    def _write(self, key, view):
        with self._lock:
            self._puts += 1
            if self._puts % 7 and key not in self._data:
                self._data[key] = view.tobytes()
            elif key in self._data:
                self._data[key] = view.tobytes()
        return True


class RacyBackend(DictBackend):
    """Not thread-safe: copy-on-write updates without a lock lose concurrent puts."""

    def _write(self, key, view):
        data = dict(self._data)
        time.sleep(0)  # another thread's update lands here and is then overwritten
        data[key] = view.tobytes()
        self._data = data
        return True


class TornBackend(DictBackend):
    """Publishes a value before filling it in: concurrent readers see half-written bytes."""

    def _write(self, key, view):
        buf = bytearray(view.nbytes)
        self._data[key] = buf  # type: ignore[assignment]
        half = view.nbytes // 2
        buf[:half] = view[:half]
        time.sleep(0)
        buf[half:] = view[half:]
        return True

    def _read(self, key):
        value = self._data.get(key)
        return None if value is None else bytes(value)


class AliasingBackend(DictBackend):
    """Keeps a reference to the caller's buffer instead of copying it."""

    def _write(self, key, view):
        self._data[key] = view  # type: ignore[assignment]
        return True

    def _read(self, key):
        value = self._data.get(key)
        return None if value is None else bytes(value)


class TrustingBackend(DictBackend):
    """Accepts any key at all: no validation."""

    def exists(self, keys):
        self._check_open()
        return [k in self._data for k in keys]

    def get(self, keys):
        self._check_open()
        return [self._data.get(k) for k in keys]


class NoCloseBackend(DictBackend):
    """Keeps serving after close (close is a no-op)."""

    def close(self) -> None:
        pass


class ReversedScatterBackend(DictBackend, ScatterReads):
    """Offers Scatter reads but fills the pieces last first (the bytes of each piece right, their
    order wrong), as a backend that walks an iovec backwards would."""

    scatter_reads = True

    def get_into(self, keys, outs):
        views = check_scatter_outs(keys, outs)
        got = self.get(keys)
        out = []
        for value, o in zip(got, views):
            ok = value is not None and len(value) == o.nbytes
            if ok and isinstance(o, Scatter):
                at = len(value)
                for a, n in zip(o.addresses.tolist(), o.lengths.tolist()):  # the first piece gets the tail
                    ctypes.memmove(a, value[at - n:at], n)
                    at -= n
            elif ok:
                o[:] = value
            out.append(ok)
        return out
