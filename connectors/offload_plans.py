"""The plans the offload planner (scheduler side) hands the transfer engine (worker side).

Frozen: once the planner has made a plan, nothing changes it; the transfer engine reports what
happened through `LoadDone` / `StoreDone`."""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field, replace
from enum import Enum

from kvstore.events import ChunkBlocks
from kvstore.g1 import NO_INFO, BlockId
from kvstore.keys import BlockKey
from kvstore.threads import drain
from policies import BlockInfo


class WritePolicy(Enum):
    """When G1 blocks are copied down (SGLang HiCache's names)."""

    WRITE_THROUGH = "write_through"  # as soon as an offload block fills: asynchronous, the default
    WRITE_BACK = "write_back"  # when G1 evicts it: less copying, but a copy on the step loop


@dataclass(frozen=True)
class Chunk:
    """One offload block of a request, found in `tier` at lookup."""

    index: int  # offload block index within the request
    key: BlockKey
    digest: bytes
    tier: str  # the name of the tier that holds it
    parent: BlockKey | None = None  # the key of the request's offload block before it (same KV group)
    # Its G1 blocks, for the KV events of a tier it is promoted or written to on the way
    # (group 0's chunks while KV events are on; else None, and those writes are not announced).
    blocks: ChunkBlocks | None = None


@dataclass(frozen=True)
class LoadJob:
    """Fill `dst` (G1 blocks, in order) from `chunks`."""

    req_id: str
    chunks: tuple[Chunk, ...]
    first_g1: int  # G1 block index (within the request) of the first block to fill
    dst: tuple[BlockId, ...]
    end_token: int  # the load supplies tokens before this one (the last block may hold more)
    g2_slots: dict[BlockKey, int] = field(default_factory=dict)  # pinned by the planner
    # The request's arrival, priority and session: what the tiers' policies get for each chunk
    # (`chunk_info`), as a use of a tier that served it and on promotion into G2.
    info: BlockInfo = NO_INFO
    group: int = 0  # the KV group whose blocks `dst` are (tier hits count group 0's tokens only)
    skipped_tokens: int = 0  # tokens of the hit before `first_g1`: out of a sliding group's window, not loaded

    def chunk_info(self, c: Chunk) -> BlockInfo:
        return replace(self.info, depth=c.index, parent=c.parent)

    def full_chunk_blocks(self, c: Chunk, g1_per_chunk: int) -> list[BlockId] | None:
        """The G1 blocks chunk `c` fills, or None when some of its blocks are in G1 already
        (before `first_g1`: shared, never a read target)."""
        start = c.index * g1_per_chunk - self.first_g1
        blocks = self.dst[start:start + g1_per_chunk] if start >= 0 else ()
        return list(blocks) if len(blocks) == g1_per_chunk else None


@dataclass(frozen=True)
class StoreJob:
    """Copy the G1 blocks `src` (held by the planner until done) down as offload block `key`."""

    key: BlockKey
    digest: bytes
    src: tuple[BlockId, ...]
    info: BlockInfo  # the offload block's index and parent in the request, and the request's use
    # The G1 blocks it holds, named in each tier's BlockStored for it (None: KV events are off,
    # or a KV group's other than the first: events describe token blocks, not groups).
    blocks: ChunkBlocks | None = None


@dataclass(frozen=True)
class LoadDone:
    """A load finished; `failed_blocks` are the destination blocks it did not fill (those after
    the first `num_filled`)."""

    req_id: str
    failed_blocks: tuple[BlockId, ...]
    group: int = 0
    num_filled: int = 0


@dataclass(frozen=True)
class StoreDone:
    """A store finished copying out of G1: the planner may release its G1 blocks."""

    key: BlockKey


class Reports:
    """The transfer engine's finished loads and stores, in order, for the connector to drain; and
    the event an idle engine sleeps on until one arrives."""

    def __init__(self) -> None:
        self._done: queue.SimpleQueue[LoadDone | StoreDone] = queue.SimpleQueue()
        self._progress = threading.Event()  # set with every item

    def put(self, item: LoadDone | StoreDone) -> None:
        self._done.put(item)
        self._progress.set()

    def drain(self) -> list[LoadDone | StoreDone]:
        """Everything finished since the last call, in order."""
        return drain(self._done)

    def wake(self) -> None:
        """Ends a `wait` now (another rank reported a transfer: connectors/sharded.py)."""
        self._progress.set()

    def wait(self, timeout: float) -> None:
        # A set that lands between wait() and clear() is not lost: its item is already queued,
        # and the engine drains the queue before it waits again.
        self._progress.wait(timeout)
        self._progress.clear()

