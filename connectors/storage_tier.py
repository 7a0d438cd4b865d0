"""A storage tier below host memory (G2): a `StorageBackend` and how the connector uses it.

The connector holds an ordered list of these and names none of them: lookups walk the list
top-down, a hit is promoted up (into G2, and written to every parallel tier above the one that
served it), and a stored block goes to every tier (written at once to parallel tiers, offered to
batched tiers, which write it once it has been used `min_uses` times).

Two read/write modes, one per kind of store:
- `PARALLEL` (a local disk, a plugin): reads of up to `io_bytes` of neighbouring blocks per call,
  `2 * read_threads` calls in flight, each bounded by `read_timeout_s`; writes in order on one
  thread, straight from the pinned G2 slot, the writes queued meanwhile in one call,
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
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from connectors.backend import StorageBackend
from kvstore.backend import IO_BYTES, ScatterReads
from connectors.remote_tier import RemoteTier, leading_hits
from kvstore.threads import one_torch_thread
from kvstore.events import BlockStored, ChunkBlocks, EventBuffer, TierKind
from kvstore.keys import BlockKey
from policies import BlockInfo

log = logging.getLogger(__name__)


USES_REMEMBERED = 1 << 20  # keys whose use counts a tier with min_uses > 1 keeps (LRU)


class Admission(Enum):
    """What a parallel tier does with a block a request stored or reused (`StorageTier.admission`)."""
    WRITE = "write"
    HELD = "held"  # it holds the key already
    NOT_YET = "not yet"  # fewer uses than its min_uses


class TierMode(Enum):
    PARALLEL = "parallel"
    BATCHED = "batched"


@dataclass(frozen=True)
class _Write:
    key: BlockKey
    buf: torch.Tensor  # valid until done() is called
    done: Callable[[], None]
    info: BlockInfo
    blocks: ChunkBlocks | None


class OrderedWriter:
    """A parallel tier's writes: one thread, in order, bounded. Writes queued while the thread
    was busy go to the backend together in one `put_blocks` call of up to `batch_bytes` (at least
    one write): G3 makes each call's blocks one file, so a prefill's blocks reach the disk in
    files of I/O size rather than one small file each."""

    kind = TierKind.LOCAL_STORAGE  # what its KV events call it

    def __init__(self, name: str, backend: StorageBackend, max_pending: int, events: EventBuffer | None,
                 batch_bytes: int = IO_BYTES) -> None:
        self.name, self.backend, self.events, self.batch_bytes = name, backend, events, batch_bytes
        self._slots = threading.BoundedSemaphore(max_pending)
        self._queue: deque[_Write] = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self.batches = 0  # put_blocks calls made
        self.queued_bytes = 0  # of writes accepted and not yet written (backpressure, in /v1/kv/stats)
        self.dropped = 0  # writes refused because the queue was full (the step loop's write-backs)
        self._thread = threading.Thread(target=self._run, name=f"kvtier-{name.lower()}-write", daemon=True)
        self._thread.start()

    def submit(self, key: BlockKey, buf: torch.Tensor, done: Callable[[], None], wait: bool,
               info: BlockInfo, blocks: ChunkBlocks | None = None) -> bool:
        """Queue `buf` (valid until `done()` is called) for `key`, the block `info` describes and
        `blocks` names to KV events (None: not announced). False, with `done()` already called,
        when `wait` is False and the queue is full."""
        if not self._slots.acquire(blocking=wait):
            self.dropped += 1
            done()
            return False
        with self._cv:
            self.queued_bytes += buf.numel()
            self._queue.append(_Write(key, buf, done, info, blocks))
            self._cv.notify_all()
        return True

    def _run(self) -> None:
        one_torch_thread()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch, size = [self._queue.popleft()], 0
                size = batch[0].buf.numel()
                while self._queue and size + self._queue[0].buf.numel() <= self.batch_bytes:
                    size += self._queue[0].buf.numel()
                    batch.append(self._queue.popleft())
                self._busy = True
            try:
                self._write(batch)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, batch: list[_Write]) -> None:
        try:
            # With their BlockInfos: the storing requests' priorities (and the rest) reach the tier's policy.
            stored = self.backend.put_blocks([w.key for w in batch], [memoryview(w.buf.numpy()) for w in batch],
                                             [w.info for w in batch])
            self.batches += 1
            for w, ok in zip(batch, stored):
                if ok and self.events is not None and w.blocks is not None:
                    self.events.append(BlockStored.of(w.blocks, self.kind))
        except Exception as e:  # a plugin may raise anything: the writes are lost, never the thread
            log.warning("%s write failed (blocks stay in the tiers above): %s: %s", self.name, type(e).__name__, e)
        finally:
            for w in batch:
                w.done()
                self._slots.release()
            with self._cv:
                self.queued_bytes -= sum(w.buf.numel() for w in batch)

    def flush(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not self._queue and not self._busy)

    def close(self) -> None:
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()


@dataclass(eq=False)
class StorageTier:
    name: str  # what stats, metrics and per-request hit counts call it
    backend: StorageBackend
    mode: TierMode
    read_threads: int = 4  # PARALLEL: reads in flight
    read_timeout_s: float = 10.0  # PARALLEL: a read later than this is a miss
    remote: RemoteTier | None = None  # BATCHED: the reuse-gated batched writer and reader
    writer: OrderedWriter | None = field(default=None, repr=False)  # PARALLEL
    io_bytes: int = IO_BYTES  # PARALLEL: the bytes one read or write call groups
    # PARALLEL: admission. A block is written once it has been used (stored or reused from G2) this
    # many times; 1 writes every stored block (benchmarks/admission.py measures the choice).
    min_uses: int = 1
    _uses: OrderedDict[BlockKey, int] = field(default_factory=OrderedDict, repr=False)
    _uses_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.read_threads < 1:
            raise ValueError(f"{self.name}: read_threads must be >= 1; got {self.read_threads}")
        if self.read_timeout_s <= 0:
            raise ValueError(f"{self.name}: read_timeout_s must be > 0; got {self.read_timeout_s}")
        if self.min_uses < 1:
            raise ValueError(f"{self.name}: min_uses must be >= 1; got {self.min_uses}")
        if self.io_bytes < 1:
            raise ValueError(f"{self.name}: io_bytes must be >= 1; got {self.io_bytes}")
        if (self.mode is TierMode.BATCHED) != (self.remote is not None):
            raise ValueError(f"{self.name}: a batched tier needs its RemoteTier, a parallel one none")

    @classmethod
    def parallel(cls, name: str, backend: StorageBackend, *, read_threads: int = 4, read_timeout_s: float = 10.0,
                 max_pending_writes: int = 64, events: EventBuffer | None = None,
                 io_bytes: int = IO_BYTES, min_uses: int = 1) -> StorageTier:
        writer = OrderedWriter(name, backend, max_pending_writes, events, io_bytes)
        return cls(name, backend, TierMode.PARALLEL, read_threads, read_timeout_s, writer=writer, io_bytes=io_bytes,
                   min_uses=min_uses)

    def admit(self, key: BlockKey, info: BlockInfo | None = None) -> bool:
        """Whether to write `key` to this parallel tier now (`admission` is WRITE)."""
        return self.admission(key, info) is Admission.WRITE

    def admission(self, key: BlockKey, info: BlockInfo | None = None) -> Admission:
        """A use of `key` (a store or a reuse, of the block `info` describes): what this parallel
        tier does with it. HELD while the tier holds it: a key names its bytes, so a write would
        only repeat them (the engine recomputes and stores again the block after a repeated
        prompt's hit); the use touches the tier's copy instead. With min_uses above 1, NOT_YET
        until its uses reach min_uses. Uses are remembered for the last USES_REMEMBERED keys."""
        if self.min_uses > 1:
            with self._uses_lock:
                n = self._uses.pop(key, 0) + 1
                self._uses[key] = n
                if len(self._uses) > USES_REMEMBERED:
                    self._uses.popitem(last=False)
            if n < self.min_uses:
                return Admission.NOT_YET
        try:
            held = self.backend.exists([key])[0]
        except Exception as e:  # a plugin may raise anything: then write (a write that fails is logged)
            log.warning("%s exists failed: %s: %s", self.name, type(e).__name__, e)
            return Admission.WRITE
        if not held:
            return Admission.WRITE
        if info is not None:
            self.touch([key], [info])
        return Admission.HELD

    @property
    def scatter_reads(self) -> bool:
        """Whether its backend's get_into takes `Scatter` outputs now (`ScatterReads`)."""
        return isinstance(self.backend, ScatterReads) and self.backend.scatter_reads

    def io_chunks(self, chunk_bytes: int) -> int:
        """How many chunks of `chunk_bytes` one read call asks for (at least one)."""
        return max(1, self.io_bytes // chunk_bytes)

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
        queue = {} if self.writer is None else {"queued_write_bytes": self.writer.queued_bytes,
                                                "dropped_writes": self.writer.dropped}
        return {"backend": name, **(vars(s) if s is not None else {}), **size, **count, **queue}

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
