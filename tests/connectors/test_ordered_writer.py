"""A parallel tier's writer (issue 43): writes queued while it is busy reach the backend in one call of at
most `batch_bytes` (so G3 writes them as one file), in order; its backlog and refusals are counted.
Oracle: a MemoryBackend that records each put_blocks call."""
from __future__ import annotations

import threading

import torch

from connectors.storage_tier import StorageTier
from kvstore.memory import MemoryBackend
from policies import BlockInfo

INFO = BlockInfo()


class Recording(MemoryBackend):
    def __init__(self) -> None:
        super().__init__(1 << 30)
        self.calls: list[list[bytes]] = []
        self.gate, self.entered = threading.Event(), threading.Event()

    def put_blocks(self, keys, blocks, infos):
        self.entered.set()
        self.gate.wait(10)
        self.calls.append(list(keys))
        return super().put_blocks(keys, blocks, infos)


def key(i: int) -> bytes:
    return bytes([i]) * 16


def test_queued_writes_go_together_in_order_bounded_by_bytes_and_the_backlog_is_counted():
    backend = Recording()
    tier = StorageTier.parallel("G3", backend, max_pending_writes=6, io_bytes=3000)
    writer = tier.writer
    assert writer is not None
    done: list[int] = []
    bufs = [torch.full((1000,), i, dtype=torch.uint8) for i in range(8)]
    assert writer.submit(key(0), bufs[0], lambda: done.append(0), True, INFO)
    assert backend.entered.wait(10)  # the first write is at the backend, held at the gate
    for i in range(1, 6):  # five queue behind it
        assert writer.submit(key(i), bufs[i], lambda i=i: done.append(i), True, INFO)
    assert writer.queued_bytes == 6000 and tier.stats()["queued_write_bytes"] == 6000
    assert not writer.submit(key(6), bufs[6], lambda: done.append(6), False, INFO)  # full: refused, not waited for
    assert done == [6] and writer.dropped == 1 and tier.stats()["dropped_writes"] == 1
    backend.gate.set()
    tier.flush()
    assert backend.calls == [[key(0)], [key(1), key(2), key(3)], [key(4), key(5)]]  # 3000 bytes a call at most
    assert sorted(done) == list(range(7)) and writer.queued_bytes == 0
    assert backend.get([key(i) for i in range(6)]) == [bytes(b.numpy()) for b in bufs[:6]]
    tier.close()


class Raising(MemoryBackend):
    def put_blocks(self, keys, blocks, infos):
        raise ValueError("a plugin bug")


def test_a_backend_that_raises_loses_the_writes_not_the_writer(caplog):
    tier = StorageTier.parallel("G3", Raising(1 << 20))
    done: list[int] = []
    for i in range(3):
        assert tier.writer.submit(key(i), torch.zeros(10, dtype=torch.uint8), lambda i=i: done.append(i), True, INFO)
    tier.flush()  # returns: the writer thread survived the exception
    assert sorted(done) == [0, 1, 2] and tier.writer.queued_bytes == 0
    assert "a plugin bug" in caplog.text
    tier.close()
