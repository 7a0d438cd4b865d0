"""Which KV blocks each replica holds, and in which tier, rebuilt from its KV events (the consumer side).

For a cache-aware router or an operator (`kvtier kv events`). Pure Python over msgpack: no torch,
no zmq (the caller owns the transport and hands over each ZMQ message's frames).

The wire format, its two event forms and the medium -> tier mapping are `kvtools.residency_wire`'s
(re-exported here). A medium it does not know is counted as "other" and logged once. Events of a
KV group other than 0 are counted and skipped: residency describes token blocks, as G1's events
do (engine/kv/kv_cache_manager.py).

Units. Each resident hash is kept with the tokens it covers (its event's block_size). Counts are
G1-granular: `blocks` = resident tokens // the G1 block size (given, else the smallest block_size
any event carried: G1 events and self-describing offload events carry it). Self-describing offload
events list an offload block's G1 hashes (k of them for kv_offload_block_size = k * block_size); the
array form names an offload block by one hash (its last G1 block's) with block_size = the offload
block's tokens; both count k G1 blocks per offload block. `prefix_depth` handles both.

Lining up with `GET /v1/kv/stats` (`compare_with_stats`, server/routes.py):
- G1: `tiers.G1.cached_blocks` (the prefix cache's blocks) must equal the resident G1 blocks (a
  server without that count: only cached blocks <= num_blocks).
- G2: `tiers.G2.blocks` counts offload blocks; times k (an offload block's tokens, learned as the
  smallest span one G2 store event covered, // block size) it must equal the resident G2 blocks.
- G3 (local storage: the disk, parallel plugin tiers): `entries` times k must equal the resident G3
  blocks while the disk has evicted nothing (its evictions are not announced) and the view started
  at sequence 0; a backend without an entry count is shown, not compared.
- G4 (remote storage: Redis, batched tiers): `written_blocks` (offload blocks this replica wrote)
  times k against the G1 blocks this replica's G4 store events named.
kvtier announces no G3 or G4 removals (the disk's evictions are internal to it; Redis evicts on
its own), so their resident counts are what was stored since the view began: an upper bound.
A tier whose view is stale is never compared (match None); G4's counters also need the view to
have started at sequence 0. Expect a step's skew on a busy replica: events go out once per step.

Staleness: sequence numbers must run 0, 1, 2, ... A first batch above 0 (joined late), a skipped
number (a gap: ZMQ dropped messages), or an undecodable message marks every tier stale for good:
events were lost, so the view may be wrong and says so. Going back (a restarted publisher)
empties G1 and G2 (a new process starts with empty memory tiers; exact again if it restarted at 0)
and marks G3 and G4 stale (the new process's start-up scan publishes nothing). AllBlocksCleared (a
G1 prefix-cache reset in vLLM) empties G1 and makes it exact again.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from kvtools.residency_wire import (BlockHash, BlockRemoved, BlockStored, Cleared, DecodeError, Event, EventBatch,
                                    Tier, UnknownEvent, decode_event, decode_message, decode_payload, tier_of)

__all__ = ["BlockHash", "BlockRemoved", "BlockStored", "ChainLink", "Cleared", "DecodeError", "Event", "EventBatch",
           "FleetView", "ResidencyIndex", "SeqOutcome", "SequenceTracker", "StatsCheck", "Tier", "TierCounts",
           "TierResidency", "UnknownEvent", "ViewState", "compare_with_stats", "decode_event", "decode_message",
           "decode_payload", "tier_of"]

log = logging.getLogger(__name__)

MEMORY_TIERS = (Tier.G1, Tier.G2)  # what a restarted process starts without


# ---- one tier's resident set ----------------------------------------------------------------

class TierResidency:
    """One tier of one replica: resident hash -> the tokens it covers, and what the events did."""

    def __init__(self) -> None:
        self.resident: dict[BlockHash, int] = {}
        self.tokens = 0  # sum of resident spans
        self.stores = self.removes = self.duplicate_stores = self.unknown_removes = 0
        self.stored_tokens = 0  # over every stored hash, duplicates included (G4's written-blocks check)
        self.unit_tokens: int | None = None  # smallest span one store event covered: an offload block
        self.widest = 0  # widest span of any stored hash (bounds prefix_depth's look-ahead)
        self.stale = False

    def store(self, hashes: Sequence[BlockHash], span: int) -> list[BlockHash]:
        """Returns the hashes that were not resident before."""
        new = []
        self.stores += len(hashes)
        self.stored_tokens += span * len(hashes)
        if hashes:
            event_tokens = span * len(hashes)
            self.unit_tokens = event_tokens if self.unit_tokens is None else min(self.unit_tokens, event_tokens)
            self.widest = max(self.widest, span)
        for h in hashes:
            old = self.resident.get(h)
            if old is not None:
                self.duplicate_stores += 1  # idempotent: a store of a resident hash counts once
                self.tokens -= old
            else:
                new.append(h)
            self.resident[h] = span
            self.tokens += span
        return new

    def remove(self, hashes: Iterable[BlockHash]) -> list[BlockHash]:
        """Returns the hashes that were resident."""
        gone = []
        for h in hashes:
            self.removes += 1
            span = self.resident.pop(h, None)
            if span is None:
                self.unknown_removes += 1  # already evicted as far as we know, or stored before we joined
            else:
                self.tokens -= span
                gone.append(h)
        return gone

    def clear(self) -> list[BlockHash]:
        gone = list(self.resident)
        self.resident.clear()
        self.tokens = 0
        return gone

    def check_integrity(self) -> None:
        if self.tokens != sum(self.resident.values()):
            raise RuntimeError(f"resident tokens {self.tokens} != the spans' sum {sum(self.resident.values())}")
        if any(s < 1 for s in self.resident.values()):
            raise RuntimeError("a resident hash covers no token")
        if min(self.stores, self.removes, self.duplicate_stores, self.unknown_removes) < 0:
            raise RuntimeError("a negative counter")


# ---- one replica ----------------------------------------------------------------------------

class ViewState(Enum):
    WAITING = "waiting"  # no batch yet
    LIVE = "live"  # every event since sequence 0 applied
    STALE = "stale"  # events were lost (see the module docstring): counts may be wrong


class SeqOutcome(Enum):
    IN_ORDER = "in_order"
    JOINED_LATE = "joined_late"  # the first batch seen was not 0
    GAP = "gap"
    RESTART = "restart"  # the number went back: a new publisher


class SequenceTracker:
    """One publisher's sequence numbers."""

    def __init__(self) -> None:
        self.first: int | None = None
        self.last: int | None = None
        self.batches = self.gaps = self.missed = self.restarts = 0

    def observe(self, seq: int) -> SeqOutcome:
        self.batches += 1
        last, self.last = self.last, seq
        if last is None:
            self.first = seq
            if seq:
                self.missed += seq
                return SeqOutcome.JOINED_LATE
            return SeqOutcome.IN_ORDER
        if seq == last + 1:
            return SeqOutcome.IN_ORDER
        if seq > last + 1:
            self.gaps += 1
            self.missed += seq - last - 1
            return SeqOutcome.GAP
        self.restarts += 1
        self.missed += seq  # the new publisher's batches before this one
        return SeqOutcome.RESTART


@dataclass(frozen=True)
class ChainLink:
    parent: BlockHash | None  # None: a root block, or a parent the events did not name
    tokens: int  # the smallest span it was stored with (its G1 block's tokens)


@dataclass(frozen=True)
class TierCounts:
    blocks: int  # G1-granular
    hashes: int
    tokens: int
    stores: int
    removes: int
    duplicate_stores: int
    unknown_removes: int
    stored_tokens: int
    unit_tokens: int | None
    stale: bool


class ResidencyIndex:
    """One replica's view: per tier the resident hashes, the chain links between them, and whether
    the view can be trusted (`state`)."""

    def __init__(self, name: str = "", block_size: int | None = None) -> None:
        if block_size is not None and (type(block_size) is not int or block_size < 1):
            raise ValueError(f"block_size must be an int >= 1 or None, got {block_size!r}")
        self.name = name
        self._given_block_size = block_size
        self._seen_block_size: int | None = None
        self.tiers = {t: TierResidency() for t in Tier}
        self.links: dict[BlockHash, ChainLink] = {}  # every hash resident in some tier
        self.seq = SequenceTracker()
        self.malformed = self.cleared = self.unknown_events = self.other_group = 0
        self.other_medium: dict[str, int] = {}
        self.dp_rank: int | None = None
        self.stale_reasons: list[str] = []

    @property
    def block_size(self) -> int | None:
        return self._given_block_size or self._seen_block_size

    @property
    def state(self) -> ViewState:
        if self.seq.batches == 0 and not self.malformed:
            return ViewState.WAITING
        return ViewState.STALE if any(t.stale for t in self.tiers.values()) else ViewState.LIVE

    @property
    def complete(self) -> bool:
        """Every batch since sequence 0 applied (no late join, gap, restart or undecodable message)."""
        return (self.seq.batches > 0 and self.seq.first == 0 and not self.seq.gaps and not self.seq.restarts
                and not self.malformed)

    # -- applying ---------------------------------------------------------------------------
    def apply(self, batch: EventBatch) -> None:
        outcome = self.seq.observe(batch.seq)
        if outcome is SeqOutcome.JOINED_LATE:
            self._mark_stale(Tier, f"joined at batch {batch.seq}: earlier events missed")
        elif outcome is SeqOutcome.GAP:
            self._mark_stale(Tier, f"gap before batch {batch.seq}: events lost")
        elif outcome is SeqOutcome.RESTART:
            for t in MEMORY_TIERS:
                self._forget(t, self.tiers[t].clear())
                self.tiers[t].stale = False
            self._mark_stale((Tier.G3, Tier.G4), f"publisher restarted at batch {batch.seq}")
            if batch.seq:
                self._mark_stale(Tier, f"publisher restarted at batch {batch.seq}, not 0: events missed")
        self.dp_rank = batch.dp_rank
        for event in batch.events:
            self._apply_event(event)

    def reject(self, seq: int | None, reason: str) -> None:
        """An undecodable message: its events are lost."""
        self.malformed += 1
        if seq is not None:
            self.seq.observe(seq)  # a later in-order batch must not read as one more gap
        self._mark_stale(Tier, reason)

    def _apply_event(self, event: Event) -> None:
        if isinstance(event, Cleared):
            self.cleared += 1
            self._forget(Tier.G1, self.tiers[Tier.G1].clear())
            self.tiers[Tier.G1].stale = False  # known empty: exact again
            return
        if isinstance(event, UnknownEvent):
            self.unknown_events += 1
            return
        tier = event.tier
        if tier is None:
            medium = str(event.medium)
            if medium not in self.other_medium:
                log.warning("%s: KV events with medium %r (locality %r) are counted as 'other', not applied",
                            self.name or "replica", medium, event.locality)
            self.other_medium[medium] = self.other_medium.get(medium, 0) + 1
            return
        if event.group_idx:
            self.other_group += 1
            return
        if isinstance(event, BlockRemoved):
            self._forget(tier, self.tiers[tier].remove(event.block_hashes))
            return
        bs = event.block_size
        self._seen_block_size = bs if self._seen_block_size is None else min(self._seen_block_size, bs)
        self.tiers[tier].store(event.block_hashes, bs)
        parent = event.parent_block_hash
        for h in event.block_hashes:
            old = self.links.get(h)
            # A hash's parent is fixed by the hash chain; an event that does not name it (an array-form
            # offload event) must not erase what a G1 event said.
            link = ChainLink(parent if parent is not None or old is None else old.parent,
                             bs if old is None else min(bs, old.tokens))
            if link != old:
                self.links[h] = link
            parent = h

    def _forget(self, tier: Tier, gone: Iterable[BlockHash]) -> None:
        """Drops the chain links of hashes no tier holds any more."""
        others = [r.resident for t, r in self.tiers.items() if t is not tier]
        for h in gone:
            if not any(h in r for r in others):
                self.links.pop(h, None)

    def _mark_stale(self, tiers: Iterable[Tier], reason: str) -> None:
        for t in tiers:
            self.tiers[t].stale = True
        if len(self.stale_reasons) < 20:  # the first ones say why; a flapping link must not grow this
            self.stale_reasons.append(reason)

    # -- queries ----------------------------------------------------------------------------
    def resident(self, tier: Tier) -> frozenset[BlockHash]:
        return frozenset(self.tiers[tier].resident)

    def counts(self) -> dict[Tier, TierCounts]:
        bs = self.block_size
        return {t: TierCounts(r.tokens // bs if bs else len(r.resident), len(r.resident), r.tokens, r.stores,
                              r.removes, r.duplicate_stores, r.unknown_removes, r.stored_tokens, r.unit_tokens, r.stale)
                for t, r in self.tiers.items()}

    def prefix_depth(self, hashes: Sequence[BlockHash]) -> dict[Tier, int]:
        """Per tier, how many leading G1 blocks of a request's hash chain this replica holds. An
        array-form offload hash (the last G1 hash of an offload block) covers its whole block."""
        bs = self.block_size or 1
        out = {}
        for tier, r in self.tiers.items():
            covered, reach = 0, max(1, r.widest // bs)
            for i, h in enumerate(hashes):
                span = r.resident.get(h)
                if span is not None and i + 1 - max(1, span // bs) <= covered:
                    covered = i + 1
                elif i + 1 >= covered + reach:  # no later hash can reach back to `covered`
                    break
            out[tier] = covered
        return out

    def chain(self, h: BlockHash) -> list[BlockHash]:
        """`h` and its known ancestors, nearest first (as far as the links go)."""
        out: list[BlockHash] = []
        seen: set[BlockHash] = set()
        cur: BlockHash | None = h
        while cur is not None and cur in self.links and cur not in seen:
            out.append(cur)
            seen.add(cur)
            cur = self.links[cur].parent
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able summary."""
        s = self.seq
        return {"state": self.state.value, "complete": self.complete, "block_size": self.block_size,
                "batches": s.batches, "first_seq": s.first, "last_seq": s.last, "gaps": s.gaps,
                "missed_batches": s.missed, "restarts": s.restarts, "malformed": self.malformed,
                "cleared": self.cleared, "unknown_events": self.unknown_events, "other_group": self.other_group,
                "other_medium": dict(self.other_medium), "dp_rank": self.dp_rank,
                "stale_reasons": list(self.stale_reasons),
                "tiers": {t.value: asdict(c) for t, c in self.counts().items()}}

    def check_integrity(self) -> None:
        for r in self.tiers.values():
            r.check_integrity()
        held = set().union(*(r.resident for r in self.tiers.values()))
        if held != set(self.links):
            raise RuntimeError(f"{len(held ^ set(self.links))} hashes differ between the tiers and the chain links")
        if self.state is ViewState.LIVE and not self.complete:
            raise RuntimeError("a view that missed events reads as live")


# ---- a fleet --------------------------------------------------------------------------------

class FleetView:
    """One `ResidencyIndex` per replica name."""

    def __init__(self, names: Iterable[str] = (), block_size: int | None = None) -> None:
        self._block_size = block_size
        self._replicas: dict[str, ResidencyIndex] = {}
        for name in names:
            self.add(name)

    def add(self, name: str) -> ResidencyIndex:
        if name in self._replicas:
            raise ValueError(f"replica {name!r} is already in the fleet")
        self._replicas[name] = ResidencyIndex(name, self._block_size)
        return self._replicas[name]

    def __getitem__(self, name: str) -> ResidencyIndex:
        return self._replicas[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._replicas)

    def receive(self, name: str, frames: Sequence[bytes]) -> EventBatch | None:
        """Applies one ZMQ message from replica `name`; None if it was undecodable (the replica's view
        is then stale)."""
        index = self._replicas[name]
        try:
            batch = decode_message(frames)
        except DecodeError as e:
            if not index.malformed:
                log.warning("%s: %s", name, e)
            index.reject(e.seq, str(e))
            return None
        index.apply(batch)
        return batch

    def prefix_depths(self, hashes: Sequence[BlockHash]) -> dict[str, dict[Tier, int]]:
        return {name: index.prefix_depth(hashes) for name, index in self._replicas.items()}

    def to_dict(self) -> dict[str, Any]:
        return {name: index.to_dict() for name, index in self._replicas.items()}

    def check_integrity(self) -> None:
        for index in self._replicas.values():
            index.check_integrity()


# ---- against the server's own counts -----------------------------------------------------------

@dataclass(frozen=True)
class StatsCheck:
    tier: Tier
    what: str  # what both numbers count
    events: int
    server: int | None  # None: the server has no such count
    match: bool | None  # None: not comparable (no server count, or a view that missed events)
    note: str = ""


def compare_with_stats(index: ResidencyIndex, stats: Mapping[str, Any]) -> list[StatsCheck]:
    """The view against a `GET /v1/kv/stats` body, one check per tier the server reports (module
    docstring). Storage tiers are matched as the publisher names them (kvstore.events.TierKind): a
    batched tier (it has `written_blocks`) is remote storage, G4; any other is local storage, G3."""
    counts, bs = index.counts(), index.block_size
    tiers = {n: e for n, e in (stats.get("tiers") or {}).items() if isinstance(e, Mapping)}
    out = []
    if "cached_blocks" in tiers.get("G1", {}):
        server_g1, c = int(tiers["G1"]["cached_blocks"]), counts[Tier.G1]
        out.append(StatsCheck(Tier.G1, "cached blocks", c.blocks, server_g1, None if c.stale else c.blocks == server_g1))
    elif "num_blocks" in tiers.get("G1", {}):  # a server from before cached_blocks: a bound only
        cap, c = int(tiers["G1"]["num_blocks"]), counts[Tier.G1]
        out.append(StatsCheck(Tier.G1, "cached blocks <= capacity", c.blocks, cap,
                              None if c.stale else c.blocks <= cap))

    def per_chunk(tier: Tier, server_chunks: int) -> int | None:
        """Offload blocks -> G1 blocks; 0 stays 0 before the offload block size is known."""
        unit = counts[tier].unit_tokens
        return server_chunks * (unit // bs) if unit and bs else (0 if server_chunks == 0 else None)

    unknown_size = "offload block size unknown: no store event in this tier yet"
    if "blocks" in tiers.get("G2", {}):
        c, server = counts[Tier.G2], per_chunk(Tier.G2, int(tiers["G2"]["blocks"]))
        out.append(StatsCheck(Tier.G2, "resident blocks", c.blocks, server,
                              None if c.stale or server is None else c.blocks == server,
                              "" if server is not None else f"{tiers['G2']['blocks']} offload blocks, {unknown_size}"))
    storage = [e for n, e in tiers.items() if n not in ("G1", "G2")]
    if remote := [e for e in storage if "written_blocks" in e]:
        c = counts[Tier.G4]
        server = per_chunk(Tier.G4, sum(int(e["written_blocks"]) for e in remote))  # their events merge in G4
        stored = c.stored_tokens // bs if bs else 0
        note = "" if index.complete else "not compared: the view did not start at batch 0"
        out.append(StatsCheck(Tier.G4, "blocks written", stored, server,
                              None if server is None or not index.complete else stored == server,
                              note or ("" if server is not None else unknown_size)))
    if local := [e for e in storage if "written_blocks" not in e]:
        c = counts[Tier.G3]
        if all("entries" in e for e in local):
            # G3 removals are not announced: the counts agree only while the disk evicted nothing.
            server = per_chunk(Tier.G3, sum(int(e["entries"]) for e in local))
            evicted = sum(int(e.get("evictions") or 0) for e in local)
            note = f"not compared: the disk evicted {evicted} entries, which events do not announce" if evicted else ""
            ok = None if c.stale or evicted or server is None or not index.complete else c.blocks == server
            out.append(StatsCheck(Tier.G3, "resident blocks", c.blocks, server, ok, note))
        else:
            used = sum(int(e.get("used_bytes") or 0) for e in local)
            out.append(StatsCheck(Tier.G3, "resident blocks", c.blocks, None, None,
                                  f"the server reports bytes ({used}), no entry count"))
    return out
