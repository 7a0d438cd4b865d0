"""TieredOffloadConnector: G1 <-> G2 (host memory) <-> G3 (disk, or any StorageBackend)
<-> G4 (a shared remote store, `connectors.remote_tier`).

Write path (write-through, asynchronous): when a request's step completes an offload block
(`layout.tokens` tokens, a multiple of G1's block size), the G1 blocks are held (an extra
ref, so they cannot be evicted or reused) and a transfer thread gathers them into a G2 slot,
then queues a G3 write of that slot on a second thread, and a G4 write (batched, on its own
thread, once the block has been used `g4_min_uses` times). Nothing here blocks the step loop.

Read path: at admission the scheduler asks for hits beyond G1's; the longest run of
consecutive offload blocks found in G2, then G3, then G4 is loaded asynchronously into newly
allocated G1 blocks while the request waits in WAITING_FOR_REMOTE_KVS. A G3 or G4 hit is
promoted into G2 on the way, and a G4 hit into G3 too. A load that fails (corrupt, missing,
raising or hanging backend) reports the request as failed: the engine recomputes those tokens
or fails the request, per `kv_load_failure_policy`. A failing tier never fails the engine.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from connectors.backend import BackendError, StorageBackend
from connectors.base import OFFLOAD_TIERS, ConnectorMeta, KVConnector
from connectors.codec import HEADER_BYTES, BlockLayout, check_header, hidden_payload, payload, write_header
from connectors.remote_tier import RemoteTier
from kvstore.events import BlockStored, EventBuffer
from kvstore.g1 import BlockId, BlockPool
from kvstore.host import HostTier
from kvstore.keys import BlockKey, extend_keys, token_digest

log = logging.getLogger("kvtier.offload")


def backend_name(backend: StorageBackend) -> str:
    """What /v1/kv/stats and the metrics call a tier's backend: its registry name when it was
    built from one (plugin tiers), else its class."""
    return getattr(backend, "name", None) or type(backend).__name__


class WritePolicy(Enum):
    """When G1 blocks are copied down (SGLang HiCache's names)."""

    WRITE_THROUGH = "write_through"  # as soon as an offload block fills: asynchronous, the default
    WRITE_BACK = "write_back"  # when G1 evicts it: less copying, but a copy on the step loop


@dataclass(frozen=True)
class Chunk:
    index: int  # offload block index within the request
    key: BlockKey
    digest: bytes
    tier: str  # "G2" | "G3" | "G4"


@dataclass
class LoadJob:
    req_id: str
    chunks: list[Chunk]
    first_g1: int  # G1 block index (within the request) of the first block to fill
    dst: list[BlockId]  # destination G1 blocks, in order
    end_token: int  # the load supplies tokens before this one (the last block may hold more)
    g2_slots: dict[BlockKey, int] = field(default_factory=dict)  # pinned at prepare time


@dataclass
class StoreJob:
    key: BlockKey
    digest: bytes
    src: list[BlockId]
    priority: int


class TieredOffloadConnector(KVConnector):
    def __init__(self, layout: BlockLayout, pool: BlockPool, g2: HostTier | None, g3: StorageBackend | None,
                 *, g3_timeout_s: float = 10.0, max_pending_writes: int = 64, g3_read_threads: int = 4,
                 write_policy: WritePolicy = WritePolicy.WRITE_THROUGH, g4: RemoteTier | None = None) -> None:
        if g2 is None and g3 is None and g4 is None:
            raise ValueError("the tiered offload connector needs at least one tier (G2, G3 or G4)")
        if write_policy is WritePolicy.WRITE_BACK and not pool.enable_caching:
            raise ValueError("write_back offload needs prefix caching: blocks are written back when the "
                             "prefix cache evicts them, and without it they are never kept to be evicted")
        self.layout, self.pool, self.g2, self.g3, self.g4 = layout, pool, g2, g3, g4
        self.g1_per_chunk = layout.g1_blocks
        self.layout_id = layout.layout_id()
        self.g3_timeout_s = g3_timeout_s
        self.kv_cache: torch.Tensor | None = None
        self.hidden_cache: torch.Tensor | None = None  # exported hidden states, when the layout has them
        self._plans: dict[str, tuple[int, list[Chunk]]] = {}
        self._new_loads: list[LoadJob] = []
        self._stored_upto: dict[str, int] = {}  # req id -> chunks already considered for storing
        self._inflight: set[BlockKey] = set()
        self._counted: set[str] = set()  # requests whose lookup is already in the stats
        self._held: dict[BlockKey, list[BlockId]] = {}  # G1 refs held by stores in flight
        self._done: queue.SimpleQueue[tuple[str, Any, bool]] = queue.SimpleQueue()
        self._progress = threading.Event()  # set with every _done item: the idle engine waits on it
        self._failed_blocks: set[int] = set()
        self._xfer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-xfer")  # FIFO: loads and G2 stores
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvtier-g3")  # G3 writes, in order
        if g3_read_threads < 1:
            raise ValueError(f"g3_read_threads must be >= 1; got {g3_read_threads}")
        self._reads = ThreadPoolExecutor(g3_read_threads, thread_name_prefix="kvtier-g3-read")
        self.g3_read_threads = g3_read_threads
        self._read_window = 2 * g3_read_threads  # reads one load keeps in flight
        self._bounce: list[torch.Tensor | None] = [None] * self._read_window  # read targets outside G2
        self._write_slots = threading.BoundedSemaphore(max_pending_writes)
        self.tier_hits = dict.fromkeys(OFFLOAD_TIERS, 0)  # tokens served
        self.tier_misses = dict.fromkeys(OFFLOAD_TIERS, 0)  # tokens looked up in the tier and not found there
        self.lookup_tokens = 0  # tokens looked up below G1
        self.load_failures = 0
        self.load_seconds = 0.0  # wall time of load jobs on the transfer thread
        self.load_bytes = 0  # KV bytes those jobs placed into G1
        self.g2_copies = 0  # copy operations G2 loads took (fewer: longer consecutive runs)
        self.events: EventBuffer | None = None
        self.write_policy = write_policy
        # Write-back: offload blocks that filled in G1 and are not below it yet, by their last
        # G1 block's key -> (token digest, priority, keys of their G1 blocks); and the reverse.
        self._dirty: dict[BlockKey, tuple[bytes, int, tuple[BlockKey, ...]]] = {}
        self._dirty_chunk: dict[BlockKey, BlockKey] = {}
        self.writeback_blocks = 0  # offload blocks written back on eviction
        self.writeback_dropped = 0  # ... that could not be (a G1 block already gone, no room, no write slot)
        if write_policy is WritePolicy.WRITE_BACK:
            pool.evict_hooks.append(self._write_back)

    # ---- scheduler side ----------------------------------------------------------------
    def _chunk_keys(self, request, start: int, end: int) -> list[tuple[int, BlockKey, bytes]]:
        k, t = self.g1_per_chunk, self.layout.tokens
        extend_keys(request.block_keys, request.all_token_ids, self.layout.block_size, request.cache_salt)
        return [(j, request.block_keys[(j + 1) * k - 1], token_digest(request.all_token_ids[j * t:(j + 1) * t]))
                for j in range(start, end)]

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        t = self.layout.tokens
        first = num_computed_tokens // t
        # Every offload block wholly inside the known tokens, the one holding the last token
        # included: it is loaded whole, and only the last token is recomputed (over the copy),
        # so a hit computes 1 token instead of up to a block.
        last = request.num_tokens // t
        if last <= first:
            return 0, False
        found: list[Chunk] = []
        cands = self._chunk_keys(request, first, last)
        # Admission may be retried while G1 is full: count each request's lookup once.
        count = request.request_id not in self._counted
        self._counted.add(request.request_id)
        if self.g2 is not None:
            n = self.g2.lookup([c[1] for c in cands], [c[2] for c in cands])
            found = [Chunk(j, key, dig, "G2") for j, key, dig in cands[:n]]
            self.tier_misses["G2"] += (len(cands) - n) * t * count
        rest = cands[len(found):]
        if rest and self.g3 is not None:
            try:
                exists = self.g3.exists([c[1] for c in rest])
            except (BackendError, OSError) as e:
                log.warning("G3 lookup failed, treating as a miss: %s", e)
                exists = []
            before = len(found)
            for (j, key, dig), ok in zip(rest, exists):
                if not ok:
                    break
                found.append(Chunk(j, key, dig, "G3"))
            self.tier_misses["G3"] += (len(rest) - (len(found) - before)) * t * count
        rest = cands[len(found):]
        if rest and self.g4 is not None:
            n = self.g4.lookup([c[1] for c in rest])  # one round trip for the whole prompt
            found += [Chunk(j, key, dig, "G4") for j, key, dig in rest[:n]]
            self.tier_misses["G4"] += (len(rest) - n) * t * count
        self.lookup_tokens += (last - first) * t * count
        if not found:
            return 0, False
        n = min((first + len(found)) * t, request.num_tokens - 1) - num_computed_tokens
        if n <= 0:
            return 0, False
        self._plans[request.request_id] = (num_computed_tokens, found)
        return n, True

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        num_computed, chunks = self._plans.pop(request.request_id)
        bs = self.layout.block_size
        first_g1 = num_computed // bs
        end = num_computed + num_external_tokens
        job = LoadJob(request.request_id, chunks, first_g1, list(block_ids[first_g1:-(-end // bs)]), end)
        if self.g2 is not None:
            g2_keys = [c.key for c in chunks if c.tier == "G2"]
            slots = self.g2.prepare_load(g2_keys) if g2_keys else []
            if slots is None:  # evicted since lookup: load nothing, report failure
                job.chunks = []
            else:
                job.g2_slots = dict(zip(g2_keys, slots))
        request.pending_by_tier = {}
        for c in job.chunks:  # what each tier will supply; the engine trims it if the load falls short
            n = min((c.index + 1) * self.layout.tokens, end) - max(c.index * self.layout.tokens, num_computed)
            request.pending_by_tier[c.tier] = request.pending_by_tier.get(c.tier, 0) + n
        self._new_loads.append(job)

    def build_connector_meta(self, scheduled) -> ConnectorMeta:
        meta = ConnectorMeta(loads=self._new_loads)
        self._new_loads = []
        k, t = self.g1_per_chunk, self.layout.tokens
        for req, num_new, table in scheduled:
            done_chunks = (req.num_computed_tokens + num_new) // t
            start = self._stored_upto.get(req.request_id, req.num_computed_tokens // t)
            for j, key, dig in self._chunk_keys(req, start, done_chunks) if done_chunks > start else ():
                if key in self._inflight or (self.g2 is not None and self.g2.contains(key)):
                    continue
                if self.write_policy is WritePolicy.WRITE_BACK:
                    self._mark_dirty(key, dig, req.priority, tuple(req.block_keys[j * k:(j + 1) * k]))
                    continue
                src = [BlockId(b) for b in table[j * k:(j + 1) * k]]
                self.pool.acquire(src)  # keep them from being evicted or reused until copied
                self._held[key] = src
                self._inflight.add(key)
                meta.stores.append(StoreJob(key, dig, src, req.priority))
            self._stored_upto[req.request_id] = max(start, done_chunks)
        return meta

    def _mark_dirty(self, key: BlockKey, digest: bytes, priority: int, block_keys: tuple[BlockKey, ...]) -> None:
        if key in self._dirty:
            return
        if len(self._dirty) > 2 * self.pool.num_blocks:  # forget chunks whose blocks were never cached
            for ck in [ck for ck, (_, _, bks) in self._dirty.items() if self.pool.lookup(bks[-1]) is None]:
                self._forget_dirty(ck)
        self._dirty[key] = (digest, priority, block_keys)
        for bk in block_keys:
            self._dirty_chunk[bk] = key

    def _forget_dirty(self, key: BlockKey) -> tuple[bytes, int, tuple[BlockKey, ...]]:
        entry = self._dirty.pop(key)
        for bk in entry[2]:
            self._dirty_chunk.pop(bk, None)
        return entry

    def _write_back(self, victims: list[BlockId]) -> None:
        """G1 is about to reuse `victims` (their bytes are still valid): copy each dirty offload
        block they belong to into G2 now, synchronously, since the next forward may overwrite
        them. G3 writes of those copies stay asynchronous."""
        chunks = {self._dirty_chunk.get(self.pool.key_of(b)) for b in victims}  # type: ignore[arg-type]
        for ck in chunks - {None}:
            digest, priority, block_keys = self._forget_dirty(ck)  # type: ignore[arg-type]
            src = [self.pool.lookup(bk) for bk in block_keys]
            if any(b is None for b in src):  # part of it was reused without being cached
                self.writeback_dropped += 1
                continue
            if self._store(StoreJob(ck, digest, src, priority), wait_for_write_slot=False):  # type: ignore[arg-type]
                self.writeback_blocks += 1
            else:
                self.writeback_dropped += 1

    def request_finished(self, request, block_ids):
        self._stored_upto.pop(request.request_id, None)
        self._plans.pop(request.request_id, None)
        self._counted.discard(request.request_id)
        return False, None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        received: set[str] = set()
        while True:
            try:
                kind, ident, ok = self._done.get_nowait()
            except queue.Empty:
                break
            if kind == "load":
                req_id, failed_blocks = ident
                received.add(req_id)
                if failed_blocks:
                    self._failed_blocks.update(failed_blocks)
                    self.load_failures += 1
            else:  # a store finished copying out of G1: drop the held refs
                self._inflight.discard(ident)
                self.pool.release(reversed(self._held.pop(ident)))
        return set(), received

    def busy(self) -> bool:
        return bool(self._held)

    def _signal(self, item: tuple[str, Any, bool]) -> None:
        self._done.put(item)
        self._progress.set()

    def wait_for_progress(self, timeout: float) -> None:
        # A set that lands between wait() and clear() is not lost: its item is already queued,
        # and the engine drains the queue before it waits again.
        self._progress.wait(timeout)
        self._progress.clear()

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ---- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def register_hidden_cache(self, hidden_cache: torch.Tensor) -> None:
        if not self.layout.hidden_layer_ids:
            raise ValueError("this offload layout carries no hidden states")
        self.hidden_cache = hidden_cache

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        for job in meta.loads:
            self._xfer.submit(self._run_load, job)

    def wait_for_save(self, meta: ConnectorMeta) -> None:
        for job in meta.stores:
            self._xfer.submit(self._run_store, job)

    def _run_load(self, job: LoadJob) -> None:
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
            self._signal(("load", (job.req_id, job.dst[landed:]), True))

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
            self._store(job, wait_for_write_slot=True)
        except (RuntimeError, OSError, ValueError) as e:
            log.warning("offload store failed (block not offloaded): %s", e)
        finally:
            self._signal(("store", job.key, True))

    def _store(self, job: StoreJob, wait_for_write_slot: bool) -> bool:
        """Copies job.src out of G1 into G2 (then queues G3 from there) or, with no G2, into a
        buffer queued for G3. False if no tier took it."""
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

    # ---- lifecycle ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lookup_tokens": self.lookup_tokens, "load_failures": self.load_failures,
                               "load_seconds": self.load_seconds, "load_bytes": self.load_bytes,
                               "g2_load_copies": self.g2_copies,
                               "write_policy": self.write_policy.value}
        if self.write_policy is WritePolicy.WRITE_BACK:
            out.update(writeback_blocks=self.writeback_blocks, writeback_dropped=self.writeback_dropped,
                       dirty_blocks=len(self._dirty))
        if self.g2 is not None:
            s = self.g2.stats
            out["G2"] = {"backend": "host", "hit_tokens": self.tier_hits["G2"], "miss_tokens": self.tier_misses["G2"],
                         "blocks": len(self.g2), "capacity_blocks": self.g2.num_slots, "corrupt": s.corrupt,
                         "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "evictions": s.evictions}
        if self.g3 is not None:
            s3 = getattr(self.g3, "stats", None)
            out["G3"] = {"backend": backend_name(self.g3), "hit_tokens": self.tier_hits["G3"],
                         "miss_tokens": self.tier_misses["G3"], **(vars(s3) if s3 is not None else {})}
        if self.g4 is not None:
            out["G4"] = {"backend": backend_name(self.g4.backend), **self.g4.stats(), "hit_tokens": self.tier_hits["G4"], "miss_tokens": self.tier_misses["G4"]}
        return out

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
