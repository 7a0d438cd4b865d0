"""KV cache events: which tier holds which block, for cache-aware routers.

Tiers append events to one `EventBuffer`; the engine drains it once per step and publishes
the batch in vLLM's wire format (engine/kv/kv_events.py). Each event names the tier that changed
as a `TierKind`, which maps to vLLM's `medium` and `locality` here and nowhere else.

Every event describes G1 token blocks, named by their G1 block keys (`kvstore.keys`), so a
router chains all tiers' events alike. An offload block (a "chunk" of several G1 blocks) is
announced with the keys, parent and tokens of the G1 blocks it holds (`ChunkBlocks`), as vLLM's
offloading connector does with `self_describing_kv_events`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum

from kvstore.keys import BlockKey

# The ZMQ topic events go out under unless kv_events_config names one: vLLM's default, the only one
# vllm-router's kv_aware subscriber receives.
DEFAULT_TOPIC = ""


class TierKind(Enum):
    """Where a block lives, as (vLLM medium, locality). Mediums and localities are vLLM's
    (vllm/distributed/kv_events.py MEDIUM_*, vllm/v1/kv_offload/base.py Medium and Locality).
    The default stack's G1..G4 are one each; in an explicit stack a parallel storage tier
    (the disk, most plugins) is local storage and a batched one (Redis/Valkey) remote."""

    DEVICE = ("GPU", None)  # G1: the paged blocks on the accelerator (vLLM sends no locality)
    HOST = ("CPU", "LOCAL")  # G2: host memory
    LOCAL_STORAGE = ("STORAGE", "LOCAL")  # G3: this machine's disk
    REMOTE_STORAGE = ("STORAGE", "REMOTE")  # G4: Redis/Valkey, shared by engines

    @property
    def medium(self) -> str:
        return self.value[0]

    @property
    def locality(self) -> str | None:
        return self.value[1]


@dataclass(frozen=True)
class LoRATag:
    """The LoRA adapter a block's KV was computed under, as events name it (vLLM's `lora_name`
    and `lora_id`). `id` comes from the digest of the adapter's files, not from a number a client
    picked: every engine that loads the same files sends the same id, and a changed adapter
    another one, as its block keys differ."""
    name: str
    id: int

    @classmethod
    def of(cls, name: str, digest: bytes) -> LoRATag:
        return cls(name, int.from_bytes(digest[:4], "big") & 0x7FFFFFFF or 1)  # a positive int32, as vLLM's


@dataclass(frozen=True)
class ChunkBlocks:
    """The G1 blocks one offload block holds, as its events describe them: scheduler-side
    metadata that travels with a store or load plan to the tier that announces the block."""

    block_hashes: tuple[BlockKey, ...]  # the G1 keys of its blocks, in order (the last is the chunk's key)
    parent_block_hash: BlockKey | None  # the G1 key of the block before it; None at a prompt's start
    token_ids: tuple[int, ...]
    block_size: int  # G1's, so a router splits token_ids into the same blocks as the G1 events
    lora: LoRATag | None = None  # the adapter they were computed under; None: the base model


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[BlockKey]
    parent_block_hash: BlockKey | None
    token_ids: list[int]
    block_size: int
    tier: TierKind
    lora: LoRATag | None = None

    @classmethod
    def of(cls, blocks: ChunkBlocks, tier: TierKind) -> BlockStored:
        return cls(list(blocks.block_hashes), blocks.parent_block_hash, list(blocks.token_ids), blocks.block_size, tier,
                   blocks.lora)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[BlockKey]
    tier: TierKind


KVEvent = BlockStored | BlockRemoved


class EventBuffer:
    """Thread-safe append-only buffer (transfer threads report G2/G3/G4 changes)."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()

    def append(self, event: KVEvent) -> None:
        with self._lock:
            self._events.append(event)

    def drain(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events
