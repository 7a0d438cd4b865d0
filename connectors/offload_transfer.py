"""The offload transfer engine (worker side): moves bytes between G1 and the tiers below it.

Threads: one FIFO transfer thread runs loads and G1 -> G2 stores in order; each parallel storage
tier writes on its own thread (`storage_tier.OrderedWriter`); a small pool runs the storage
tiers' reads. It changes no scheduling state: it reports each finished load or store as a
`LoadDone` / `StoreDone`, which the connector hands to the planner.

A load walks the job's chunks in lookup order (G2, then the storage tiers top-down), stops at
the first chunk that is missing, damaged or late, and reports the G1 blocks it did not fill. A
storage-tier hit is promoted into G2 on the way, and from there written to the parallel tiers
above the one that served it. A failing tier is a miss and a log line. With no G2 and a host G1, a
tier whose backend takes `Scatter` outputs reads straight into the load's G1 blocks
(`read_targets.py`); such a read that outlives its timeout ends the hit there, and the load is
reported only once the read has returned (until then the blocks are its targets).

KV events: a block written or promoted into a tier is announced by that tier with the G1 blocks
the planner attached to the job or chunk (`blocks`); this engine only carries them along.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import torch

from connectors.codec import (HEADER_BYTES, BlockLayout, check_header, header_bytes)
from connectors.g1_copies import G1Copies
from connectors.read_targets import G1Targets, ReadTargets
from connectors.offload_plans import Chunk, LoadDone, LoadJob, Reports, StoreDone, StoreJob
from connectors.storage_tier import Admission, StorageTier, TierMode
from kvstore.events import ChunkBlocks
from kvstore.host import HostTier
from kvstore.keys import BlockKey
from kvstore.threads import DaemonPool, after_all, one_torch_thread
from policies import BlockInfo

log = logging.getLogger(__name__)

HOST = "G2"  # the host-memory tier's name
READS_SHUTDOWN_S = 5.0  # the most shutdown waits for tier reads still in flight
STAGING_BYTES = 256 * 2**20  # on a GPU, the most G2 bytes one scatter stages on the device at once
# The most bytes one read into G1 covers: a load is one call up to this (G3: one native call), so
# that `read_timeout_s` bounds a call, not a load of any length (512 MiB at 10 s: 54 MB/s).
LOAD_CALL_BYTES = 512 * 2**20


class TransferEngine:
    def __init__(self, layout: BlockLayout, g2: HostTier | None, tiers: list[StorageTier]) -> None:
        self.layout, self.g2, self.tiers = layout, g2, tiers
        self.g1_per_chunk = layout.g1_blocks
        self.layout_id = layout.layout_id()
        self.g1 = G1Copies(layout, self.g1_per_chunk)  # G1 itself, and the copies into and out of it
        self._xfer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-xfer",  # FIFO: loads and G2 stores
                                        initializer=one_torch_thread)
        read_threads = max((t.read_threads for t in tiers), default=1)
        # Daemon workers: a read stuck in the kernel never holds shutdown (see DaemonPool).
        self._reads = DaemonPool(read_threads, "kvtier-read", initializer=one_torch_thread)
        # Read targets when there is no G2: a parallel tier has 2 * read_threads calls in flight,
        # a batched one two batches.
        bounce = max([1, *(2 * t.read_threads * t.io_chunks(layout.encoded_bytes) for t in tiers if t.remote is None),
                      *(2 * t.remote.batch for t in tiers if t.remote is not None)])
        self._targets = ReadTargets(layout, bounce)
        self._late: list[Future] = []  # this load's reads into G1 that outlived their timeout
        self._used: list[tuple[StorageTier, list[Chunk]]] = []  # this load's hits, told to their tiers once reported
        self.reports = Reports()  # finished loads and stores, drained by the connector
        self.tier_hits: dict[str, int] = dict.fromkeys([HOST, *(t.name for t in tiers)], 0)  # tokens served
        self.load_seconds = 0.0  # wall time of load jobs on the transfer thread
        self.load_bytes = 0  # entry bytes those jobs placed into G1 (narrower than G1's with --kv-offload-dtype)
        self.copy_seconds = 0.0  # of load_seconds, the copies of storage-tier hits into G1
        self.direct_blocks = 0  # G1 blocks storage-tier reads filled in place (no copy)
        self.g2_copies = 0  # copy operations G2 loads took (fewer: longer consecutive runs)
        # A tensor-parallel worker's: rank 0's load plan -> this rank's (its own G2 slots and
        # tiers; connectors/sharded.py). Runs on the transfer thread; must not raise.
        self.relocate: Callable[[LoadJob], LoadJob] | None = None

    # ---- the connector's side --------------------------------------------------------
    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self.g1.kv_cache

    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.g1.register(kv_cache)

    def start_load(self, job: LoadJob) -> None:
        self._xfer.submit(self.run_load, job)

    def start_store(self, job: StoreJob) -> None:
        self._xfer.submit(self._run_store, job)

    # ---- loads and stores (transfer thread) -----------------------------------------
    def run_load(self, job: LoadJob) -> None:
        if self.relocate is not None:
            job = self.relocate(job)
        landed = landed_g2 = 0  # destination blocks filled, from the first: everything after is reported failed
        last_tier = HOST  # the tier of the last block placed
        first_tier: str | None = None  # the storage tier of the first block placed
        start = time.perf_counter()
        try:
            with self.g1.stream.scope():  # on CUDA: its own stream, synced before LoadDone
                # Lookup puts every G2 chunk first, then each tier's in the tiers' order.
                g2_chunks = [c for c in job.chunks if c.tier == HOST]
                run: list[tuple[Chunk, int]] = []  # checked G2 chunks, with their slots
                for c in g2_chunks:
                    if not self._g2_ok(c, job):
                        break
                    run.append((c, job.g2_slots[c.key]))
                landed = landed_g2 = self._scatter_g2(run, job)
                for c, slot in run:  # a reuse: counts towards every tier's min_uses
                    self._note_use(self.tiers, c.key, lambda slot=slot: bytes(self.g2.slot_view(slot).numpy()),  # type: ignore[union-attr]
                                   c.blocks)
                    for tier in self.tiers:
                        if tier.min_uses > 1 and tier.admit(c.key):
                            self._write_from_g2(tier, c.key, self.g2.slot_view(slot), False,  # type: ignore[union-attr]
                                                job.chunk_info(c), c.blocks)
                complete = len(run) == len(g2_chunks)
                for i, tier in enumerate(self.tiers):
                    chunks = [c for c in job.chunks if c.tier == tier.name]
                    if not (complete and chunks):
                        continue
                    load = self._load_parallel if tier.mode is TierMode.PARALLEL else self._load_batched
                    n, complete = load(i, chunks, job)
                    landed += n
                    last_tier = tier.name if n else last_tier
                    first_tier = first_tier or (tier.name if n else None)
        except Exception as e:  # a plugin tier may raise anything: it must become a miss, never wrong KV
            log.warning("offload load for request %s failed: %s: %s", job.req_id, type(e).__name__, e)
        finally:
            over = (job.first_g1 + landed) * self.layout.block_size - job.end_token
            if over > 0 and landed and job.group == 0:  # the last token's block: its last token is recomputed
                self.tier_hits[last_tier] -= over
            if landed and job.group == 0 and job.skipped_tokens:  # a sliding group 0's hit before its window:
                self.tier_hits[HOST if landed_g2 else first_tier] += job.skipped_tokens  # the first block's tier
            if self.g2 is not None and job.g2_slots:
                self.g2.complete_load(list(job.g2_slots))
            self.load_seconds += time.perf_counter() - start
            self.load_bytes += landed * self.layout.payload_bytes // self.layout.g1_blocks
            done, late, self._late = LoadDone(job.req_id, job.dst[landed:], job.group, landed), self._late, []
            if late:  # they target this load's G1 blocks, which the scheduler recomputes into or
                # hands back as soon as it hears of the load: it hears once they have returned
                log.warning("request %s: %d read(s) into G1 outlived the timeout; its load ends when they return",
                            job.req_id, len(late))
                after_all(late, lambda: self.reports.put(done))
            else:
                self.reports.put(done)
            used, self._used = self._used, []
            for tier, chunks in used:  # bookkeeping the request need not wait for
                self._touch(tier, chunks, job)

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

        cap = max(1, STAGING_BYTES // self.layout.encoded_bytes) if self.g1.stage_on_device else len(run)
        while i < len(run):
            c0, s0 = run[i]
            d0 = c0.index * k - job.first_g1  # < 0: the chunk is partly in G1 already
            j = i + 1
            if d0 >= 0 and follows(d0, 0):
                while (j < len(run) and j - i < cap and run[j][1] == s0 + j - i and follows(d0, j - i)
                       and self.g2.same_span(s0, run[j][1])):  # type: ignore[union-attr]
                    j += 1
            if j - i == 1:
                n = self.g1.scatter(self.g2.slot_view(s0), c0.index, job)  # type: ignore[union-attr]
            else:
                n = self.g1.scatter_slab(self.g2.slab[s0:j - i + s0], job.dst[d0])  # type: ignore[union-attr]
            done += n
            self.tier_hits[HOST] += n * self.layout.block_size * (job.group == 0)  # hits count tokens, once
            self.g2_copies += 1
            i = j
        return done

    def _load_parallel(self, i: int, chunks: list[Chunk], job: LoadJob) -> tuple[int, bool]:
        """Reads a parallel tier's chunks in calls of `tier.io_chunks(...)` neighbours (G3 reads
        each call's run of one file in one preadv), `2 * read_threads` calls in flight (a disk
        serves queued reads faster than one at a time), and scatters them in order while later
        calls read. Each chunk lands in a G2 slot when G2 exists (the promotion), else in a bounce
        buffer; with no G2 and a host G1 the tier reads into G1 itself (`_load_into_g1`). Returns
        the G1 blocks filled and whether every chunk landed; stops at the first chunk that is
        missing, bad or late."""
        tier = self.tiers[i]
        if tier.scatter_reads and self.g2 is None and (g1 := self._targets.g1(self.g1.kv_cache, self.g1.hidden_cache)):
            return self._load_into_g1(i, chunks, job, g1)
        per = tier.io_chunks(self.layout.encoded_bytes)
        window_size = 2 * tier.read_threads
        # per call in flight: its chunks, their G2 slots, read targets, and the read
        window: deque[tuple[list[Chunk], list[int | None], list[torch.Tensor], Future]] = deque()
        calls = iter(enumerate(chunks[j:j + per] for j in range(0, len(chunks), per)))
        landed, ok, timed_out = 0, True, False
        while True:
            while ok and len(window) < window_size:
                nxt = next(calls, None)
                if nxt is None:
                    break
                n, run = nxt
                slots = [self.g2.prepare_store(c.key, c.digest) if self.g2 is not None else None for c in run]
                bufs = [self.g2.slot_view(s) if s is not None else self._bounce_buffer((n % window_size) * per + k)
                        for k, s in enumerate(slots)]
                fut = self._reads.submit(tier.backend.get_into, [c.key for c in run], [memoryview(b.numpy()) for b in bufs])
                window.append((run, slots, bufs, fut))
            if not window:
                return landed, ok
            run, slots, bufs, fut = window.popleft()
            try:
                got = fut.result(timeout=tier.read_timeout_s if not timed_out else 0)
                reasons = [None if hit else "miss" for hit in got]
            except FutureTimeout:
                # The read may still land in its buffers later: G2 slots used as its targets stay
                # reserved (lost) and the bounce buffers are dropped, so nothing reuses them.
                # After one timeout the rest of the window is not waited for.
                if not timed_out:
                    log.warning("%s read timed out after %.1fs; treating it as a miss", tier.name, tier.read_timeout_s)
                if not fut.done():  # its worker may never come back: keep the pool's width
                    self._reads.replace_stuck()
                self._targets.abandon()
                ok, timed_out = False, True
                continue
            except Exception as e:  # a plugin backend may raise anything: a miss, never wrong KV
                log.warning("%s read failed, treating it as a miss: %s: %s", tier.name, type(e).__name__, e)
                reasons = ["error"] * len(run)
            used: list[Chunk] = []
            for c, slot, buf, reason in zip(run, slots, bufs, reasons):
                reason = reason or check_header(buf, self.layout_id, c.digest, self.layout.payload_bytes)
                if reason not in (None, "miss", "error"):
                    log.warning("%s entry rejected: %s", tier.name, reason)
                self._promote(i, c, slot, buf, reason is None, job)
                if ok and reason is None:
                    landed += self._land(i, c, buf, job)
                    used.append(c)
                else:
                    ok = False  # later reads in flight still finish (and may still be promoted)
            self._touch(tier, used, job)

    def _load_into_g1(self, i: int, chunks: list[Chunk], job: LoadJob, g1: G1Targets) -> tuple[int, bool]:
        """`_load_parallel` straight into G1: each call of up to LOAD_CALL_BYTES is one
        `get_into_batch` (G3: one native call whose own threads read every file), its entries'
        headers checked in one array comparison, the tier told of the uses after the load is
        reported (`_used`). No copy to overlap, so one call at a time; a call that outlives the
        timeout ends the hit, and the load is reported once it returns (its targets are this
        load's G1 blocks)."""
        tier, k, hb = self.tiers[i], self.g1_per_chunk, HEADER_BYTES
        per, landed = max(1, LOAD_CALL_BYTES // self.layout.encoded_bytes), 0
        threads = min(tier.read_threads, len(os.sched_getaffinity(0)))
        below = [t for t in self.tiers[i + 1:] if t.remote is not None]  # count uses towards min_uses
        dst = np.asarray(job.dst, dtype=np.int64)
        for j in range(0, len(chunks), per):
            run = chunks[j:j + per]
            starts = np.array([c.index for c in run], dtype=np.int64) * k - job.first_g1
            blocks = dst[np.clip(starts[:, None] + np.arange(k), 0, len(dst) - 1)]  # [n, k]
            bounce = {m: torch.empty(self.layout.encoded_bytes, dtype=torch.uint8)  # partly in G1 already
                      for m in np.flatnonzero((starts < 0) | (starts + k > len(dst))).tolist()}
            headers = np.empty((len(run), hb), dtype=np.uint8)
            fut = self._reads.submit(tier.backend.get_into_batch, [c.key for c in run],
                                     g1.batch(headers, blocks, bounce), threads)
            try:
                got = fut.result(timeout=tier.read_timeout_s)
            except FutureTimeout:
                log.warning("%s read timed out after %.1fs; treating it as a miss", tier.name, tier.read_timeout_s)
                if not fut.done():
                    self._reads.replace_stuck()
                self._late.append(fut)
                return landed, False
            except Exception as e:  # a plugin backend may raise anything: a miss, never wrong KV
                log.warning("%s read failed, treating it as a miss: %s: %s", tier.name, type(e).__name__, e)
                return landed, False
            for m, buf in bounce.items():
                headers[m] = buf[:hb].numpy()
            want = b"".join(header_bytes(self.layout_id, c.digest, self.layout.payload_bytes) for c in run)
            good = np.asarray(got, dtype=bool) & (headers == np.frombuffer(want, np.uint8).reshape(-1, hb)).all(axis=1)
            n = int(good.argmin()) if not good.all() else len(run)  # the landed prefix
            direct = [m for m in range(n) if m not in bounce]
            landed += sum(self._land(i, run[m], buf, job) for m, buf in bounce.items() if m < n) + k * len(direct)
            self.direct_blocks += k * len(direct)
            self.tier_hits[tier.name] += k * len(direct) * self.layout.block_size * (job.group == 0)
            for m in direct if below else ():
                self._note_use(below, run[m].key, lambda m=m: g1.value(headers[m], blocks[m].tolist()), run[m].blocks)
            self._used.append((tier, run[:n]))
            if n < len(run):
                if got[n] and (why := check_header(headers[n], self.layout_id, run[n].digest, self.layout.payload_bytes)):
                    log.warning("%s entry rejected: %s", tier.name, why)
                return landed, False
        return landed, True

    def _load_batched(self, i: int, chunks: list[Chunk], job: LoadJob) -> tuple[int, bool]:
        """Reads a batched tier's chunks (one round trip per batch), promotes them, and
        scatters them in order. The next batch's round trip is in flight while this one is
        checked and scattered. Returns the G1 blocks filled and whether every chunk landed."""
        tier = self.tiers[i]
        remote = tier.remote
        assert remote is not None
        batches = [chunks[j:j + remote.batch] for j in range(0, len(chunks), remote.batch)]

        def issue(batch: list[Chunk]) -> tuple[list[Chunk], list[int | None], list[torch.Tensor], Future]:
            # Targets are reserved here, on the transfer thread (which owns G2's bookkeeping);
            # only the round trip runs on a reader thread, receiving into G2 slots or, with no G2,
            # into bounce buffers (page-locked on a GPU: scatters from pageable memory are slow).
            keys = [c.key for c in batch]
            slots = [self.g2.prepare_store(c.key, c.digest) if self.g2 is not None else None for c in batch]
            first = (nxt % 2) * remote.batch  # the other half of the bounce buffers is still being scattered
            bufs = [self.g2.slot_view(s) if s is not None else self._bounce_buffer(first + k)  # type: ignore[union-attr]
                    for k, s in enumerate(slots)]
            return batch, slots, bufs, self._reads.submit(remote.read, keys, [memoryview(b.numpy()) for b in bufs])

        landed, ok, nxt = 0, True, 0
        pending = issue(batches[0]) if batches else None
        while pending is not None:
            batch, slots, bufs, fut = pending
            nxt += 1
            pending = issue(batches[nxt]) if ok and nxt < len(batches) else None
            got = fut.result()  # bounded by the backend's socket timeout
            used: list[Chunk] = []
            for c, slot, buf, hit in zip(batch, slots, bufs, got):
                reason = None if hit else "miss"
                reason = reason or check_header(buf, self.layout_id, c.digest, self.layout.payload_bytes)
                if reason not in (None, "miss"):
                    log.warning("%s entry rejected: %s", tier.name, reason)
                self._promote(i, c, slot, buf, reason is None, job)
                if ok and reason is None:
                    landed += self._land(i, c, buf, job)
                    used.append(c)
                else:
                    ok = False  # a batch already in flight is still promoted, not scattered
            self._touch(tier, used, job)
        return landed, ok

    def _land(self, i: int, c: Chunk, buf: torch.Tensor, job: LoadJob) -> int:
        """A checked hit from tier i in `buf`: scatter it into G1, count it, and tell the batched
        tiers below that it was reused (the caller tells tier i: `_touch`). Returns the G1 blocks
        filled."""
        t0 = time.perf_counter()
        n = self.g1.scatter(buf, c.index, job)
        self.copy_seconds += time.perf_counter() - t0
        self.tier_hits[self.tiers[i].name] += n * self.layout.block_size * (job.group == 0)
        self._note_use(self.tiers[i + 1:], c.key, lambda: bytes(buf.numpy()), c.blocks)
        return n

    @staticmethod
    def _touch(tier: StorageTier, used: list[Chunk], job: LoadJob) -> None:
        """Tells the tier a read's landed chunks were used, in order, in one call."""
        if used:
            tier.touch([c.key for c in used], [job.chunk_info(c) for c in used])

    def _promote(self, i: int, c: Chunk, slot: int | None, buf: torch.Tensor, good: bool, job: LoadJob) -> None:
        """A read of chunk `c` from tier i that landed in G2 slot `slot`: publish it in G2 (or free
        the slot) and, when good, write it to every parallel tier above i. The rule for every tier."""
        if slot is None:
            return
        assert self.g2 is not None
        info = job.chunk_info(c)
        self.g2.complete_store(c.key, good, info, c.blocks)
        if good:
            for up in self.tiers[:i]:
                if up.mode is TierMode.PARALLEL:
                    self._write_from_g2(up, c.key, buf, wait=False, info=info, blocks=c.blocks)

    def _note_use(self, tiers: list[StorageTier], key: BlockKey, data, blocks: ChunkBlocks | None) -> None:
        """A store or reuse of `key` (`blocks`: its G1 blocks, for the KV event of a write): the
        batched tiers among `tiers` count it towards min_uses."""
        for t in tiers:
            if t.remote is not None:
                t.remote.note_use(key, data, blocks)

    def _write_from_g2(self, tier: StorageTier, key: BlockKey, buf: torch.Tensor, wait: bool, info: BlockInfo,
                       blocks: ChunkBlocks | None) -> bool:
        """Queue a parallel tier's write of the G2 slot `buf`, pinned until written (a copy, not
        a use of it in G2)."""
        assert self.g2 is not None and tier.writer is not None
        if self.g2.prepare_load([key]) is None:
            return False
        return tier.writer.submit(key, buf, lambda: self.g2.complete_load([key]), wait, info, blocks)  # type: ignore[union-attr]

    def _bounce_buffer(self, i: int) -> torch.Tensor:
        return self._targets.bounce(i, pinned=self.kv_cache is not None and self.kv_cache.is_cuda)

    def _run_store(self, job: StoreJob) -> None:
        try:
            self.store(job, wait_for_write_slot=True)
        except (RuntimeError, OSError, ValueError) as e:
            log.warning("offload store failed (block not offloaded): %s", e)
        finally:
            self.reports.put(StoreDone(job.key))

    def store(self, job: StoreJob, wait_for_write_slot: bool) -> bool:
        """Copies job.src out of G1 into G2 (then writes the tiers below from there) or, with no
        G2, into a buffer written to every storage tier. False if no tier took it. Runs on the
        transfer thread, or on the step loop for a write-back (`wait_for_write_slot=False`: a
        full write queue drops it)."""
        if self.g2 is not None:
            slot = self.g2.prepare_store(job.key, job.digest)
            if slot is None:
                return False
            buf = self.g2.slot_view(slot)
            with self.g1.stream.scope():  # on CUDA: after the forward that wrote src, synced here
                self.g1.gather(job.src, buf, job)
            self.g2.complete_store(job.key, True, job.info, job.blocks)
            for tier in self.tiers:
                if tier.writer is not None and tier.admit(job.key, job.info):
                    self._write_from_g2(tier, job.key, buf, wait_for_write_slot, job.info, job.blocks)
            self._note_use(self.tiers, job.key, lambda: bytes(buf.numpy()), job.blocks)
            return True
        said = {t.name: t.admission(job.key, job.info) for t in self.tiers if t.writer is not None}
        writes = [t for t in self.tiers if said.get(t.name) is Admission.WRITE]
        remote = any(t.remote is not None for t in self.tiers)
        taken = remote or Admission.HELD in said.values()
        if not (writes or remote):  # nothing to copy out of G1 for
            return taken
        buf = torch.empty(self.layout.encoded_bytes, dtype=torch.uint8)
        with self.g1.stream.scope():
            self.g1.gather(job.src, buf, job)
        self._note_use(self.tiers, job.key, lambda: bytes(buf.numpy()), job.blocks)
        for tier in writes:
            writer = tier.writer
            assert writer is not None  # `said` holds the tiers with writers
            taken = writer.submit(job.key, buf, lambda: None, wait_for_write_slot, job.info, job.blocks) or taken
        return taken

    def flush(self) -> None:
        """Wait until every queued store and tier write has finished."""
        self._xfer.submit(lambda: None).result()
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        self.flush()
        self._xfer.shutdown(wait=True)
        if not self._reads.shutdown(READS_SHUTDOWN_S):
            log.warning("offload read threads still busy after %.0fs at shutdown (a read stuck in the kernel); "
                        "not waiting for them", READS_SHUTDOWN_S)
        self.g1.close()
        for tier in self.tiers:
            tier.close()
