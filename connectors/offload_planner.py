"""The offload planner (scheduler side): lookups, load and store plans, counters. No tensors.

Lookup: at admission, the longest run of consecutive offload blocks found in G2, then in each
storage tier in order (each tier asked only for what the ones above lack). Load plan: the G1 blocks to fill and the
G2 slots to read, pinned here so the slots cannot be evicted before the transfer engine reads
them. Store plan: each offload block a step completes, its G1 blocks held (an extra ref) until
the transfer engine reports the copy done; with write-back, marked dirty instead.
"""
from __future__ import annotations

from connectors.base import ConnectorMeta, RequestView
from connectors.codec import BlockLayout
from connectors.offload_plans import Chunk, LoadJob, StoreJob
from connectors.offload_transfer import HOST
from connectors.storage_tier import StorageTier
from connectors.writeback import WriteBackTracker
from kvstore.g1 import BlockId, BlockPool
from kvstore.host import HostTier
from kvstore.keys import BlockKey, extend_keys, token_digest


class OffloadPlanner:
    def __init__(self, layout: BlockLayout, pool: BlockPool, g2: HostTier | None, tiers: list[StorageTier],
                 write_back: WriteBackTracker | None) -> None:
        self.layout, self.pool, self.g2, self.tiers = layout, pool, g2, tiers
        self.write_back = write_back
        self.g1_per_chunk = layout.g1_blocks
        self._plans: dict[str, tuple[int, list[Chunk]]] = {}  # req id -> (computed tokens, chunks found)
        self._new_loads: list[LoadJob] = []
        self._split: dict[str, dict[str, int]] = {}  # req id -> tokens each tier will supply to its load
        self._stored_upto: dict[str, int] = {}  # req id -> chunks already considered for storing
        self._inflight: set[BlockKey] = set()
        self._counted: set[str] = set()  # requests whose lookup is already in the stats
        self._held: dict[BlockKey, tuple[BlockId, ...]] = {}  # G1 refs held by stores in flight
        # tokens looked up in each tier and not found there
        self.tier_misses: dict[str, int] = dict.fromkeys([HOST, *(t.name for t in tiers)], 0)
        self.lookup_tokens = 0  # tokens looked up below G1

    def _chunk_keys(self, request: RequestView, start: int, end: int) -> list[tuple[int, BlockKey, bytes]]:
        k, t = self.g1_per_chunk, self.layout.tokens
        extend_keys(request.block_keys, request.all_token_ids, self.layout.block_size, request.cache_salt)
        return [(j, request.block_keys[(j + 1) * k - 1], token_digest(request.all_token_ids[j * t:(j + 1) * t]))
                for j in range(start, end)]

    def match(self, request: RequestView, num_computed_tokens: int) -> int:
        """Tokens beyond `num_computed_tokens` the tiers below G1 hold (planned for loading)."""
        t = self.layout.tokens
        first = num_computed_tokens // t
        # Every offload block wholly inside the known tokens, the one holding the last token
        # included: it is loaded whole, and only the last token is recomputed (over the copy),
        # so a hit computes 1 token instead of up to a block.
        last = request.num_tokens // t
        if last <= first:
            return 0
        found: list[Chunk] = []
        cands = self._chunk_keys(request, first, last)
        # Admission may be retried while G1 is full: count each request's lookup once.
        count = request.request_id not in self._counted
        self._counted.add(request.request_id)
        rest = cands
        if self.g2 is not None:
            n = self.g2.lookup([c[1] for c in cands], [c[2] for c in cands])
            found = [Chunk(j, key, dig, HOST) for j, key, dig in cands[:n]]
            self.tier_misses[HOST] += (len(cands) - n) * t * count
            rest = cands[n:]
        for tier in self.tiers:
            if not rest:
                break
            n = tier.lookup([c[1] for c in rest])
            found += [Chunk(j, key, dig, tier.name) for j, key, dig in rest[:n]]
            self.tier_misses[tier.name] += (len(rest) - n) * t * count
            rest = rest[n:]
        self.lookup_tokens += (last - first) * t * count
        if not found:
            return 0
        n = min((first + len(found)) * t, request.num_tokens - 1) - num_computed_tokens
        if n <= 0:
            return 0
        self._plans[request.request_id] = (num_computed_tokens, found)
        return n

    def plan_load(self, request: RequestView, block_ids: list[int], num_external_tokens: int) -> None:
        num_computed, chunks = self._plans.pop(request.request_id)
        bs, t = self.layout.block_size, self.layout.tokens
        first_g1 = num_computed // bs
        end = num_computed + num_external_tokens
        g2_slots: dict[BlockKey, int] = {}
        if self.g2 is not None:
            g2_keys = [c.key for c in chunks if c.tier == HOST]
            slots = self.g2.prepare_load(g2_keys, request.priority) if g2_keys else []
            if slots is None:  # evicted since lookup: load nothing, report failure
                chunks = []
            else:
                g2_slots = dict(zip(g2_keys, slots))
        split: dict[str, int] = {}
        for c in chunks:  # what each tier will supply; the engine trims it if the load falls short
            split[c.tier] = split.get(c.tier, 0) + min((c.index + 1) * t, end) - max(c.index * t, num_computed)
        self._split[request.request_id] = split
        dst = tuple(BlockId(b) for b in block_ids[first_g1:-(-end // bs)])
        self._new_loads.append(LoadJob(request.request_id, tuple(chunks), first_g1, dst, end, g2_slots,
                                       request.priority))

    def take_load_split(self, req_id: str) -> dict[str, int]:
        return self._split.pop(req_id, {})

    def build_meta(self, scheduled: list[tuple[RequestView, int, list[int]]]) -> ConnectorMeta:
        meta = ConnectorMeta(loads=self._new_loads)
        self._new_loads = []
        k, t = self.g1_per_chunk, self.layout.tokens
        for req, num_new, table in scheduled:
            done_chunks = (req.num_computed_tokens + num_new) // t
            start = self._stored_upto.get(req.request_id, req.num_computed_tokens // t)
            for j, key, dig in self._chunk_keys(req, start, done_chunks) if done_chunks > start else ():
                if key in self._inflight or (self.g2 is not None and self.g2.contains(key)):
                    continue
                if self.write_back is not None:
                    self.write_back.mark_dirty(key, dig, req.priority, tuple(req.block_keys[j * k:(j + 1) * k]))
                    continue
                src = tuple(BlockId(b) for b in table[j * k:(j + 1) * k])
                self.pool.acquire(list(src))  # keep them from being evicted or reused until copied
                self._held[key] = src
                self._inflight.add(key)
                meta.stores.append(StoreJob(key, dig, src, req.priority))
            self._stored_upto[req.request_id] = max(start, done_chunks)
        return meta

    def store_done(self, key: BlockKey) -> None:
        """The transfer engine copied the block out of G1: drop the held refs."""
        self._inflight.discard(key)
        self.pool.release(reversed(self._held.pop(key)))

    def finished(self, req_id: str) -> None:
        self._stored_upto.pop(req_id, None)
        self._plans.pop(req_id, None)
        self._split.pop(req_id, None)
        self._counted.discard(req_id)

    def busy(self) -> bool:
        return bool(self._held)
