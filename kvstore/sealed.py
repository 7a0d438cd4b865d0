"""A plugin backend made safe to use as a tier: namespaced keys and self-checking entries.

A plugin backend stores opaque bytes under opaque keys and knows nothing of models. kvtier's own
persistent tiers (G3 disk, G4 Redis) namespace their keys by the model's fingerprint and seal
every value in the entry format of `kvstore.entry` (checksums, or keyed MACs with the KV secret).
`SealedBackend` gives any `StorageBackend` the same two properties, so that:

- two models (or layouts) sharing one store never read each other's blocks: the key the backend
  sees is a digest of (namespace, key), and the entry header names both again;
- bytes damaged in the store, written by another model, or planted without the secret are a miss
  (counted in `stats.corrupt` and deleted), never served.

The wrapper is what the connector calls; it catches nothing: a backend that raises still raises
(the connector turns that into a miss and a log line).
"""
from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import replace

from kvstore.backend import BackendStats, Buffer, StorageBackend, check_blocks, check_infos, check_keys, check_outs
from kvstore.entry import HEADER_SIZE, CorruptEntry, EntryCodec
from kvstore.keys import KEY_BYTES, BlockKey
from policies import BlockInfo

log = logging.getLogger(__name__)


class SealedBackend(StorageBackend):
    """`inner` behind namespaced keys and sealed entries; `describe()` names the inner backend."""

    def __init__(self, inner: StorageBackend, namespace: bytes, secret: bytes | None = None,
                 name: str | None = None) -> None:
        if type(namespace) is not bytes or len(namespace) != KEY_BYTES:
            raise ValueError(f"namespace must be {KEY_BYTES} bytes")
        self.inner, self.namespace = inner, namespace
        self.name = name or type(inner).__name__
        self.codec = EntryCodec(secret)
        self.stats = BackendStats()
        self._lock = threading.Lock()

    def _inner_key(self, key: BlockKey) -> bytes:
        return hashlib.sha256(self.namespace + key).digest()[:KEY_BYTES]

    def _open(self, key: BlockKey, raw: Buffer | None) -> memoryview | None:
        """The payload of a stored entry, or None (a miss; a bad entry is counted and deleted)."""
        if raw is None:
            with self._lock:
                self.stats.misses += 1
            return None
        view = memoryview(raw).cast("B")
        try:
            head = self.codec.open_header(view)
            if head.namespace != self.namespace or head.key != key:
                raise CorruptEntry("entry of another key or model")
            payload = view[HEADER_SIZE:]
            if payload.nbytes != head.payload_len:
                raise CorruptEntry(f"payload is {payload.nbytes} bytes, header says {head.payload_len}")
            self.codec.check_payload(head, payload)
        except CorruptEntry as e:
            log.warning("%s: entry rejected (%s); deleting it", self.name, e)
            with self._lock:
                self.stats.corrupt += 1
                self.stats.misses += 1
            self.inner.delete([self._inner_key(key)])
            return None
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += payload.nbytes
        return payload

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        check_keys(keys)
        return self.inner.exists([self._inner_key(k) for k in keys])

    def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        check_keys(keys)
        raws = self.inner.get([self._inner_key(k) for k in keys])
        out = []
        for key, raw in zip(keys, raws):
            payload = self._open(key, raw)
            out.append(None if payload is None else bytes(payload))
        return out

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[Buffer]) -> list[bool]:
        views = check_outs(keys, outs)
        raws = self.inner.get([self._inner_key(k) for k in keys])
        filled = []
        for key, raw, out in zip(keys, raws, views):
            payload = self._open(key, raw)
            ok = payload is not None and payload.nbytes == out.nbytes
            if ok:
                out[:] = payload
            filled.append(ok)
        return filled

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Buffer]) -> list[bool]:
        return self._put(keys, blocks, None)

    def put_blocks(self, keys: Sequence[BlockKey], blocks: Sequence[Buffer], infos: Sequence[BlockInfo]) -> list[bool]:
        return self._put(keys, blocks, self._inner_infos(keys, infos))

    def _put(self, keys: Sequence[BlockKey], blocks: Sequence[Buffer], infos: list[BlockInfo] | None) -> list[bool]:
        views = check_blocks(keys, blocks)
        entries = [self.codec.seal(self.namespace, k, v) + bytes(v) for k, v in zip(keys, views)]
        inner_keys = [self._inner_key(k) for k in keys]
        stored = self.inner.put(inner_keys, entries) if infos is None else self.inner.put_blocks(inner_keys, entries, infos)
        with self._lock:
            for ok, v in zip(stored, views):
                if ok:
                    self.stats.bytes_written += v.nbytes
                else:
                    self.stats.write_errors += 1
        return stored

    def delete(self, keys: Sequence[BlockKey]) -> None:
        check_keys(keys)
        self.inner.delete([self._inner_key(k) for k in keys])

    def touch(self, keys: Sequence[BlockKey], priority: int) -> None:
        check_keys(keys)
        self.inner.touch([self._inner_key(k) for k in keys], priority)

    def touch_blocks(self, keys: Sequence[BlockKey], infos: Sequence[BlockInfo]) -> None:
        self.inner.touch_blocks([self._inner_key(k) for k in keys], self._inner_infos(keys, infos))

    def _inner_infos(self, keys: Sequence[BlockKey], infos: Sequence[BlockInfo]) -> list[BlockInfo]:
        """`infos` with parents named as the inner backend names them."""
        check_infos(keys, infos)
        return [i if i.parent is None else replace(i, parent=self._inner_key(i.parent)) for i in infos]  # type: ignore[arg-type]

    def close(self) -> None:
        self.inner.close()

    def occupancy(self) -> tuple[int, int | None] | None:
        inner = getattr(self.inner, "occupancy", None)  # a plugin written before the method
        return inner() if inner is not None else None

    def describe(self) -> dict[str, str]:
        return {"backend": self.name}
