"""Threads that run torch ops beside the engine's forward."""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import torch

log = logging.getLogger(__name__)
T = TypeVar("T")


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


def lower_priority(nice: int, native_id: int | None = None) -> None:
    """Give the calling thread (or the process's thread `native_id`) this nice value (Linux: a
    thread's own; raising it needs no privilege), so its CPU work yields to the forward's threads
    on a busy machine."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id() if native_id is None else native_id, nice)
    except (OSError, AttributeError) as e:  # not Linux, or a sandbox that forbids it
        log.debug("thread keeps its priority: %s", e)


class CopyPool:
    """Copies large host tensors with several plain threads, each at one torch thread.

    A copy on a side thread at one torch thread moves a quarter of what the machine can (measured:
    G2 -> G1 loads at 10 GB/s against a 41 GB/s two-thread copy); letting it go parallel the
    OpenMP way would start the second team `one_torch_thread` exists to avoid. torch drops the GIL
    inside `copy_`, so splitting the copy along its first dimension over a few threads gets the
    bandwidth back without OpenMP. Copies under `MIN_SPLIT_BYTES` run on the calling thread: handing
    half of a 720 KiB copy to another thread halved its speed here (4.6 against 9.4 GB/s; equal
    at 3.6 MB), the hand-off costing more than the copy."""

    MIN_SPLIT_BYTES = 4 * 2**20

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvtier-copy",
                                        initializer=one_torch_thread) if self.threads > 1 else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """`dst.copy_(src)`, split along dim 0 (same shapes) when there are threads and rows for it."""
        parts = min(self.threads, dst.shape[0]) if dst.dim() else 1
        if (self._pool is None or parts < 2 or dst.device.type != "cpu" or src.device.type != "cpu"
                or dst.numel() * dst.element_size() < self.MIN_SPLIT_BYTES):
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


class DaemonPool:
    """A fixed pool of daemon worker threads for work that may block in the kernel (a tier's
    reads: a hung file system, a FIFO planted where a file was).

    `ThreadPoolExecutor` joins its workers at interpreter exit, so one read stuck forever held
    the engine core's shutdown (and SIGTERM) forever. These workers are daemons and `shutdown`
    waits for them at most `wait_s`. A caller that gave up on a stuck task calls `replace_stuck`,
    which starts one more worker so the pool keeps its width: at most `spares` extra at once
    (default `threads`). A replaced worker whose task does end leaves, and gives its place back:
    a server that meets a slow grammar compile now and then never runs out of spares for good."""

    def __init__(self, threads: int, name: str, initializer: Callable[[], None] | None = None,
                 spares: int | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1; got {threads}")
        self.threads, self.name, self._init = threads, name, initializer
        self._q: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._spares = threads if spares is None else spares
        self._retired: set[threading.Thread] = set()  # replaced while stuck: they leave after their task
        self._closed = False
        self._lock = threading.Lock()
        for _ in range(threads):
            self._start()

    def _start(self) -> None:
        t = threading.Thread(target=self._run, name=f"{self.name}-{len(self._workers)}", daemon=True)
        self._workers.append(t)
        t.start()

    def _run(self) -> None:
        if self._init is not None:
            self._init()
        while (item := self._q.get()) is not None:
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(e)
            me = threading.current_thread()
            if me in self._retired:
                with self._lock:
                    self._retired.discard(me)
                    self._workers.remove(me)
                    self._spares += 1
                return

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} pool is shut down")
            fut: Future[T] = Future()
            self._q.put((fut, fn, args))
            return fut

    def replace_stuck(self, stuck: threading.Thread | None = None) -> bool:
        """One more worker in place of one stuck in a task (`stuck`, when known, then leaves once
        that task ends, and its spare is free again); False while the spares are spent."""
        with self._lock:
            if self._closed or self._spares == 0:
                return False
            self._spares -= 1
            if stuck is not None:
                self._retired.add(stuck)
            self._start()
            return True

    def shutdown(self, wait_s: float) -> bool:
        """Queued tasks still run; waits at most `wait_s` for the workers. True when all ended."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        for _ in workers:
            self._q.put(None)
        deadline = time.monotonic() + wait_s
        for t in workers:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in workers)


def drain(q: queue.Queue | queue.SimpleQueue) -> list[Any]:
    """Everything `q` holds now, in order, without waiting."""
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def after_all(futures: list[Future], fn: Callable[[], None]) -> None:
    """Calls `fn` once every one of `futures` is done (on the thread that finishes the last)."""
    left, lock = [len(futures)], threading.Lock()

    def one(_: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()
    for f in futures:
        f.add_done_callback(one)
