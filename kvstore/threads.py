"""Threads that run torch ops beside the engine's forward."""
from __future__ import annotations

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
