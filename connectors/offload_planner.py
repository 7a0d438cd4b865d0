"""The offload planner (scheduler side): lookups, load and store plans, counters. No tensors.

Lookup: at admission, the longest run of consecutive offload blocks found in G2, then in each
storage tier in order (each tier asked only for what the ones above lack). Load plan: the G1 blocks to fill and the
G2 slots to read, pinned here so the slots cannot be evicted before the transfer engine reads
them. Store plan: each offload block a step completes, its G1 blocks held (an extra ref) until
the transfer engine reports the copy done; with write-back, marked dirty instead.

With KV groups (`set_windows`, engine/kv/kv_groups.py) every group's share of an offload block is an
entry of its own (keyed `group_key(key, g)`; group 0 keeps the plain key). A hit of N tokens
needs every full-attention group's entries up to N but a sliding group's only for its window
before N, so a load moves the full layers' history and the sliding layers' last window; a store
copies what each group still holds (a sliding group's blocks that left its window are gone).

KV events: while they are on (the pool has an event sink), group 0's store jobs and found
chunks carry the G1 blocks they hold (`ChunkBlocks`: G1 keys, parent, tokens), read off the
request here, so each tier that takes the block announces it in G1 terms.
"""
from __future__ import annotations

from dataclasses import replace

from connectors.base import ConnectorMeta, RequestView
from connectors.codec import BlockLayout
from connectors.offload_plans import Chunk, LoadDone, LoadJob, StoreJob
from connectors.offload_transfer import HOST
from connectors.storage_tier import StorageTier
from connectors.writeback import WriteBackTracker
from kvstore.events import ChunkBlocks
from kvstore.g1 import BlockId, BlockPool
from kvstore.host import HostTier
from kvstore.keys import BlockKey, group_key, token_digest
from policies import BlockInfo

RESTORE_KEYS = 4096  # keys remembered for storing again (OffloadPlanner.restore)
Cand = tuple[int, BlockKey, bytes, BlockKey | None]  # (offload block index, key, token digest, previous block's key)


def _gkey(key: BlockKey, group: int) -> BlockKey:
    return key if group == 0 else group_key(key, group)


def _gcand(c: Cand, group: int) -> Cand:
    """`c` as KV group `group`'s entry."""
    j, key, dig, parent = c
    return j, _gkey(key, group), dig, None if parent is None else _gkey(parent, group)


def _use(request: RequestView) -> BlockInfo:
    """The request's side of what the tiers' policies get for its blocks (depth and parent are
    each block's)."""
    return BlockInfo(arrival=request.arrival_time, priority=request.priority, session=request.session)


def leading_run(g2: HostTier | None, tiers: list[StorageTier], cands: list[Cand]) -> tuple[list[Chunk], dict[str, int]]:
    """The leading run of `cands` found below G1: in G2, then each tier for what the ones above
    lack; and how many candidates each tier that was asked lacked. Also a tensor-parallel
    worker's view of a load rank 0 planned (connectors/sharded.py): its own tiers, same rule."""
    found: list[Chunk] = []
    misses: dict[str, int] = {}
    rest = cands
    if g2 is not None:
        n = g2.lookup([c[1] for c in cands], [c[2] for c in cands])
        found = [Chunk(j, key, dig, HOST, parent) for j, key, dig, parent in cands[:n]]
        misses[HOST] = len(cands) - n
        rest = cands[n:]
    for tier in tiers:
        if not rest:
            break
        n = tier.lookup([c[1] for c in rest])
        found += [Chunk(j, key, dig, tier.name, parent) for j, key, dig, parent in rest[:n]]
        misses[tier.name] = len(rest) - n
        rest = rest[n:]
    return found, misses


class OffloadPlanner:
    def __init__(self, layout: BlockLayout, pool: BlockPool, g2: HostTier | None, tiers: list[StorageTier],
                 write_back: WriteBackTracker | None) -> None:
        self.layout, self.pool, self.g2, self.tiers = layout, pool, g2, tiers
        self.write_back = write_back
        self.g1_per_chunk = layout.g1_blocks
        # req id -> (computed tokens, each KV group's chunks found)
        self._plans: dict[str, tuple[int, dict[int, list[Chunk]]]] = {}
        self._new_loads: list[LoadJob] = []
        self._split: dict[str, dict[str, int]] = {}  # req id -> tokens each tier will supply to its load
        self._stored_upto: dict[str, int] = {}  # req id -> chunks already considered for storing
        self._inflight: set[BlockKey] = set()
        self._counted: set[str] = set()  # requests whose lookup is already in the stats
        self._held: dict[BlockKey, tuple[BlockId, ...]] = {}  # G1 refs held by stores in flight
        # tokens looked up in each tier and not found there
        self.tier_misses: dict[str, int] = dict.fromkeys([HOST, *(t.name for t in tiers)], 0)
        self.lookup_tokens = 0  # tokens looked up below G1
        self.windows: tuple[int, ...] = (0,)  # per KV group: 0 full attention, else its sliding window
        self.grouped = False  # tables come one per group (set_windows)
        self._loads_left: dict[str, int] = {}  # req id -> its group loads not finished yet
        self._load_dst0: dict[str, tuple[BlockId, ...]] = {}  # req id -> group 0's destination blocks
        self._load_bad: dict[str, int] = {}  # req id -> first failed position in group 0's destination
        # req id -> keys of the chunk holding a hit's last token, loaded whole: the step that
        # recomputes that token completes the chunk, and storing it again would rewrite what the
        # tier already holds (G3 rewrote a repeated prompt's last entry on every repeat)
        self._loaded_tail: dict[str, set[BlockKey]] = {}
        # Keys G2 here holds that another tensor-parallel rank lacks (connectors/sharded.py): stored
        # again, on every rank, the next time a request computes them (ordered: oldest first)
        self._restore: dict[BlockKey, None] = {}

    def set_windows(self, windows: tuple[int, ...]) -> None:
        self.windows, self.grouped = windows, True

    def _chunk_keys(self, request: RequestView, start: int, end: int) -> list[Cand]:
        k, t = self.g1_per_chunk, self.layout.tokens
        keys = request.full_block_keys(self.layout.block_size)
        return [(j, keys[(j + 1) * k - 1], token_digest(request.all_token_ids[j * t:(j + 1) * t]),
                 keys[j * k - 1] if j else None) for j in range(start, end)]

    def prompt_chunk_keys(self, request: RequestView) -> list[BlockKey]:
        """The keys of the offload blocks wholly inside the request's prompt, in order."""
        return [c[1] for c in self._chunk_keys(request, 0, request.num_prompt_tokens // self.layout.tokens)]

    def _blocks(self, request: RequestView, j: int) -> ChunkBlocks | None:
        """Offload block j's G1 blocks as KV events name them; None while events are off.
        Needs the request's keys extended past it (`_chunk_keys` does)."""
        if self.pool.events is None:
            return None
        k, t = self.g1_per_chunk, self.layout.tokens
        keys = request.full_block_keys(self.layout.block_size)
        return ChunkBlocks(tuple(keys[j * k:(j + 1) * k]), keys[j * k - 1] if j else None,
                           tuple(request.all_token_ids[j * t:(j + 1) * t]), self.layout.block_size, request.lora_tag)

    def _run(self, cands: list[Cand], count: bool) -> list[Chunk]:
        """The leading run of `cands` found below G1 (`leading_run`). `count`: add the misses to
        the per-tier counters."""
        found, misses = leading_run(self.g2, self.tiers, cands)
        if count:
            for name, n in misses.items():
                self.tier_misses[name] += n * self.layout.tokens
        return found

    def _first_chunk(self, group: int, end_token: int) -> int:
        """The first offload block a sliding group needs for a hit ending at `end_token`: the one
        holding the first G1 block a query at that position can see."""
        w = self.windows[group]
        return max(0, end_token - w + 1) // self.layout.block_size // self.g1_per_chunk if w else 0

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
        cands = self._chunk_keys(request, first, last)
        # Admission may be retried while G1 is full: count each request's lookup once.
        count = request.request_id not in self._counted
        self._counted.add(request.request_id)
        runs = {0: self._run(cands, count)}
        self.lookup_tokens += (last - first) * t * count
        end = first + len(runs[0])  # offload blocks every group can serve end here
        for g in range(1, len(self.windows)):  # full groups: the whole run
            if not self.windows[g]:
                runs[g] = self._run([_gcand(c, g) for c in cands[:end - first]], False)
                end = first + len(runs[g])
        end = self._sliding_runs(request, cands, first, end, runs)
        n = min(end * t, request.num_tokens - 1) - num_computed_tokens
        if n <= 0:
            return 0
        if self.pool.events is not None:  # a chunk promoted into G2 (or written on) on the load is announced
            runs[0] = [replace(c, blocks=self._blocks(request, c.index)) for c in runs[0] if c.index < end]
        self._plans[request.request_id] = (num_computed_tokens, {g: [c for c in run if c.index < end]
                                                                 for g, run in runs.items()})
        return n

    def _sliding_runs(self, request: RequestView, cands: list[Cand], first: int, end: int,
                      runs: dict[int, list[Chunk]]) -> int:
        """Shortens `end` (offload blocks) until every sliding group holds the blocks its window
        needs before the hit's last token; fills `runs` for them. Returns the end."""
        sliding = [g for g, w in enumerate(self.windows) if w]
        while sliding and end > first:
            last_token = min(end * self.layout.tokens, request.num_tokens - 1)
            for g in sliding:
                s = max(first, self._first_chunk(g, last_token))
                runs[g] = self._run([_gcand(c, g) for c in cands[s - first:end - first]], False)
                if len(runs[g]) < end - s:  # a hit must end before the missing block
                    end = s + len(runs[g])
                    break
            else:
                break
        return end

    def plan_load(self, request: RequestView, block_ids, num_external_tokens: int) -> None:
        """`block_ids`: the request's G1 table, or with KV groups one table per group."""
        num_computed, runs = self._plans.pop(request.request_id)
        tables = block_ids if self.grouped else (block_ids,)
        bs, t = self.layout.block_size, self.layout.tokens
        end = num_computed + num_external_tokens
        slots: dict[BlockKey, int] = {}
        use = _use(request)
        if self.g2 is not None:
            g2_chunks = [c for run in runs.values() for c in run if c.tier == HOST]
            g2_keys = [c.key for c in g2_chunks]
            infos = [replace(use, depth=c.index, parent=c.parent) for c in g2_chunks]
            got = self.g2.prepare_load(g2_keys, infos) if g2_keys else []
            if got is None:  # evicted since lookup: load nothing, report failure
                runs = {g: [] for g in runs}
            else:
                slots = dict(zip(g2_keys, got))
        split: dict[str, int] = {}
        for i, c in enumerate(runs[0]):  # what each tier will supply; the engine trims it if the load falls short
            # (a sliding group 0 loads only its window: the tokens before it count to the first block's tier)
            start = num_computed if i == 0 else max(c.index * t, num_computed)
            split[c.tier] = split.get(c.tier, 0) + min((c.index + 1) * t, end) - start
        self._split[request.request_id] = split
        jobs = []
        for g, run in sorted(runs.items()):
            w = self.windows[g]
            first_g1 = max(num_computed // bs, max(0, end - w + 1) // bs if w else 0)
            dst = tuple(BlockId(b) for b in tables[g][first_g1:-(-end // bs)])
            jobs.append(LoadJob(request.request_id, tuple(run), first_g1, dst, end,
                                {c.key: slots[c.key] for c in run if c.key in slots}, use, g,
                                skipped_tokens=first_g1 * bs - num_computed))
        if end % t:
            self._loaded_tail[request.request_id] = {c.key for run in runs.values() for c in run if c.index == end // t}
        self._loads_left[request.request_id] = len(jobs)
        self._load_dst0[request.request_id] = jobs[0].dst
        self._new_loads += jobs

    def load_done(self, done: LoadDone) -> tuple[BlockId, ...] | None:
        """One group's load finished. None while the request's other groups are loading; then
        the blocks of group 0's destination to report failed: from the earliest failure in any
        group (full groups' destinations start at the same block), or all of it where there are
        sliding groups (their window was loaded for the hit's end, not for a shorter hit)."""
        req_id = done.req_id
        if done.failed_blocks:
            self._loaded_tail.pop(req_id, None)  # a damaged tail was dropped by its tier: store it anew
            pos = 0 if any(self.windows) else done.num_filled
            self._load_bad[req_id] = min(self._load_bad.get(req_id, pos), pos)
        self._loads_left[req_id] -= 1
        if self._loads_left[req_id]:
            return None
        del self._loads_left[req_id]
        dst0 = self._load_dst0.pop(req_id)
        bad = self._load_bad.pop(req_id, None)
        return () if bad is None else dst0[bad:]

    def take_load_split(self, req_id: str) -> dict[str, int]:
        return self._split.pop(req_id, {})

    def build_meta(self, scheduled: list[tuple[RequestView, int, list]]) -> ConnectorMeta:
        """`scheduled`: (request, new tokens, its G1 table, or with KV groups one table per group
        with -1 where the request holds no block)."""
        meta = ConnectorMeta(loads=self._new_loads)
        self._new_loads = []
        k, t = self.g1_per_chunk, self.layout.tokens
        for req, num_new, table in scheduled:
            tables = table if self.grouped else (table,)
            done_chunks = (req.num_computed_tokens + num_new) // t
            start = self._stored_upto.get(req.request_id, req.num_computed_tokens // t)
            chunks = self._chunk_keys(req, start, done_chunks) if done_chunks > start else []
            use = _use(req)
            for g, tab in enumerate(tables):  # group by group: a group's blocks take consecutive G2 slots
                for c in chunks:
                    j, key, dig, parent = _gcand(c, g)
                    src = tuple(BlockId(b) for b in tab[j * k:(j + 1) * k])
                    if min(src) >= 0:  # a sliding group may have released them
                        # Events describe token blocks: group 0's entries stand for them.
                        self._store(meta, req, key, dig, src, replace(use, depth=j, parent=parent), g == 0)
            self._stored_upto[req.request_id] = max(start, done_chunks)
        return meta

    def restore(self, keys: list[BlockKey]) -> None:
        """Another rank lacks these though this rank's G2 may hold them: store them again when
        next computed (the ranks that hold them skip the copy)."""
        for key in keys:
            self._restore[key] = None
        while len(self._restore) > RESTORE_KEYS:
            del self._restore[next(iter(self._restore))]

    def _store(self, meta: ConnectorMeta, req: RequestView, key: BlockKey, dig: bytes, src: tuple[BlockId, ...],
               info: BlockInfo, announce: bool) -> None:
        again = self._restore.pop(key, False) is None
        held = (self.g2 is not None and self.g2.contains(key)) or key in self._loaded_tail.get(req.request_id, ())
        if key in self._inflight or (held and not again):
            return
        if self.write_back is not None:
            # WriteBackTracker builds its StoreJob without `blocks`: write-back stores go unannounced.
            k, j = self.g1_per_chunk, info.depth
            self.write_back.mark_dirty(key, dig, info, tuple(req.full_block_keys(self.layout.block_size)[j * k:(j + 1) * k]))
            return
        self.pool.acquire(list(src))  # keep them from being evicted or reused until copied
        self._held[key] = src
        self._inflight.add(key)
        meta.stores.append(StoreJob(key, dig, src, info, self._blocks(req, info.depth) if announce else None))

    def store_done(self, key: BlockKey) -> None:
        """The transfer engine copied the block out of G1: drop the held refs."""
        self._inflight.discard(key)
        self.pool.release(reversed(self._held.pop(key)))

    def finished(self, req_id: str) -> None:
        self._stored_upto.pop(req_id, None)
        self._loaded_tail.pop(req_id, None)
        self._plans.pop(req_id, None)
        self._split.pop(req_id, None)
        self._counted.discard(req_id)

    def busy(self) -> bool:
        return bool(self._held)
