"""Offload plans and their reports on the wire between tensor-parallel ranks (msgspec Structs,
never pickle): rank 0 sends `Transfers` (the loads and stores its connector planned), each worker
answers `TransfersDone` as its own transfer engine finishes them (connectors/sharded.py).

What crosses is what a worker needs to move its shard: keys, digests, G1 block ids, the policy
hints. Rank 0's G2 slots and KV-event metadata stay on rank 0 (a worker looks its own up)."""
from __future__ import annotations

import msgspec

from connectors.offload_plans import Chunk, LoadDone, LoadJob, StoreDone, StoreJob
from kvstore.g1 import BlockId
from kvstore.keys import BlockKey
from policies import BlockInfo


class WireInfo(msgspec.Struct, array_like=True):
    depth: int
    parent: bytes | None
    arrival: float
    priority: int
    session: str | None

    @classmethod
    def of(cls, info: BlockInfo) -> WireInfo:
        parent = info.parent
        if parent is not None and not isinstance(parent, bytes):
            raise TypeError(f"a block's parent key must be bytes to cross ranks; got {type(parent).__name__}")
        return cls(info.depth, parent, info.arrival, info.priority, info.session)

    def info(self) -> BlockInfo:
        return BlockInfo(self.depth, None if self.parent is None else BlockKey(self.parent), self.arrival,
                         self.priority, self.session)


class WireChunk(msgspec.Struct, array_like=True):
    index: int
    key: bytes
    digest: bytes
    tier: str
    parent: bytes | None


class WireLoad(msgspec.Struct, array_like=True):
    req_id: str
    chunks: list[WireChunk]
    first_g1: int
    dst: list[int]
    end_token: int
    info: WireInfo
    group: int
    skipped_tokens: int


class WireStore(msgspec.Struct, array_like=True):
    key: bytes
    digest: bytes
    src: list[int]
    info: WireInfo


class Transfers(msgspec.Struct, tag="transfers"):
    loads: list[WireLoad]
    stores: list[WireStore]


class FlushTransfers(msgspec.Struct, tag="flush"):
    pass


class TransfersDone(msgspec.Struct, tag="done"):
    rank: int
    loads: list[tuple[str, int, int]]  # (request id, KV group, G1 blocks filled from the first)
    stores: list[bytes]  # keys copied out of G1


class Flushed(msgspec.Struct, tag="flushed"):
    rank: int


def to_wire(loads: list[LoadJob], stores: list[StoreJob]) -> Transfers:
    return Transfers(
        [WireLoad(j.req_id, [WireChunk(c.index, c.key, c.digest, c.tier, c.parent) for c in j.chunks], j.first_g1,
                  list(j.dst), j.end_token, WireInfo.of(j.info), j.group, j.skipped_tokens) for j in loads],
        [WireStore(s.key, s.digest, list(s.src), WireInfo.of(s.info)) for s in stores])


def load_of(w: WireLoad) -> LoadJob:
    chunks = tuple(Chunk(c.index, BlockKey(c.key), c.digest, c.tier, None if c.parent is None else BlockKey(c.parent))
                   for c in w.chunks)
    return LoadJob(w.req_id, chunks, w.first_g1, tuple(BlockId(b) for b in w.dst), w.end_token, {}, w.info.info(),
                   w.group, w.skipped_tokens)


def store_of(w: WireStore) -> StoreJob:
    return StoreJob(BlockKey(w.key), w.digest, tuple(BlockId(b) for b in w.src), w.info.info())


def done_of(rank: int, reports: list[LoadDone | StoreDone]) -> TransfersDone:
    return TransfersDone(rank, [(r.req_id, r.group, r.num_filled) for r in reports if isinstance(r, LoadDone)],
                         [r.key for r in reports if isinstance(r, StoreDone)])


def reports_of(msg: TransfersDone) -> list[LoadDone | StoreDone]:
    """A worker's reports as rank 0's aggregation reads them (`failed_blocks` is rank 0's to work out)."""
    return [LoadDone(rid, (), group, filled) for rid, group, filled in msg.loads] + [
        StoreDone(BlockKey(k)) for k in msg.stores]
