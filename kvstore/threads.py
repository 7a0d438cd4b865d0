"""Threads that run torch ops beside the engine's forward."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def one_torch_thread() -> None:
    """Run first in every thread that runs torch ops beside the forward (as its pool's
    initializer, or at the top of its loop).

    torch's intra-op thread count belongs to the calling thread, and a thread that reaches a
    parallel op starts its own OpenMP team of that many threads. With the forward's team already
    on every core, a second team makes them fight for the cores, and not only while it works:
    measured on the demo model, 2 cores, batch-16 decode, every engine in the process ran at 55-60%
    of its speed from the moment an offload transfer thread or async scheduling's helper had run
    a copy (615 -> 370 tok/s), and at full speed with those threads at one torch thread."""
    torch.set_num_threads(1)


class CopyPool:
    """Copies large host tensors with several plain threads, each at one torch thread.

    A copy on a side thread at one torch thread moves a quarter of what the machine can (measured:
    G2 -> G1 loads at 10 GB/s against a 41 GB/s two-thread copy); letting it go parallel the
    OpenMP way would start the second team `one_torch_thread` exists to avoid. torch drops the GIL
    inside `copy_`, so splitting the copy along its first dimension over a few threads gets the
    bandwidth back without OpenMP."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvtier-copy",
                                        initializer=one_torch_thread) if self.threads > 1 else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst.copy_(src)`, split along dim 0 (same shapes) when there are threads and rows for it."""
        parts = min(self.threads, dst.shape[0]) if dst.dim() else 1
        if self._pool is None or parts < 2 or dst.device.type != "cpu" or src.device.type != "cpu":
            dst.copy_(src)
            return
        bounds = [dst.shape[0] * i // parts for i in range(parts + 1)]
        futures = [self._pool.submit(dst[a:b].copy_, src[a:b]) for a, b in zip(bounds[1:-1], bounds[2:])]
        dst[bounds[0]:bounds[1]].copy_(src[bounds[0]:bounds[1]])
        for f in futures:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
