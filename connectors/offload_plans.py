"""The plans the offload planner (scheduler side) hands the transfer engine (worker side).

Frozen: once the planner has made a plan, nothing changes it; the transfer engine reports what
happened through `LoadDone` / `StoreDone`."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvstore.g1 import BlockId
from kvstore.keys import BlockKey


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


@dataclass(frozen=True)
class LoadJob:
    """Fill `dst` (G1 blocks, in order) from `chunks`."""

    req_id: str
    chunks: tuple[Chunk, ...]
    first_g1: int  # G1 block index (within the request) of the first block to fill
    dst: tuple[BlockId, ...]
    end_token: int  # the load supplies tokens before this one (the last block may hold more)
    g2_slots: dict[BlockKey, int] = field(default_factory=dict)  # pinned by the planner
    priority: int = 0  # the request's: blocks promoted into G2 on the way are inserted with it
    group: int = 0  # the KV group whose blocks `dst` are (tier hits count group 0's tokens only)
    skipped_tokens: int = 0  # tokens of the hit before `first_g1`: out of a sliding group's window, not loaded


@dataclass(frozen=True)
class StoreJob:
    """Copy the G1 blocks `src` (held by the planner until done) down as offload block `key`."""

    key: BlockKey
    digest: bytes
    src: tuple[BlockId, ...]
    priority: int


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
