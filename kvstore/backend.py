"""The storage-backend plugin API: what most plugin authors implement.

A backend stores and fetches whole KV blocks by key. The tiered offload connector stacks
backends as tiers; kvtier's own G3 (`kvstore.disk.DiskBackend`) is one, and
`kvstore.memory.MemoryBackend` is the plain reference. Run `connectors.conformance` against
a new backend to check it keeps this contract.

It lives in `kvstore` (tiers are backends) and `connectors.backend` re-exports it: plugin
authors import it from either place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstore.keys import KEY_BYTES, BlockKey
from policies import BlockInfo

Buffer = Any  # bytes, bytearray, memoryview: anything exposing the buffer protocol

# The bytes one read or write of a storage tier groups: G3's file size and its reads' size, and
# how many blocks a parallel tier's reader and writer hand a backend per call. Measured in
# docs/performance/tier-io.md: per-file and per-call overhead stops mattering at a few MiB.
IO_BYTES = 4 * 2**20



@dataclass(frozen=True, eq=False)
class Scatter:
    """Where one value goes when it is not one buffer: `lengths[i]` bytes at the raw address
    `addresses[i]`, in order (the pieces of the G1 blocks a stored entry fills). The caller owns
    that memory: it stays allocated and untouched by anyone else until the read returns, and
    after a False its contents are unspecified."""

    addresses: np.ndarray  # int64
    lengths: np.ndarray  # int64, each > 0
    # What owns the memory (a tensor, a buffer), kept alive with this: a read that outlives its
    # caller's timeout must still land in memory that exists.
    keep: Any = field(default=None, repr=False)
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        # The addresses are trusted (they are raw memory: no check could make a wrong one safe);
        # the shapes and lengths are cheap to check, and a negative length would be a huge one.
        if self.addresses.shape != self.lengths.shape or self.addresses.ndim != 1 or not len(self.addresses):
            raise ValueError(f"Scatter needs two 1-D arrays of one non-zero length; got {self.addresses.shape} "
                             f"and {self.lengths.shape}")
        if self.lengths.min() <= 0:
            raise ValueError("Scatter pieces need positive lengths")
        object.__setattr__(self, "nbytes", int(self.lengths.sum()))

    def moved(self, addresses: np.ndarray, keep: Any = None) -> Scatter:
        """The same pieces at other `addresses` (owned by `keep`): lengths checked once, for a
        caller that makes many values of one shape (hundreds per load)."""
        if addresses.shape != self.lengths.shape:
            raise ValueError(f"Scatter.moved needs {self.lengths.shape} addresses; got {addresses.shape}")
        out = object.__new__(Scatter)
        for name, value in (("addresses", addresses), ("lengths", self.lengths), ("keep", keep),
                            ("nbytes", self.nbytes)):
            object.__setattr__(out, name, value)
        return out

    def views(self) -> list[memoryview]:
        """The pieces as writable byte views (valid while the caller's memory is)."""
        import ctypes

        return [memoryview((ctypes.c_char * int(n)).from_address(int(a))).cast("B")
                for a, n in zip(self.addresses, self.lengths)]


@dataclass(frozen=True, eq=False)
class ScatterBatch:
    """Where each of n values goes, as one set of arrays (a load's hundreds of values without an
    object each): value i is pieces `starts[i]:starts[i + 1]` of `addresses` / `lengths`, in order.
    Memory as for `Scatter`: the caller's, alive (`keep`) and untouched until the read returns."""

    starts: np.ndarray  # int64 [n + 1], non-decreasing from 0, each value at least one piece
    addresses: np.ndarray  # int64 [pieces]
    lengths: np.ndarray  # int64 [pieces], each > 0
    keep: Any = field(default=None, repr=False)
    value_bytes: np.ndarray = field(init=False, repr=False)  # int64 [n]: each value's size

    def __post_init__(self) -> None:
        s, a, n = self.starts, self.addresses, self.lengths
        if s.ndim != 1 or len(s) < 1 or a.ndim != 1 or a.shape != n.shape or s[0] != 0 or s[-1] != len(a):
            raise ValueError(f"ScatterBatch needs starts [n+1] from 0 to the piece count and two 1-D piece arrays "
                             f"of one length; got {s.shape}, {a.shape}, {n.shape}")
        if len(s) > 1 and np.diff(s).min() <= 0:
            raise ValueError("ScatterBatch values need at least one piece each")
        if len(n) and n.min() <= 0:
            raise ValueError("ScatterBatch pieces need positive lengths")
        sums = np.add.reduceat(n, s[:-1]) if len(s) > 1 else np.zeros(0, np.int64)
        object.__setattr__(self, "value_bytes", sums.astype(np.int64))

    def __len__(self) -> int:
        return len(self.starts) - 1

    def scatter(self, i: int) -> Scatter:
        """Value i's pieces as a `Scatter`."""
        lo, hi = int(self.starts[i]), int(self.starts[i + 1])
        return Scatter(self.addresses[lo:hi], self.lengths[lo:hi], keep=self.keep)


class ScatterReads(ABC):
    """A backend whose `get_into` also takes `Scatter` outputs: it reads a value straight into
    its final places, saving the copy out of a buffer. Optional: kvtier passes Scatter outputs
    only while `scatter_reads` is True, and plain buffers otherwise."""

    @property
    @abstractmethod
    def scatter_reads(self) -> bool:
        """Whether Scatter outputs are worth using here, and safe: a read that outlives the
        caller's timeout still returns (the caller waits for it before reusing the memory)."""

    def get_into_batch(self, keys: Sequence[BlockKey], batch: ScatterBatch, threads: int = 1) -> list[bool]:
        """`get_into(keys, [batch.scatter(i) ...])`: a whole load's values in one call, with at most
        `threads` reads at once. Override it where one call can do better than a loop (G3: one native
        call, files spread over its own threads)."""
        if len(keys) != len(batch):
            raise ValueError(f"get_into_batch got {len(keys)} keys but {len(batch)} values")
        return self.get_into(keys, [batch.scatter(i) for i in range(len(batch))])  # type: ignore[attr-defined]

class BackendError(RuntimeError):
    """The backend cannot serve the call at all (closed, misconfigured, unreachable).

    Callers turn it into misses; a backend raises it instead of returning wrong bytes.
    """


@dataclass
class BackendStats:
    """Counters a backend keeps (mutated under the backend's lock; read without one)."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    corrupt: int = 0  # entries found damaged, torn or mismatched: never served, removed
    write_errors: int = 0
    read_seconds: float = 0.0  # time in read system calls (summed over threads), where the backend measures it
    check_seconds: float = 0.0  # time verifying what was read (checksums, MACs), likewise


class StorageBackend(ABC):
    """Stores and fetches whole KV blocks by key.

    Keys: `BlockKey`, exactly 16 `bytes`. Anything else raises TypeError (not bytes) or
    ValueError (wrong length); `check_keys` does this for you.

    Payloads: opaque bytes of any length, including 0 (kvtier passes encoded blocks, which
    already carry their token digest and layout). `put` accepts any C-contiguous buffer
    (bytes, bytearray, memoryview) and must copy what it needs before returning: callers
    reuse their buffers at once.

    Batches: every method takes a sequence of keys and answers one result per key, in
    order; a key may repeat. Invalid arguments (bad keys, non-buffer blocks, parallel
    sequences of different lengths) raise TypeError/ValueError before anything changes.

    Misses, not errors: an unknown key is a miss (None / False). A backend may drop
    entries at any time (eviction, corruption, a lost disk) but must then report misses.
    It must NEVER return bytes that no `put` stored for that key (damaged, torn, another
    key's), nor, once a `put` has returned True, an older value (a stale one) to a read
    that starts afterwards. A backend that cannot work at all raises BackendError; kvtier
    turns that into misses.

    Threads: all methods are called concurrently from transfer worker threads, and must
    be safe under that.

    `close()` is idempotent, flushes pending writes and releases resources; every other
    method raises BackendError afterwards.

    `shared`: True for a store other processes or machines can write to (Redis, an object
    store). kvtier then refuses to use it as a tier without a KV secret (entries MAC'd, so a
    writer without the secret cannot plant KV), unless the operator declares the store trusted
    (`--kv-offload-remote-trusted`).
    """

    shared: bool = False

    @abstractmethod
    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key is (probably) stored. A hint: a later `get` may still miss."""

    @abstractmethod
    def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        """The stored bytes of each key, or None for a miss."""

    @abstractmethod
    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Buffer]) -> list[bool]:
        """Store `blocks[i]` under `keys[i]`, replacing any previous value.

        True = stored; False = refused (full, unwritable, block larger than capacity), in
        which case the previous value may or may not survive. Never raises for a refusal.
        """

    @abstractmethod
    def delete(self, keys: Sequence[BlockKey]) -> None:
        """Remove the keys; unknown keys are ignored."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release; idempotent. Other methods raise BackendError afterwards."""

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[Buffer]) -> list[bool]:
        """Fill the writable buffer `outs[i]` with the value of `keys[i]`.

        True = filled with exactly the stored bytes. False = miss, or the stored value's
        length differs from the buffer's (exact match required); a False buffer's contents
        are unspecified. This default copies out of `get`; backends override it to read
        straight into the caller's memory (pinned host buffers).
        """
        views = check_outs(keys, outs)
        filled = []
        for value, out in zip(self.get(keys), views):
            ok = value is not None and len(value) == out.nbytes
            if ok:
                out[:] = value
            filled.append(ok)
        return filled

    def get_views(self, keys: Sequence[BlockKey]) -> list[memoryview | None]:
        """`get`, as read-only views of the bytes the backend holds or received, where it can
        give them without a copy (a remote store's replies); None for a miss. Valid until the
        caller drops them. This default wraps `get`."""
        return [None if v is None else memoryview(v) for v in self.get(keys)]

    def occupancy(self) -> tuple[int, int | None] | None:
        """(bytes stored, capacity in bytes or None if unbounded), as /v1/kv/stats and the dashboard
        show it; None (the default) when the backend cannot tell cheaply (a shared Redis)."""
        return None

    def touch(self, keys: Sequence[BlockKey], priority: int) -> None:
        """A request of `priority` (lower = more urgent, as in `policies`) stored or read these
        keys. A backend with its own eviction may keep urgent blocks longer; unknown keys are
        ignored. The default does nothing (a store without eviction, or one that evicts by
        itself, like Redis)."""
        check_keys(keys)

    def touch_blocks(self, keys: Sequence[BlockKey], infos: Sequence[BlockInfo]) -> None:
        """`touch` with what kvtier knows of each use (`policies.BlockInfo`: the block's index in
        its prompt, the key of the block before it, the using request's arrival, priority and
        session), for a backend whose eviction policy uses more than the priority. kvtier calls
        it once for every block a load took from this tier. The default calls `touch` with each
        block's priority."""
        check_infos(keys, infos)
        for key, info in zip(keys, infos):
            self.touch([key], info.priority)

    def put_blocks(self, keys: Sequence[BlockKey], blocks: Sequence[Buffer], infos: Sequence[BlockInfo]) -> list[bool]:
        """`put` with what kvtier knows of each block (as in `touch_blocks`), which is how
        kvtier writes to a tier. The default is `put`, then `touch_blocks` of the stored ones."""
        check_infos(keys, infos)
        stored = self.put(keys, blocks)
        kept = [(k, i) for k, i, ok in zip(keys, infos, stored) if ok]
        if kept:
            self.touch_blocks([k for k, _ in kept], [i for _, i in kept])
        return stored

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_infos(keys: Sequence[BlockKey], infos: Sequence[BlockInfo]) -> None:
    """Validate a `touch_blocks` / `put_blocks` call's keys and infos."""
    check_keys(keys)
    if len(keys) != len(infos):
        raise ValueError(f"got {len(keys)} keys but {len(infos)} block infos")


def check_keys(keys: Sequence[BlockKey]) -> None:
    """Raise TypeError/ValueError unless every key is 16 `bytes`."""
    if isinstance(keys, (bytes, bytearray, str)):
        raise TypeError("keys must be a sequence of keys, not a single bytes/str object")
    for key in keys:
        if type(key) is not bytes:  # bytearray is mutable and unhashable: not a key
            raise TypeError(f"block keys must be bytes, got {type(key).__name__}")
        if len(key) != KEY_BYTES:
            raise ValueError(f"block keys must be {KEY_BYTES} bytes, got {len(key)}")


def byte_view(block: Buffer, *, writable: bool = False) -> memoryview:
    """`block` as a flat unsigned-byte memoryview; TypeError/ValueError if it cannot be."""
    if isinstance(block, str):
        raise TypeError("blocks must be bytes-like, not str")
    view = memoryview(block)  # TypeError for non-buffers
    if writable and view.readonly:
        raise ValueError("output buffer is read-only")
    if not view.c_contiguous:
        raise ValueError("blocks must be C-contiguous buffers")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def check_blocks(keys: Sequence[BlockKey], blocks: Sequence[Buffer]) -> list[memoryview]:
    """Validate a `put` call; returns the blocks as byte views."""
    check_keys(keys)
    if len(keys) != len(blocks):
        raise ValueError(f"put got {len(keys)} keys but {len(blocks)} blocks")
    return [byte_view(b) for b in blocks]


def check_outs(keys: Sequence[BlockKey], outs: Sequence[Buffer]) -> list[memoryview]:
    """Validate a `get_into` call; returns the outputs as writable byte views."""
    check_keys(keys)
    if len(keys) != len(outs):
        raise ValueError(f"get_into got {len(keys)} keys but {len(outs)} buffers")
    return [byte_view(o, writable=True) for o in outs]


def check_scatter_outs(keys: Sequence[BlockKey], outs: Sequence[Buffer | Scatter]) -> list[memoryview | Scatter]:
    """`check_outs` for a `ScatterReads` backend: Scatter outputs pass as they are."""
    check_keys(keys)
    if len(keys) != len(outs):
        raise ValueError(f"get_into got {len(keys)} keys but {len(outs)} buffers")
    return [o if isinstance(o, Scatter) else byte_view(o, writable=True) for o in outs]

