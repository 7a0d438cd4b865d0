"""A batched tier's write queue (connectors/remote_tier.py) is bounded in bytes: writes beyond the
bound are dropped and counted, never waited for, and a dropped block may be offered again. Oracle:
the backend's own contents (kvstore's reference MemoryBackend behind a gate that holds its writes)."""
from __future__ import annotations

import threading

from connectors.remote_tier import RemoteTier
from kvstore.keys import BlockKey
from kvstore.memory import MemoryBackend


class GatedBackend(MemoryBackend):
    """Writes wait for `gate`: the remote is slower than the engine until it opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def put(self, keys, blocks):
        self.gate.wait(10)
        return super().put(keys, blocks)


def _key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def test_writes_beyond_the_byte_bound_are_dropped_and_can_be_offered_again():
    backend = GatedBackend()
    tier = RemoteTier(backend, name="G4", batch=1, max_pending_bytes=300)
    try:
        for i in range(5):  # 100 bytes each: three fit (one of them in the writer's hands)
            tier.note_use(_key(i), lambda i=i: bytes([i]) * 100)
        assert tier.dropped_writes == 2
        backend.gate.set()
        tier.flush()
        assert tier.written_blocks == 3 and tier.lookup([_key(0), _key(1), _key(2)]) == 3
        assert tier.lookup([_key(3)]) == 0
        tier.note_use(_key(3), lambda: b"x" * 100)  # room again: the dropped block is written now
        tier.flush()
        assert tier.lookup([_key(3)]) == 1 and tier.dropped_writes == 2
    finally:
        backend.gate.set()
        tier.close()


def test_small_entries_are_not_limited_by_their_count():
    """Per-group entries are small: a prompt's many of them fit where a count bound dropped them."""
    backend = GatedBackend()
    tier = RemoteTier(backend, name="G4", max_pending_bytes=1 << 20)
    try:
        for i in range(1000):
            tier.note_use(_key(i), lambda: b"y" * 512)
        assert tier.dropped_writes == 0
        backend.gate.set()
        tier.flush()
        assert tier.written_blocks == 1000
    finally:
        backend.gate.set()
        tier.close()
