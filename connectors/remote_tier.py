"""A batched storage tier's reads and writes (Redis/Valkey by default): batched
asynchronous writes, an optional reuse threshold, and batched reads.

The connector calls `note_use(key, data)` each time this engine stores or loads an offload
block; the block is queued for the tier once it has been used `min_uses` times (1: write-through on
first store). A writer thread drains the queue in batches, one pipelined round trip each. The
queue is bounded in bytes (MAX_PENDING_BYTES): when the remote is slower than the engine, writes
are dropped and counted, never waited for. Reads are one round trip per batch of blocks.

KV events: each block this engine writes is announced as a BlockStored on remote storage (G4),
named by the G1 blocks it holds. Removals are never announced: Redis drops entries itself (TTL,
maxmemory eviction) without telling its clients, and this tier never deletes.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from connectors.backend import BackendError, StorageBackend
from kvstore.events import BlockStored, ChunkBlocks, EventBuffer, TierKind
from kvstore.threads import one_torch_thread
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 256 * 2**20  # queued writes held in memory at most; more are dropped and counted
WRITTEN = -1  # a use count meaning "already in the tier (or queued for it)"
MAX_TRACKED = 1 << 16  # use counts kept (LRU); a forgotten key just counts from zero again


def leading_hits(backend: StorageBackend, keys: Sequence[BlockKey], name: str) -> int:
    """How many of `keys`, from the first, `backend` holds (one `exists` call); a failing
    backend holds none (and the log says so)."""
    try:
        found = backend.exists(list(keys))
    except (BackendError, OSError) as e:
        log.warning("%s lookup failed, treating as a miss: %s", name, e)
        return 0
    n = 0
    for ok in found:
        if not ok:
            break
        n += 1
    return n


class RemoteTier:
    kind = TierKind.REMOTE_STORAGE  # what its KV events call it

    def __init__(self, backend: StorageBackend, *, name: str = "remote", min_uses: int = 1, batch: int = 16,
                 max_pending_bytes: int = MAX_PENDING_BYTES, events: EventBuffer | None = None) -> None:
        if min_uses < 1:
            raise ValueError(f"{name}: min_uses must be >= 1; got {min_uses}")
        if batch < 1 or max_pending_bytes < 1:
            raise ValueError(f"{name}: the batch and max_pending_bytes must be >= 1")
        self.backend, self.name, self.min_uses, self.batch = backend, name, min_uses, batch
        self._uses: OrderedDict[BlockKey, int] = OrderedDict()
        self._lock = threading.Lock()
        # Bounded in bytes, not entries: with KV groups an offload block is several smaller
        # entries, and a count bound sized for whole blocks dropped most of a long prompt's.
        self.max_pending_bytes, self._pending_bytes = max_pending_bytes, 0
        self.events = events  # KV events sink (None: off)
        # (key, value, the G1 blocks it holds for its BlockStored, None: not announced)
        self._q: queue.Queue[tuple[BlockKey, bytes, ChunkBlocks | None] | None] = queue.Queue()
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.written_blocks = 0
        self.dropped_writes = 0  # queue full: the remote is slower than the engine
        self.failed_writes = 0  # the remote refused or was unreachable
        self._writer = threading.Thread(target=self._write_loop, name=f"kvtier-{name.lower()}-write", daemon=True)
        self._writer.start()

    # -- reads ---------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many of `keys`, from the first, the tier holds (one round trip)."""
        return leading_hits(self.backend, keys, self.name)

    def read(self, keys: Sequence[BlockKey], outs: Sequence[Any]) -> list[bool]:
        try:
            got = self.backend.get_into(list(keys), list(outs))
        except (BackendError, OSError) as e:
            log.warning("%s read failed, treating as a miss: %s", self.name, e)
            return [False] * len(keys)
        for k, ok in zip(keys, got):
            if ok:
                self._set(k, WRITTEN)  # it is there: never upload it again from here
        return got

    # -- writes --------------------------------------------------------------------------------
    def note_use(self, key: BlockKey, data: Callable[[], bytes], blocks: ChunkBlocks | None = None) -> None:
        """Counts a use of `key`; queues `data()` for the tier when the count reaches min_uses.
        `blocks`: the G1 blocks it holds, announced once written (None: not announced)."""
        with self._lock:
            n = self._uses.get(key, 0)
            if n == WRITTEN:
                self._uses.move_to_end(key)
                return
            n += 1
            self._set_locked(key, WRITTEN if n >= self.min_uses else n)
        if n >= self.min_uses:
            value = data()
            with self._lock:
                room = self._pending_bytes + len(value) <= self.max_pending_bytes
                self._pending_bytes += len(value) if room else 0
            if room:
                self._q.put_nowait((key, value, blocks))
            else:
                self.dropped_writes += 1
                self._set(key, 0)

    def flush(self) -> None:
        self._q.join()

    def close(self) -> None:
        self.flush()
        self._q.put(None)
        self._writer.join(30)
        self.backend.close()

    def _write_loop(self) -> None:
        one_torch_thread()
        while True:
            item = self._q.get()
            if item is None:
                self._q.task_done()
                return
            items = [item]
            while len(items) < self.batch:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:  # keep the stop marker for the outer loop
                    self._q.task_done()
                    self._q.put(None)
                    break
                items.append(nxt)
            try:
                stored = self.backend.put([k for k, _, _ in items], [v for _, v, _ in items])
            except (BackendError, OSError, ValueError) as e:
                log.warning("%s write of %d blocks failed: %s", self.name, len(items), e)
                stored = [False] * len(items)
            for (k, _, blocks), ok in zip(items, stored):
                if ok:
                    self.written_blocks += 1
                    if self.events is not None and blocks is not None:
                        self.events.append(BlockStored.of(blocks, self.kind))
                else:
                    self.failed_writes += 1
                    self._set(k, 0)  # may be offered again later
                self._q.task_done()
            with self._lock:
                self._pending_bytes -= sum(len(v) for _, v, _ in items)

    def _set(self, key: BlockKey, n: int) -> None:
        with self._lock:
            self._set_locked(key, n)

    def _set_locked(self, key: BlockKey, n: int) -> None:
        self._uses[key] = n
        self._uses.move_to_end(key)
        if len(self._uses) > MAX_TRACKED:
            self._uses.popitem(last=False)

    def stats(self) -> dict[str, Any]:
        describe = getattr(self.backend, "describe", None)
        return {"hit_tokens": self.hit_tokens, "miss_tokens": self.miss_tokens, "written_blocks": self.written_blocks,
                "dropped_writes": self.dropped_writes, "failed_writes": self.failed_writes,
                "queued_write_bytes": self._pending_bytes,
                "min_uses": self.min_uses, **(describe() if describe else {})}
