"""KV cache events: which tier holds which block, for cache-aware routers.

Tiers append events to one `EventBuffer`; the engine drains it once per step and publishes
the batch (engine/kv_events.py). Event fields follow vLLM's KV events (BlockStored /
BlockRemoved with a `medium`), with kvtier's tier names as the medium.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str  # "GPU" (G1), "CPU" (G2), "DISK" (G3)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str


KVEvent = BlockStored | BlockRemoved


class EventBuffer:
    """Thread-safe append-only buffer (transfer threads report G2/G3 changes)."""

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
