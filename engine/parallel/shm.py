"""An all-reduce for ranks on one machine through shared memory: what a decode step's small
all-reduces need on CPU, where gloo's loopback TCP costs ~0.2 ms each (60 a step for a 30-layer
model: half of a TP=2 decode step measured on the demo-sized model).

Each rank copies its tensor into its slot, publishes a sequence number, waits until every rank has
published it, and sums the slots in rank order, so every rank gets the same bits. Two buffers
alternate: a rank can only reach the step after next once every rank has finished reading this one.
Tensors over MAX_ELEMENTS go through gloo instead: large copies may use non-temporal stores, which
x86 does not order before the flag's store, and at that size gloo's latency no longer dominates.
"""
from __future__ import annotations

import time
from multiprocessing import shared_memory
from typing import Any

import torch

MAX_ELEMENTS = 1 << 18  # per tensor; 1 MiB in float32 (a 256-row decode step of a 1024-wide model)
SPIN_CHECK = 1024  # spins between looks at the clock


class AllReduce:
    """What every rank calls: shared memory for what fits, else the gloo group `pg`."""

    def __init__(self, shm: ShmAllReduce, pg: Any) -> None:
        self.shm, self.pg = shm, pg

    def __call__(self, t: torch.Tensor) -> None:
        if self.shm.fits(t):
            self.shm(t)
        else:
            self.pg.allreduce([t]).wait()


class ShmAllReduce:
    def __init__(self, name: str | None, rank: int, size: int, dtype: torch.dtype, timeout_s: float) -> None:
        """`name` None: rank 0 creates the segment (`self.name` says which); the others attach to it."""
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = 8 * size + 2 * size * MAX_ELEMENTS * itemsize
        self._shm = shared_memory.SharedMemory(name=name, create=name is None, size=nbytes)
        self.name = self._shm.name
        self._owner = name is None
        if not self._owner:  # rank 0 owns it: this process's resource tracker must not unlink it at exit
            from multiprocessing import resource_tracker

            resource_tracker.unregister(self._shm._name, "shared_memory")
        buf = torch.frombuffer(self._shm.buf, dtype=torch.uint8)
        self._flags = buf[:8 * size].view(torch.int64)
        self._data = buf[8 * size:].view(dtype).view(2, size, MAX_ELEMENTS)
        if self._owner:
            self._flags.zero_()
        self.rank, self.size, self.dtype, self.timeout_s = rank, size, dtype, timeout_s
        self._seq = 0

    def fits(self, t: torch.Tensor) -> bool:
        return t.dtype == self.dtype and t.is_contiguous() and t.numel() <= MAX_ELEMENTS and t.device.type == "cpu"

    def __call__(self, t: torch.Tensor) -> None:
        """Sums `t` over the ranks in place; RuntimeError when a rank does not come within the timeout."""
        self._seq += 1
        seq, n, flat = self._seq, t.numel(), t.view(-1)
        slots = self._data[seq % 2]
        slots[self.rank, :n].copy_(flat)
        self._flags[self.rank] = seq
        spins, deadline = 0, None
        while bool((self._flags < seq).any()):
            spins += 1
            if spins % SPIN_CHECK == 0:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if now > deadline:
                    raise RuntimeError(f"shared-memory all-reduce: a rank did not arrive within {self.timeout_s:.0f} s")
        torch.sum(slots[:, :n], dim=0, out=flat)

    def close(self) -> None:
        self._flags = self._data = None  # the views hold the buffer: drop them before closing it
        try:
            self._shm.close()
            if self._owner:
                self._shm.unlink()
        except (BufferError, FileNotFoundError):
            pass  # still viewed, or already gone: the OS frees it with the last process
