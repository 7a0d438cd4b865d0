"""The offload transfer engine (worker side): moves bytes between G1 and the tiers below it.

Threads: one FIFO transfer thread runs loads and G1 -> G2 stores in order; one thread writes G3
in order (bounded: past `max_pending_writes` a store waits on the transfer thread, never on the
step loop); a small pool reads G3 (several reads in flight) and runs G4 round trips. It changes
no scheduling state: it reports each finished load or store as a `LoadDone` / `StoreDone`, which
the connector hands to the planner.

A load walks the job's chunks in lookup order (G2, then G3, then G4), stops at the first chunk
that is missing, damaged or late, and reports the G1 blocks it did not fill. A G3 or G4 hit is
promoted into G2 on the way (and a G4 hit into G3 too). A failing tier is a miss and a log line.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from connectors.backend import BackendError, StorageBackend
from connectors.codec import HEADER_BYTES, BlockLayout, check_header, hidden_payload, payload, write_header
from connectors.offload_plans import Chunk, LoadDone, LoadJob, StoreDone, StoreJob
from connectors.remote_tier import RemoteTier
from kvstore.events import BlockStored, EventBuffer
from kvstore.g1 import BlockId
from kvstore.host import HostTier
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)


class TransferEngine:
    def __init__(self, layout: BlockLayout, g2: HostTier | None, g3: StorageBackend | None, g4: RemoteTier | None,
                 *, g3_timeout_s: float, g3_read_threads: int, max_pending_writes: int,
                 events: EventBuffer | None) -> None:
        if g3_read_threads < 1:
            raise ValueError(f"g3_read_threads must be >= 1; got {g3_read_threads}")
        self.layout, self.g2, self.g3, self.g4, self.events = layout, g2, g3, g4, events
        self.g1_per_chunk = layout.g1_blocks
        self.layout_id = layout.layout_id()
        self.g3_timeout_s = g3_timeout_s
        self.g3_read_threads = g3_read_threads
        self.kv_cache: torch.Tensor | None = None
        self.hidden_cache: torch.Tensor | None = None  # exported hidden states, when the layout has them
        self._xfer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-xfer")  # FIFO: loads and G2 stores
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvtier-g3")  # G3 writes, in order
        self._reads = ThreadPoolExecutor(g3_read_threads, thread_name_prefix="kvtier-g3-read")
        self._read_window = 2 * g3_read_threads  # reads one load keeps in flight
        self._bounce: list[torch.Tensor | None] = [None] * self._read_window  # read targets outside G2
        self._write_slots = threading.BoundedSemaphore(max_pending_writes)
        self._done: queue.SimpleQueue[LoadDone | StoreDone] = queue.SimpleQueue()
        self._progress = threading.Event()  # set with every _done item: the idle engine waits on it
        self.tier_hits: dict[str, int] = {"G2": 0, "G3": 0, "G4": 0}  # tokens served
        self.load_seconds = 0.0  # wall time of load jobs on the transfer thread
        self.load_bytes = 0  # KV bytes those jobs placed into G1
        self.g2_copies = 0  # copy operations G2 loads took (fewer: longer consecutive runs)

    # ---- the connector's side --------------------------------------------------------
    def start_load(self, job: LoadJob) -> None:
        self._xfer.submit(self.run_load, job)

    def start_store(self, job: StoreJob) -> None:
        self._xfer.submit(self._run_store, job)

    def drain(self) -> list[LoadDone | StoreDone]:
        """Everything finished since the last call, in order."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def _signal(self, item: LoadDone | StoreDone) -> None:
        self._done.put(item)
        self._progress.set()

    def wait_for_progress(self, timeout: float) -> None:
        # A set that lands between wait() and clear() is not lost: its item is already queued,
        # and the engine drains the queue before it waits again.
        self._progress.wait(timeout)
        self._progress.clear()

    # ---- loads and stores (transfer thread) -----------------------------------------
    def run_load(self, job: LoadJob) -> None:
        landed = 0  # destination blocks filled, from the first: everything after is reported failed
        last_tier = "G2"  # the tier of the last block placed
        start = time.perf_counter()
        try:
            # Lookup puts every G2 chunk before the first G3 one.
            g2_chunks = [c for c in job.chunks if c.tier == "G2"]
            run: list[tuple[Chunk, int]] = []  # checked G2 chunks, with their slots
            for c in g2_chunks:
                if not self._g2_ok(c, job):
                    break
                run.append((c, job.g2_slots[c.key]))
            landed = self._scatter_g2(run, job)
            if self.g4 is not None:
                for c, slot in run:  # a reuse: counts towards g4_min_uses
                    self.g4.note_use(c.key, lambda slot=slot: bytes(self.g2.slot_view(slot).numpy()))  # type: ignore[union-attr]
            lower = job.chunks[len(g2_chunks):]
            g3_chunks = [c for c in lower if c.tier == "G3"]
            complete = len(run) == len(g2_chunks)
            if complete and g3_chunks:
                from_g3, complete = self._load_g3(g3_chunks, job)
                landed += from_g3
                last_tier = "G3" if from_g3 else last_tier
            g4_chunks = lower[len(g3_chunks):]
            if complete and g4_chunks:
                from_g4 = self._load_g4(g4_chunks, job)
                landed += from_g4
                last_tier = "G4" if from_g4 else last_tier
        except Exception as e:  # a plugin tier may raise anything: it must become a miss, never wrong KV
            log.warning("offload load for request %s failed: %s: %s", job.req_id, type(e).__name__, e)
        finally:
            over = (job.first_g1 + landed) * self.layout.block_size - job.end_token
            if over > 0 and landed:  # the last token's block: its last token is recomputed, not a hit
                self.tier_hits[last_tier] -= over
            if self.g2 is not None and job.g2_slots:
                self.g2.complete_load(list(job.g2_slots))
            self.load_seconds += time.perf_counter() - start
            self.load_bytes += landed * self.layout.payload_bytes // self.layout.g1_blocks
            self._signal(LoadDone(job.req_id, job.dst[landed:]))

    def _g2_ok(self, c: Chunk, job: LoadJob) -> bool:
        assert self.g2 is not None
        reason = check_header(self.g2.slot_view(job.g2_slots[c.key]), self.layout_id, c.digest,
                              self.layout.payload_bytes)
        if reason:
            log.warning("G2 entry rejected: %s", reason)
            self.g2.stats.corrupt += 1
        return reason is None

    def _scatter_g2(self, run: list[tuple[Chunk, int]], job: LoadJob) -> int:
        """Copies checked G2 chunks into G1. Chunks whose G2 slots and G1 blocks both continue
        the previous chunk's go in one strided copy: per-chunk copies of small offload blocks
        spend more time in dispatch than in moving bytes."""
        k, done, i = self.g1_per_chunk, 0, 0

        def follows(d0: int, m: int) -> bool:  # the m-th chunk's G1 blocks continue from dst[d0]
            return all(job.dst[d0 + m * k + t] == job.dst[d0] + m * k + t for t in range(k))

        while i < len(run):
            c0, s0 = run[i]
            d0 = c0.index * k - job.first_g1  # < 0: the chunk is partly in G1 already
            j = i + 1
            if d0 >= 0 and follows(d0, 0):
                while j < len(run) and run[j][1] == s0 + j - i and follows(d0, j - i):
                    j += 1
            if j - i == 1:
                n = self._scatter(self.g2.slot_view(s0), c0.index, job)  # type: ignore[union-attr]
            else:
                assert self.g2 is not None and self.kv_cache is not None
                m = j - i
                lay, rows, first = self.layout, self.g2.slab[s0:s0 + m], job.dst[d0]
                src = rows[:, HEADER_BYTES:HEADER_BYTES + lay.kv_bytes].view(lay.dtype)
                src = src.view(m, *lay.shape).permute(1, 2, 0, 3, 4, 5, 6)  # [L, 2, m, k, ...]
                dst = self.kv_cache[:, :, first:first + m * k]
                dst.view(*dst.shape[:2], m, k, *dst.shape[3:]).copy_(src)
                if self.hidden_cache is not None:
                    hid = rows[:, HEADER_BYTES + lay.kv_bytes:HEADER_BYTES + lay.payload_bytes].view(lay.dtype)
                    self.hidden_cache[first:first + m * k].view(m, *lay.hidden_shape).copy_(
                        hid.view(m, *lay.hidden_shape))
                n = m * k
            done += n
            self.tier_hits["G2"] += n * self.layout.block_size
            self.g2_copies += 1
            i = j
        return done

    def _load_g3(self, chunks: list[Chunk], job: LoadJob) -> tuple[int, bool]:
        """Reads G3 chunks with up to `g3_read_threads` reads in flight (a disk serves several
        queued reads faster than one at a time) and scatters them in order. Each read lands in
        a G2 slot when G2 exists (the promotion) or else in a bounce buffer. Returns the G1
        blocks filled and whether every chunk landed; stops at the first chunk that is
        missing, bad or late."""
        window: deque[tuple[Chunk, int | None, torch.Tensor, Future]] = deque()
        todo = iter(enumerate(chunks))
        landed, ok, timed_out = 0, True, False
        while True:
            while ok and len(window) < self._read_window:
                nxt = next(todo, None)
                if nxt is None:
                    break
                i, c = nxt
                slot = self.g2.prepare_store(c.key, c.digest) if self.g2 is not None else None
                buf = self.g2.slot_view(slot) if slot is not None else self._bounce_buffer(i % self._read_window)
                window.append((c, slot, buf, self._reads.submit(self.g3.get_into, [c.key],  # type: ignore[union-attr]
                                                                [memoryview(buf.numpy())])))
            if not window:
                return landed, ok
            c, slot, buf, fut = window.popleft()
            try:
                reason = None if fut.result(timeout=self.g3_timeout_s if not timed_out else 0)[0] else "miss"
                reason = reason or check_header(buf, self.layout_id, c.digest, self.layout.payload_bytes)
            except FutureTimeout:
                # The read may still land in `buf` later: a G2 slot used as its target stays
                # reserved (lost) and the bounce buffers are dropped, so nothing reuses them.
                # After one timeout the rest of the window is not waited for.
                if not timed_out:
                    log.warning("G3 read timed out after %.1fs; treating it as a miss", self.g3_timeout_s)
                self._bounce = [None] * self._read_window
                ok, timed_out = False, True
                continue
            except Exception as e:  # a plugin backend may raise anything: a miss, never wrong KV
                log.warning("G3 read failed, treating it as a miss: %s: %s", type(e).__name__, e)
                reason = "error"
            if reason not in (None, "miss", "error"):
                log.warning("G3 entry rejected: %s", reason)
            if slot is not None:
                assert self.g2 is not None
                self.g2.complete_store(c.key, reason is None)  # promotion into G2
            if ok and reason is None:
                n = self._scatter(buf, c.index, job)
                landed += n
                self.tier_hits["G3"] += n * self.layout.block_size
                if self.g4 is not None:  # a reuse: counts towards g4_min_uses
                    self.g4.note_use(c.key, lambda buf=buf: bytes(buf.numpy()))
            else:
                ok = False  # later reads in flight still finish (and may still be promoted)

    def _load_g4(self, chunks: list[Chunk], job: LoadJob) -> int:
        """Reads G4 chunks in batches (one round trip each), promotes them into G2 (and from
        there into G3), and scatters them in order. The next batch's round trip is in flight
        while this one is checked and scattered. Returns the G1 blocks filled; stops at the
        first chunk that is missing or bad."""
        g4 = self.g4
        assert g4 is not None
        batches = [chunks[i:i + g4.batch] for i in range(0, len(chunks), g4.batch)]

        def issue(batch: list[Chunk]) -> tuple[list[Chunk], list[int | None], list[torch.Tensor], Future]:
            # Targets are reserved here, on the transfer thread (which owns G2's bookkeeping);
            # only the round trip runs on a reader thread.
            slots = [self.g2.prepare_store(c.key, c.digest) if self.g2 is not None else None for c in batch]
            bufs = [self.g2.slot_view(s) if s is not None else torch.empty(self.layout.encoded_bytes, dtype=torch.uint8)
                    for s in slots]
            return batch, slots, bufs, self._reads.submit(g4.read, [c.key for c in batch],
                                                          [memoryview(b.numpy()) for b in bufs])

        landed, ok, nxt = 0, True, 0
        pending = issue(batches[0]) if batches else None
        while pending is not None:
            batch, slots, bufs, fut = pending
            nxt += 1
            pending = issue(batches[nxt]) if ok and nxt < len(batches) else None
            got = fut.result()  # bounded by the backend's socket timeout
            for c, slot, buf, hit in zip(batch, slots, bufs, got):
                reason = None if hit else "miss"
                reason = reason or check_header(buf, self.layout_id, c.digest, self.layout.payload_bytes)
                if reason not in (None, "miss"):
                    log.warning("G4 entry rejected: %s", reason)
                if slot is not None:
                    assert self.g2 is not None
                    self.g2.complete_store(c.key, reason is None)  # promotion into G2
                    if reason is None and self.g3 is not None and self.g2.prepare_load([c.key]) is not None:
                        self._submit_g3_write(c.key, buf, unpin=True, wait=False)  # ... and into G3
                if ok and reason is None:
                    n = self._scatter(buf, c.index, job)
                    landed += n
                    self.tier_hits["G4"] += n * self.layout.block_size
                else:
                    ok = False  # a batch already in flight is still promoted, not scattered
        return landed

    def _bounce_buffer(self, i: int) -> torch.Tensor:
        buf = self._bounce[i]
        if buf is None:
            buf = self._bounce[i] = torch.empty(self.layout.encoded_bytes, dtype=torch.uint8)
        return buf

    def _scatter(self, buf: torch.Tensor, chunk_index: int, job: LoadJob) -> int:
        """Copies the chunk's blocks that G1 lacks into their G1 blocks; returns how many."""
        k = self.g1_per_chunk
        data = payload(buf, self.layout)
        lo = max(job.first_g1 - chunk_index * k, 0)  # blocks of this chunk already in G1 are skipped
        dst_start = chunk_index * k + lo - job.first_g1
        n = k - lo
        dst = job.dst[dst_start:dst_start + n]
        assert self.kv_cache is not None
        hid = hidden_payload(buf, self.layout)[lo:] if self.hidden_cache is not None else None
        if all(d == dst[0] + i for i, d in enumerate(dst)):  # the usual case: a strided copy,
            self.kv_cache[:, :, dst[0]:dst[0] + n].copy_(data[:, :, lo:])  # faster than index_copy_
            if hid is not None:
                self.hidden_cache[dst[0]:dst[0] + n].copy_(hid)  # type: ignore[index]
        else:
            idx = torch.tensor(dst, dtype=torch.long)
            self.kv_cache.index_copy_(2, idx, data[:, :, lo:])
            if hid is not None:
                self.hidden_cache.index_copy_(0, idx, hid)  # type: ignore[union-attr]
        return n

    def _gather(self, src: list[BlockId], buf: torch.Tensor, job: StoreJob) -> None:
        assert self.kv_cache is not None
        write_header(buf, self.layout_id, job.digest, self.layout.payload_bytes)
        idx = torch.tensor(src, dtype=torch.long)
        torch.index_select(self.kv_cache, 2, idx, out=payload(buf, self.layout))
        if self.hidden_cache is not None:
            torch.index_select(self.hidden_cache, 0, idx, out=hidden_payload(buf, self.layout))

    def _run_store(self, job: StoreJob) -> None:
        try:
            self.store(job, wait_for_write_slot=True)
        except (RuntimeError, OSError, ValueError) as e:
            log.warning("offload store failed (block not offloaded): %s", e)
        finally:
            self._signal(StoreDone(job.key))

    def store(self, job: StoreJob, wait_for_write_slot: bool) -> bool:
        """Copies job.src out of G1 into G2 (then queues G3 from there) or, with no G2, into a
        buffer queued for G3. False if no tier took it. Runs on the transfer thread, or on the
        step loop for a write-back (`wait_for_write_slot=False`: a full write queue drops it)."""
        if self.g2 is not None:
            slot = self.g2.prepare_store(job.key, job.digest)
            if slot is None:
                return False
            buf = self.g2.slot_view(slot)
            self._gather(job.src, buf, job)
            self.g2.complete_store(job.key, True, job.priority)
            if self.g3 is not None and self.g2.prepare_load([job.key]) is not None:
                self._submit_g3_write(job.key, buf, unpin=True, wait=wait_for_write_slot)
            if self.g4 is not None:
                self.g4.note_use(job.key, lambda: bytes(buf.numpy()))
            return True
        buf = torch.empty(self.layout.encoded_bytes, dtype=torch.uint8)
        self._gather(job.src, buf, job)
        if self.g4 is not None:
            self.g4.note_use(job.key, lambda: bytes(buf.numpy()))
        if self.g3 is None:
            return self.g4 is not None
        return self._submit_g3_write(job.key, buf, unpin=False, wait=wait_for_write_slot)

    def _submit_g3_write(self, key: BlockKey, buf: torch.Tensor, unpin: bool, wait: bool = True) -> bool:
        # Bounded: past max_pending_writes a store waits here, on the transfer thread, never
        # on the step loop (which passes wait=False and drops the write instead); memory
        # stays bounded when the disk is slower than the engine.
        if not self._write_slots.acquire(blocking=wait):
            if unpin and self.g2 is not None:
                self.g2.complete_load([key])
            return False
        self._io.submit(self._write_g3, key, buf, unpin)
        return True

    def _write_g3(self, key: BlockKey, buf: torch.Tensor, unpin: bool) -> None:
        assert self.g3 is not None
        try:
            stored = self.g3.put([key], [memoryview(buf.numpy())])[0]
            if stored and self.events is not None:
                # G3's own evictions are internal to the backend and not reported (yet).
                self.events.append(BlockStored([key], None, [], self.layout.tokens, "DISK"))
        except (BackendError, OSError) as e:
            log.warning("G3 write failed (block stays in G2 only): %s", e)
        finally:
            if unpin and self.g2 is not None:
                self.g2.complete_load([key])
            self._write_slots.release()

    def flush(self) -> None:
        """Wait until every queued store and G3 write has finished."""
        self._xfer.submit(lambda: None).result()
        self._io.submit(lambda: None).result()
        if self.g4 is not None:
            self.g4.flush()

    def close(self) -> None:
        self.flush()
        self._xfer.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._reads.shutdown(wait=True)
        if self.g3 is not None:
            self.g3.close()
        if self.g4 is not None:
            self.g4.close()
