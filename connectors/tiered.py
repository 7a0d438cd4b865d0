"""TieredOffloadConnector: G1 <-> G2 (host memory) <-> an ordered list of storage tiers
(`storage_tier.StorageTier`: the built-in disk and Redis backends, or any StorageBackend).

Three objects, each owning one kind of state, behind the connector API:
- `OffloadPlanner` (scheduler side, `offload_planner.py`): lookups, load and store plans, the
  G1 blocks held by stores in flight, miss counters;
- `TransferEngine` (worker side, `offload_transfer.py`): the threads that move bytes between
  G1, G2 and the storage tiers, and hit / load counters;
- `WriteBackTracker` (`writeback.py`, with `write_policy=write_back`): dirty offload blocks,
  copied down when G1 evicts them.
Plans cross from the planner to the engine as frozen `LoadJob` / `StoreJob`s; finished transfers
come back as `LoadDone` / `StoreDone`.

Write path (write-through, asynchronous): when a request's step completes an offload block
(`layout.tokens` tokens, a multiple of G1's block size), its G1 blocks are held and a transfer
thread gathers them into a G2 slot, then queues a write of that slot to each parallel storage
tier, and offers it to each batched one (written once used `min_uses` times). Nothing here
blocks the step loop.

Read path: the longest run of consecutive offload blocks found in G2, then the storage tiers, is
loaded asynchronously into newly allocated G1 blocks while the request waits in
WAITING_FOR_REMOTE_KVS. A load that fails (corrupt, missing, raising or hanging backend)
reports the blocks it did not fill: the engine recomputes those tokens or fails the request, per
`kv_load_failure_policy`. A failing tier never fails the engine.
"""
from __future__ import annotations

import logging
from functools import partial
from typing import Any

from connectors.base import ConnectorMeta, FinishedTransfers, KVConnector
from connectors.codec import BlockLayout
from connectors.offload_plans import LoadDone, StoreDone, WritePolicy
from connectors.offload_planner import OffloadPlanner
from connectors.offload_transfer import HOST, TransferEngine
from connectors.pd import PDRequest, PDRole, prefill_response
from connectors.sharded import ShardedTransfer, TransferPeers, relocate
from connectors.storage_tier import StorageTier, TierMode
from connectors.writeback import WriteBackTracker
from kvstore.g1 import BlockPool
from kvstore.host import HostTier

__all__ = ["TieredOffloadConnector", "WritePolicy"]
log = logging.getLogger(__name__)


class TieredOffloadConnector(KVConnector):
    def __init__(self, layout: BlockLayout, pool: BlockPool, g2: HostTier | None, tiers: list[StorageTier],
                 *, write_policy: WritePolicy = WritePolicy.WRITE_THROUGH, namespace: str | None = None) -> None:
        if g2 is None and not tiers:
            raise ValueError("the tiered offload connector needs at least one tier (host memory or storage)")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names) or HOST in names:
            raise ValueError(f"tier names must be distinct and not {HOST!r}: {names}")
        if write_policy is WritePolicy.WRITE_BACK and not pool.enable_caching:
            raise ValueError("write_back offload needs prefix caching: blocks are written back when the "
                             "prefix cache evicts them, and without it they are never kept to be evicted")
        self.layout, self.pool, self.g2, self.tiers = layout, pool, g2, tiers
        self.write_policy = write_policy
        self.transfer = TransferEngine(layout, g2, tiers)
        self.write_back = None
        if write_policy is WritePolicy.WRITE_BACK:
            self.write_back = WriteBackTracker(pool, lambda job: self.transfer.store(job, wait_for_write_slot=False))
        self.planner = OffloadPlanner(layout, pool, g2, tiers, self.write_back)
        self._failed_blocks: set[int] = set()
        self.load_failures = 0
        self.namespace = namespace  # the model's KV namespace (hex): what a decode's kv_transfer_params must name
        self._promised = False  # a prefill answered since the last wait_for_outputs: its blocks must reach G4
        self._short: set[str] = set()  # decode requests already logged as finding less than promised
        self.sharded: ShardedTransfer | None = None  # rank 0 of a tensor-parallel engine (shard_over)

    def shard_over(self, peers: TransferPeers) -> None:
        """Rank 0 of a tensor-parallel engine: every plan runs on the other ranks too, over their
        own tiers, and a transfer is done once every rank has done it (connectors/sharded.py)."""
        if self.write_back is not None:
            raise ValueError("write_policy=write_back does not work with tensor parallelism yet (a write-back "
                             "copies on the step loop, which the other ranks would have to join); use write_through")
        self.sharded = ShardedTransfer(peers, self.layout.g1_blocks, self.planner.restore, self.transfer.reports.wake)

    def as_peer(self) -> TransferEngine:
        """A tensor-parallel worker's side: the transfer engine that runs rank 0's plans over this
        rank's tiers (each load looked up again in them: `sharded.relocate`)."""
        self.transfer.relocate = partial(relocate, g2=self.g2, tiers=self.tiers)
        return self.transfer

    def tier(self, name: str) -> StorageTier:
        """The storage tier called `name` (KeyError naming the ones there are)."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no storage tier {name!r}; tiers: {[t.name for t in self.tiers]}")

    supports_kv_groups = True

    def set_kv_groups(self, windows: tuple[int, ...]) -> None:
        if self.write_back is not None:
            raise ValueError("write_back offload keeps one KV group (the engine lays G1 out so)")
        self.planner.set_windows(windows)

    # ---- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        n = self.planner.match(request, num_computed_tokens)
        pd = request.pd
        short = pd is not None and pd.role is PDRole.DECODE and num_computed_tokens + n < min(pd.tokens, request.num_tokens - 1)
        if short and request.request_id not in self._short:
            self._short.add(request.request_id)
            log.warning("request %s: its prefill published %d prompt tokens, the tiers hold %d of them; "
                        "recomputing the rest", request.request_id, pd.tokens, num_computed_tokens + n)
        return n, n > 0

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        self.planner.plan_load(request, block_ids, num_external_tokens)

    def take_load_split(self, req_id: str) -> dict[str, int]:
        return self.planner.take_load_split(req_id)

    def build_connector_meta(self, scheduled) -> ConnectorMeta:
        return self.planner.build_meta(scheduled)

    def request_finished(self, request, block_ids):
        self.planner.finished(request.request_id)
        self._short.discard(request.request_id)
        pd = request.pd
        if pd is None or pd.role is not PDRole.PREFILL or request.error is not None:
            return None
        keys = self.planner.prompt_chunk_keys(request)
        self._promised = True
        return prefill_response(self.namespace or "", len(keys) * self.layout.tokens, keys)

    def check_pd(self, pd: PDRequest) -> None:
        if not any(t.mode is TierMode.BATCHED for t in self.tiers):
            raise ValueError("kv_transfer_params (prefill/decode disaggregation) move KV through a shared tier: "
                             "start the server with --kv-offload-remote URL")
        if pd.role is PDRole.DECODE and pd.namespace != self.namespace:
            raise ValueError(f"kv_transfer_params name KV of another model (namespace {pd.namespace}, here "
                             f"{self.namespace}): the prefill and decode replicas must serve the same weights")

    def wait_for_outputs(self) -> None:
        # A prefill's response names blocks the decode replica will look for in G4: they are
        # written before it is sent. This waits for every queued write, not only that request's
        # (simple, and a prefill replica's queue holds little else).
        if self._promised:
            self.flush()
            self._promised = False

    def get_finished(self) -> FinishedTransfers:
        received: set[str] = set()
        reports = self.transfer.reports.drain()
        for done in reports if self.sharded is None else self.sharded.combine(reports):
            if isinstance(done, LoadDone):
                failed = self.planner.load_done(done)
                if failed is None:  # the request's other KV groups are still loading
                    continue
                received.add(done.req_id)
                if failed:
                    self._failed_blocks.update(failed)
                    self.load_failures += 1
            elif isinstance(done, StoreDone):
                self.planner.store_done(done.key)
        return FinishedTransfers(frozenset(received))

    def busy(self) -> bool:
        return self.planner.busy()

    def wait_for_progress(self, timeout: float) -> None:
        self.transfer.reports.wait(timeout)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ---- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_cache) -> None:
        self.transfer.register_kv_cache(kv_cache)

    def register_hidden_cache(self, hidden_cache) -> None:
        if not self.layout.hidden_layer_ids:
            raise ValueError("this offload layout carries no hidden states")
        self.transfer.g1.hidden_cache = hidden_cache

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        for job in meta.loads:
            self.transfer.start_load(job)
        if self.sharded is not None:
            self.sharded.send(meta.loads, [])

    def wait_for_save(self, meta: ConnectorMeta) -> None:
        for job in meta.stores:
            self.transfer.start_store(job)
        if self.sharded is not None:
            self.sharded.send([], meta.stores)

    # ---- lifecycle ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        t, p = self.transfer, self.planner
        out: dict[str, Any] = {"lookup_tokens": p.lookup_tokens, "load_failures": self.load_failures,
                               "load_seconds": t.load_seconds, "load_bytes": t.load_bytes,
                               "load_copy_seconds": t.copy_seconds,
                               "g2_load_copies": t.g2_copies, "write_policy": self.write_policy.value}
        if self.write_back is not None:
            out.update(writeback_blocks=self.write_back.written, writeback_dropped=self.write_back.dropped,
                       dirty_blocks=len(self.write_back))
        if self.g2 is not None:
            s = self.g2.stats
            out[HOST] = {"backend": "host", "hit_tokens": t.tier_hits[HOST], "miss_tokens": p.tier_misses[HOST],
                         "blocks": len(self.g2), "capacity_blocks": self.g2.num_slots, "corrupt": s.corrupt,
                         "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "evictions": s.evictions}
        for tier in self.tiers:
            out[tier.name] = {**tier.stats(), "hit_tokens": t.tier_hits[tier.name],
                              "miss_tokens": p.tier_misses[tier.name]}
        return out

    def flush(self) -> None:
        """Wait until every queued store and tier write has finished (on every rank)."""
        self.transfer.flush()
        if self.sharded is not None:
            self.sharded.flush()

    def close(self) -> None:
        self.transfer.close()

    def check_integrity(self) -> None:
        if self.write_back is not None:
            self.write_back.check_integrity()
        if self.sharded is not None:
            self.sharded.check_integrity()
