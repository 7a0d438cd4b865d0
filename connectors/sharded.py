"""Offload tiers under tensor parallelism: every rank moves its own shard of each offload block.

Rank 0's `TieredOffloadConnector` is the only scheduler side: it looks blocks up in its own tiers
and makes every load and store plan. The plans go to the other ranks (`TransferPeers`: the
engine's rank messages), and each rank runs them over its own G2 and storage tiers, whose
namespace names the tensor-parallel layout and the rank (engine/core/connector_setup.py), so
ranks never read each other's shards and an engine of another TP size never reads them either.

A transfer is done when every rank has reported it (`ShardedTransfer`):
- a load counts the blocks the rank that filled the fewest filled; the engine recomputes from
  there, so a shard missing on one rank costs a prefill of those tokens, never wrong KV;
- a store holds its G1 blocks until every rank has copied its shard out.

Rank 0 decides a hit from its own tiers alone (no message per lookup). The ranks see the same
plans in the same order, so their tiers hold the same keys unless one rank's write or read
failed or its G2 evicted differently; a worker re-looks a planned load up in its own tiers
(`relocate`), and a block a worker lacked is stored again on every rank the next time it is
computed (`OffloadPlanner.restore`), so the ranks converge again.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from connectors.offload_planner import leading_run
from connectors.offload_plans import Chunk, LoadDone, LoadJob, StoreDone, StoreJob
from connectors.offload_transfer import HOST
from connectors.storage_tier import StorageTier
from kvstore.host import HostTier
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)
Report = LoadDone | StoreDone


class TransferPeers(Protocol):
    """The other tensor-parallel ranks, as the connector's rank 0 side sees them."""

    size: int  # ranks, rank 0 included

    def send_transfers(self, loads: list[LoadJob], stores: list[StoreJob]) -> None:
        """Hands the plans to every other rank, in the order given (after every step sent before)."""

    def drain_transfers(self) -> list[tuple[int, Report]]:
        """The other ranks' finished transfers since the last call: (rank, report)."""

    def flush_transfers(self) -> None:
        """Returns once every other rank has finished every transfer and tier write sent to it."""

    def set_waker(self, wake: Callable[[], None]) -> None:
        """`wake()` is called (from any thread) whenever another rank reports a transfer."""


class ShardedTransfer:
    """Rank 0's view of the ranks' transfers: one report per transfer, once every rank has made its own.
    Owns the transfers in flight on some rank; `short` gets the keys of blocks a load found on rank 0
    but not on some other rank."""

    def __init__(self, peers: TransferPeers, g1_per_chunk: int, short: Callable[[list[BlockKey]], None],
                 wake: Callable[[], None]) -> None:
        self.peers, self.k, self._short = peers, g1_per_chunk, short
        peers.set_waker(wake)  # an idle engine waiting for a load wakes on any rank's report
        self._loads: dict[tuple[str, int], tuple[LoadJob, dict[int, int]]] = {}  # -> (job, rank -> filled)
        self._stores: dict[BlockKey, set[int]] = {}  # -> ranks done
        self.short_loads = 0  # loads some rank filled less of than rank 0

    def send(self, loads: list[LoadJob], stores: list[StoreJob]) -> None:
        """Plans rank 0 has started: the other ranks start them too."""
        for job in loads:
            self._loads[(job.req_id, job.group)] = (job, {})
        for st in stores:
            self._stores[st.key] = set()
        if loads or stores:
            self.peers.send_transfers(loads, stores)

    def combine(self, local: list[Report]) -> list[Report]:
        """Rank 0's reports and the others' since the last call -> the transfers every rank finished."""
        out: list[Report] = []
        for rank, item in [(0, r) for r in local] + self.peers.drain_transfers():
            done = self._add(rank, item)
            if done is not None:
                out.append(done)
        return out

    def _add(self, rank: int, item: Report) -> Report | None:
        if isinstance(item, StoreDone):
            ranks = self._stores[item.key]
            ranks.add(rank)
            if len(ranks) < self.peers.size:
                return None
            del self._stores[item.key]
            return item
        job, filled = self._loads[(item.req_id, item.group)]
        filled[rank] = item.num_filled
        if len(filled) < self.peers.size:
            return None
        del self._loads[(item.req_id, item.group)]
        n = min(filled.values())
        if n < filled[0]:  # rank 0 has blocks another rank lacks: store them again when next computed
            self.short_loads += 1
            first = job.first_g1 + n  # the request's first G1 block some rank did not fill
            self._short([c.key for c in job.chunks if (c.index + 1) * self.k > first])
            log.info("request %s: a tensor-parallel rank loaded %d of the %d blocks rank 0 loaded; recomputing "
                     "the rest", item.req_id, n, filled[0])
        return LoadDone(item.req_id, job.dst[n:], item.group, n)

    def flush(self) -> None:
        self.peers.flush_transfers()

    def check_integrity(self) -> None:
        for (rid, group), (job, filled) in self._loads.items():
            if (job.req_id, job.group) != (rid, group) or not set(filled) <= set(range(self.peers.size)):
                raise RuntimeError(f"sharded transfers: load {rid}/{group} has reports from unknown ranks {filled}")


def relocate(job: LoadJob, g2: HostTier | None, tiers: list[StorageTier]) -> LoadJob:
    """Rank 0's load plan as this rank runs it: the same chunks looked up in this rank's G2 and
    tiers (the leading run only, as at lookup), its G2 chunks pinned. Never raises: a tier that
    fails to answer makes a shorter load, which the engine recomputes past."""
    cands = [(c.index, c.key, c.digest, c.parent) for c in job.chunks]
    try:
        found, _ = leading_run(g2, tiers, cands)
    except Exception as e:  # noqa: BLE001 - a plugin tier may raise anything: a miss, never wrong KV
        log.warning("offload load for request %s: looking it up on this rank failed: %s: %s",
                    job.req_id, type(e).__name__, e)
        found = []
    ours = [replace(c, blocks=None) for c in found]  # KV events are rank 0's
    in_g2: list[Chunk] = [c for c in ours if c.tier == HOST]
    slots: dict[BlockKey, int] = {}
    if in_g2:
        assert g2 is not None
        got = g2.prepare_load([c.key for c in in_g2], [job.chunk_info(c) for c in in_g2])
        if got is None:  # evicted since the lookup: load nothing
            ours = []
        else:
            slots = dict(zip((c.key for c in in_g2), got))
    return replace(job, chunks=tuple(ours), g2_slots=slots)
