"""A storage tier below host memory (G2): a `StorageBackend` and how the connector uses it.

The connector holds an ordered list of these and names none of them: lookups walk the list
top-down, a hit is promoted up (into G2, and written to every parallel tier above the one that
served it), and a stored block goes to every tier (written at once to parallel tiers, offered to
batched tiers, which write it once it has been used `min_uses` times).

Two read/write modes, one per kind of store:
- `PARALLEL` (a local disk, a plugin): one key per read, `read_threads` reads in flight, each
  bounded by `read_timeout_s`; writes in order on one thread, straight from the pinned G2 slot,
  at most `max_pending_writes` queued (past that a store waits on the transfer thread; the
  step loop's write-back drops instead).
- `BATCHED` (a remote store: one round trip per batch): reads of up to `RemoteTier.batch` keys
  per round trip with the next batch in flight; writes batched on their own thread, queued only
  after `min_uses` uses and dropped when the queue is full (`connectors.remote_tier`).

KV events name a parallel tier local storage (G3) and a batched one remote storage (G4)
(`kvstore.events.TierKind`); each announces a block once it has written it. Neither announces
removals: the disk's own evictions are internal to the backend (not reported yet), and Redis
drops entries itself (TTL, maxmemory) where this engine cannot see it.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from connectors.backend import BackendError, StorageBackend
from connectors.remote_tier import RemoteTier, leading_hits
from kvstore.threads import one_torch_thread
from kvstore.events import BlockStored, ChunkBlocks, EventBuffer, TierKind
from kvstore.keys import BlockKey
from policies import BlockInfo

log = logging.getLogger(__name__)


class TierMode(Enum):
    PARALLEL = "parallel"
    BATCHED = "batched"


class OrderedWriter:
    """A parallel tier's writes: one thread, in order, bounded."""

    kind = TierKind.LOCAL_STORAGE  # what its KV events call it

    def __init__(self, name: str, backend: StorageBackend, max_pending: int, events: EventBuffer | None) -> None:
        self.name, self.backend, self.events = name, backend, events
        self._io = ThreadPoolExecutor(1, thread_name_prefix=f"kvtier-{name.lower()}-write", initializer=one_torch_thread)
        self._slots = threading.BoundedSemaphore(max_pending)

    def submit(self, key: BlockKey, buf: torch.Tensor, done: Callable[[], None], wait: bool,
               info: BlockInfo, blocks: ChunkBlocks | None = None) -> bool:
        """Queue `buf` (valid until `done()` is called) for `key`, the block `info` describes and
        `blocks` names to KV events (None: not announced). False, with `done()` already called,
        when `wait` is False and the queue is full."""
        if not self._slots.acquire(blocking=wait):
            done()
            return False
        self._io.submit(self._write, key, buf, done, info, blocks)
        return True

    def _write(self, key: BlockKey, buf: torch.Tensor, done: Callable[[], None], info: BlockInfo,
               blocks: ChunkBlocks | None) -> None:
        try:
            # With its BlockInfo: the storing request's priority (and the rest) reaches the tier's policy.
            stored = self.backend.put_blocks([key], [memoryview(buf.numpy())], [info])[0]
            if stored and self.events is not None and blocks is not None:
                self.events.append(BlockStored.of(blocks, self.kind))
        except (BackendError, OSError) as e:
            log.warning("%s write failed (block stays in the tiers above): %s", self.name, e)
        finally:
            done()
            self._slots.release()

    def flush(self) -> None:
        self._io.submit(lambda: None).result()

    def close(self) -> None:
        self.flush()
        self._io.shutdown(wait=True)


@dataclass(eq=False)
class StorageTier:
    name: str  # what stats, metrics and per-request hit counts call it
    backend: StorageBackend
    mode: TierMode
    read_threads: int = 4  # PARALLEL: reads in flight
    read_timeout_s: float = 10.0  # PARALLEL: a read later than this is a miss
    remote: RemoteTier | None = None  # BATCHED: the reuse-gated batched writer and reader
    writer: OrderedWriter | None = field(default=None, repr=False)  # PARALLEL

    def __post_init__(self) -> None:
        if self.read_threads < 1:
            raise ValueError(f"{self.name}: read_threads must be >= 1; got {self.read_threads}")
        if self.read_timeout_s <= 0:
            raise ValueError(f"{self.name}: read_timeout_s must be > 0; got {self.read_timeout_s}")
        if (self.mode is TierMode.BATCHED) != (self.remote is not None):
            raise ValueError(f"{self.name}: a batched tier needs its RemoteTier, a parallel one none")

    @classmethod
    def parallel(cls, name: str, backend: StorageBackend, *, read_threads: int = 4, read_timeout_s: float = 10.0,
                 max_pending_writes: int = 64, events: EventBuffer | None = None) -> StorageTier:
        writer = OrderedWriter(name, backend, max_pending_writes, events)
        return cls(name, backend, TierMode.PARALLEL, read_threads, read_timeout_s, writer=writer)

    @classmethod
    def batched(cls, name: str, remote: RemoteTier) -> StorageTier:
        return cls(name, remote.backend, TierMode.BATCHED, remote=remote)

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many of `keys`, from the first, the tier holds; a failing backend holds none."""
        if self.remote is not None:
            return self.remote.lookup(keys)  # one round trip
        return leading_hits(self.backend, keys, self.name)

    def touch(self, keys: Sequence[BlockKey], infos: Sequence[BlockInfo]) -> None:
        """Tell the backend a request used `keys` (`touch_blocks`); a backend that fails at it
        costs a log line, not the load."""
        try:
            self.backend.touch_blocks(keys, infos)
        except Exception as e:  # a plugin may raise anything; the load it is part of goes on
            log.warning("%s touch failed: %s: %s", self.name, type(e).__name__, e)

    def stats(self) -> dict[str, Any]:
        name = getattr(self.backend, "name", None) or type(self.backend).__name__
        if self.remote is not None:
            return {"backend": name, **self.remote.stats()}
        s = getattr(self.backend, "stats", None)
        occ = getattr(self.backend, "occupancy", None)  # a plugin written before the method may lack it
        used = occ() if occ is not None else None
        size = {} if used is None else {"used_bytes": used[0], "capacity_bytes": used[1]}
        count = {"entries": len(self.backend)} if hasattr(self.backend, "__len__") else {}
        return {"backend": name, **(vars(s) if s is not None else {}), **size, **count}

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()
        if self.remote is not None:
            self.remote.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.remote is not None:
            self.remote.close()  # closes the backend too
        else:
            self.backend.close()
