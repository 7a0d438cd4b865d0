"""KV event batches off the wire, as typed events: the decoding half of `kvtools.residency`.

Pure Python over msgpack (no torch, no zmq): a router plugin can import it with msgpack alone.

Wire (vLLM's KV events; engine/kv/kv_events.py publishes them): a multipart message [topic, 8-byte
big-endian sequence number, msgpack `[ts, [event, ...], data_parallel_rank?]`]. An event is a map
tagged "type" (BlockStored / BlockRemoved / AllBlocksCleared; unknown keys ignored, unknown types
kept as `UnknownEvent`) or the older array form kvtier emitted first: `["BlockStored", hashes,
parent, token_ids, block_size, medium]`, `["BlockRemoved", hashes, medium]` (vLLM's array form,
lora_id before medium, is read too).

Tiers from `medium` (+ `locality`): GPU -> G1, CPU -> G2, STORAGE (LOCAL or none) -> G3, STORAGE
REMOTE -> G4, the array form's DISK -> G3, no medium -> G1 (vLLM before media); any other: None
(the index counts it as "other").
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack

BlockHash = bytes | int  # vLLM's ExternalBlockHash; kvtier's keys are 16 bytes


class Tier(Enum):
    G1 = "G1"  # device blocks
    G2 = "G2"  # pinned host memory
    G3 = "G3"  # local disk
    G4 = "G4"  # remote (Redis), shared by replicas


class DecodeError(ValueError):
    """A message that is not a KV event batch. `seq`: its sequence number, when that was readable."""

    def __init__(self, message: str, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq


def tier_of(medium: str | None, locality: str | None = None) -> Tier | None:
    """The tier a medium names; None for a medium this module does not know."""
    if medium is None:
        return Tier.G1
    m = medium.upper()
    if m == "STORAGE":
        return {"LOCAL": Tier.G3, "REMOTE": Tier.G4}.get((locality or "LOCAL").upper())
    return {"GPU": Tier.G1, "CPU": Tier.G2, "DISK": Tier.G3}.get(m)


def _check_hash(h: object, what: str) -> None:
    if type(h) not in (bytes, int):
        raise ValueError(f"{what} must be bytes or an int, got {type(h).__name__}")


def _check_common(hashes: tuple, medium: object, locality: object, group_idx: object) -> None:
    if type(hashes) is not tuple:
        raise ValueError(f"block_hashes must be a tuple, got {type(hashes).__name__}")
    for h in hashes:
        _check_hash(h, "a block hash")
    if medium is not None and type(medium) is not str:
        raise ValueError(f"medium must be a string or None, got {medium!r}")
    if locality is not None and type(locality) is not str:
        raise ValueError(f"locality must be a string or None, got {locality!r}")
    if group_idx is not None and (type(group_idx) is not int or group_idx < 0):
        raise ValueError(f"group_idx must be an int >= 0 or None, got {group_idx!r}")


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]  # chained: each one's parent is the one before
    parent_block_hash: BlockHash | None
    block_size: int  # tokens per hash
    medium: str | None
    locality: str | None = None
    token_ids: tuple[int, ...] = ()
    group_idx: int | None = None

    def __post_init__(self) -> None:
        _check_common(self.block_hashes, self.medium, self.locality, self.group_idx)
        if self.parent_block_hash is not None:
            _check_hash(self.parent_block_hash, "parent_block_hash")
        if type(self.block_size) is not int or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if type(self.token_ids) is not tuple or any(type(t) is not int for t in self.token_ids):
            raise ValueError("token_ids must be a tuple of ints")

    @property
    def tier(self) -> Tier | None:
        return tier_of(self.medium, self.locality)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None
    locality: str | None = None
    group_idx: int | None = None

    def __post_init__(self) -> None:
        _check_common(self.block_hashes, self.medium, self.locality, self.group_idx)

    @property
    def tier(self) -> Tier | None:
        return tier_of(self.medium, self.locality)


@dataclass(frozen=True)
class Cleared:
    """AllBlocksCleared: the G1 prefix cache was reset."""


@dataclass(frozen=True)
class UnknownEvent:
    """An event type this module does not know (a newer publisher): counted, not applied."""

    kind: str


Event = BlockStored | BlockRemoved | Cleared | UnknownEvent


@dataclass(frozen=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None

    def __post_init__(self) -> None:
        if type(self.seq) is not int or self.seq < 0:
            raise ValueError(f"seq must be an int >= 0, got {self.seq!r}")
        if type(self.ts) not in (int, float):
            raise ValueError(f"ts must be a number, got {self.ts!r}")
        if type(self.events) is not tuple:
            raise ValueError("events must be a tuple")
        if self.dp_rank is not None and type(self.dp_rank) is not int:
            raise ValueError(f"dp_rank must be an int or None, got {self.dp_rank!r}")


# ---- decoding -------------------------------------------------------------------------------

def decode_event(raw: Any) -> Event:
    """One event, from its msgpack-decoded map or array form."""
    if isinstance(raw, dict):
        kind, get = raw.get("type"), raw.get
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind, get = raw[0], _array_getter(raw)
    else:
        raise DecodeError(f"an event is a map or a type-tagged array, got {type(raw).__name__}")
    if kind == "BlockStored":
        return BlockStored(_tuple(get("block_hashes")), get("parent_block_hash"), get("block_size"),
                           get("medium"), get("locality"), _tuple(get("token_ids") or []), get("group_idx"))
    if kind == "BlockRemoved":
        return BlockRemoved(_tuple(get("block_hashes")), get("medium"), get("locality"), get("group_idx"))
    if kind == "AllBlocksCleared":
        return Cleared()
    if not isinstance(kind, str):
        raise DecodeError(f"an event's type must be a string, got {kind!r}")
    return UnknownEvent(kind)


def _array_getter(raw: list[Any]) -> Any:
    """Field lookup for the array forms: kvtier's [tag, hashes, parent, token_ids, block_size, medium]
    and vLLM's [tag, hashes, parent, token_ids, block_size, lora_id, medium, ...]; removals are
    [tag, hashes, medium] in both."""
    if raw[0] == "BlockRemoved":
        fields = {"block_hashes": 1, "medium": 2}
    else:
        fields = {"block_hashes": 1, "parent_block_hash": 2, "token_ids": 3, "block_size": 4,
                  "medium": 5 if len(raw) == 6 else 6}
    return lambda key: raw[fields[key]] if key in fields and fields[key] < len(raw) else None


def _tuple(value: Any) -> tuple:
    if not isinstance(value, list):
        raise DecodeError(f"expected an array, got {type(value).__name__}")
    return tuple(value)


def decode_payload(payload: bytes, seq: int) -> EventBatch:
    """A batch from its msgpack payload; DecodeError (carrying `seq`) if it is not one."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
            raise DecodeError("a payload is [ts, [event, ...], dp_rank?]")
        return EventBatch(seq, obj[0], tuple(decode_event(e) for e in obj[1]), obj[2] if len(obj) > 2 else None)
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # DecodeError and the dataclasses' checks too
        raise DecodeError(f"undecodable batch {seq}: {e}", seq) from None


def decode_message(frames: Sequence[bytes]) -> EventBatch:
    """A batch from a ZMQ message's frames: [topic, 8-byte big-endian seq, payload]."""
    if len(frames) != 3:
        raise DecodeError(f"a KV event message has 3 frames (topic, seq, payload), got {len(frames)}")
    if len(frames[1]) != 8:
        raise DecodeError(f"the sequence frame is 8 bytes, got {len(frames[1])}")
    return decode_payload(frames[2], int.from_bytes(frames[1], "big"))
