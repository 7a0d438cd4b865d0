"""TieredOffloadConnector: G1 <-> G2 (host memory) <-> G3 (disk, or any StorageBackend)
<-> G4 (a shared store, `connectors.remote_tier`).

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
thread gathers them into a G2 slot, then queues a G3 write of that slot, and a G4 write once
the block has been used `g4_min_uses` times. Nothing here blocks the step loop.

Read path: the longest run of consecutive offload blocks found in G2, then G3, then G4 is
loaded asynchronously into newly allocated G1 blocks while the request waits in
WAITING_FOR_REMOTE_KVS. A load that fails (corrupt, missing, raising or hanging backend)
reports the blocks it did not fill: the engine recomputes those tokens or fails the request, per
`kv_load_failure_policy`. A failing tier never fails the engine.
"""
from __future__ import annotations

from typing import Any

from connectors.backend import StorageBackend
from connectors.base import ConnectorMeta, KVConnector
from connectors.codec import BlockLayout
from connectors.offload_plans import LoadDone, StoreDone, WritePolicy
from connectors.offload_planner import OffloadPlanner
from connectors.offload_transfer import TransferEngine
from connectors.remote_tier import RemoteTier
from connectors.writeback import WriteBackTracker
from kvstore.events import EventBuffer
from kvstore.g1 import BlockPool
from kvstore.host import HostTier

__all__ = ["TieredOffloadConnector", "WritePolicy", "backend_name"]


def backend_name(backend: StorageBackend) -> str:
    """What /v1/kv/stats and the metrics call a tier's backend: its registry name when it was
    built from one (plugin tiers), else its class."""
    return getattr(backend, "name", None) or type(backend).__name__


class TieredOffloadConnector(KVConnector):
    def __init__(self, layout: BlockLayout, pool: BlockPool, g2: HostTier | None, g3: StorageBackend | None,
                 *, g3_timeout_s: float = 10.0, max_pending_writes: int = 64, g3_read_threads: int = 4,
                 write_policy: WritePolicy = WritePolicy.WRITE_THROUGH, g4: RemoteTier | None = None,
                 events: EventBuffer | None = None) -> None:
        if g2 is None and g3 is None and g4 is None:
            raise ValueError("the tiered offload connector needs at least one tier (G2, G3 or G4)")
        if write_policy is WritePolicy.WRITE_BACK and not pool.enable_caching:
            raise ValueError("write_back offload needs prefix caching: blocks are written back when the "
                             "prefix cache evicts them, and without it they are never kept to be evicted")
        self.layout, self.pool, self.g2, self.g3, self.g4 = layout, pool, g2, g3, g4
        self.write_policy = write_policy
        self.transfer = TransferEngine(layout, g2, g3, g4, g3_timeout_s=g3_timeout_s, g3_read_threads=g3_read_threads,
                                       max_pending_writes=max_pending_writes, events=events)
        self.write_back = None
        if write_policy is WritePolicy.WRITE_BACK:
            self.write_back = WriteBackTracker(pool, lambda job: self.transfer.store(job, wait_for_write_slot=False))
        self.planner = OffloadPlanner(layout, pool, g2, g3, g4, self.write_back)
        self._failed_blocks: set[int] = set()
        self.load_failures = 0

    @property
    def g3_timeout_s(self) -> float:
        return self.transfer.g3_timeout_s

    @property
    def g3_read_threads(self) -> int:
        return self.transfer.g3_read_threads

    # ---- scheduler side ----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        n = self.planner.match(request, num_computed_tokens)
        return n, n > 0

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        self.planner.plan_load(request, block_ids, num_external_tokens)

    def take_load_split(self, req_id: str) -> dict[str, int]:
        return self.planner.take_load_split(req_id)

    def build_connector_meta(self, scheduled) -> ConnectorMeta:
        return self.planner.build_meta(scheduled)

    def request_finished(self, request, block_ids):
        self.planner.finished(request.request_id)
        return False, None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        received: set[str] = set()
        for done in self.transfer.drain():
            if isinstance(done, LoadDone):
                received.add(done.req_id)
                if done.failed_blocks:
                    self._failed_blocks.update(done.failed_blocks)
                    self.load_failures += 1
            elif isinstance(done, StoreDone):
                self.planner.store_done(done.key)
        return set(), received

    def busy(self) -> bool:
        return self.planner.busy()

    def wait_for_progress(self, timeout: float) -> None:
        self.transfer.wait_for_progress(timeout)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ---- worker side -------------------------------------------------------------------
    def register_kv_caches(self, kv_cache) -> None:
        self.transfer.kv_cache = kv_cache

    def register_hidden_cache(self, hidden_cache) -> None:
        if not self.layout.hidden_layer_ids:
            raise ValueError("this offload layout carries no hidden states")
        self.transfer.hidden_cache = hidden_cache

    def start_load_kv(self, meta: ConnectorMeta) -> None:
        for job in meta.loads:
            self.transfer.start_load(job)

    def wait_for_save(self, meta: ConnectorMeta) -> None:
        for job in meta.stores:
            self.transfer.start_store(job)

    # ---- lifecycle ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        t, p = self.transfer, self.planner
        out: dict[str, Any] = {"lookup_tokens": p.lookup_tokens, "load_failures": self.load_failures,
                               "load_seconds": t.load_seconds, "load_bytes": t.load_bytes,
                               "g2_load_copies": t.g2_copies, "write_policy": self.write_policy.value}
        if self.write_back is not None:
            out.update(writeback_blocks=self.write_back.written, writeback_dropped=self.write_back.dropped,
                       dirty_blocks=len(self.write_back))
        if self.g2 is not None:
            s = self.g2.stats
            out["G2"] = {"backend": "host", "hit_tokens": t.tier_hits["G2"], "miss_tokens": p.tier_misses["G2"],
                         "blocks": len(self.g2), "capacity_blocks": self.g2.num_slots, "corrupt": s.corrupt,
                         "bytes_in": s.bytes_in, "bytes_out": s.bytes_out, "evictions": s.evictions}
        if self.g3 is not None:
            s3 = getattr(self.g3, "stats", None)
            out["G3"] = {"backend": backend_name(self.g3), "hit_tokens": t.tier_hits["G3"],
                         "miss_tokens": p.tier_misses["G3"], **(vars(s3) if s3 is not None else {})}
        if self.g4 is not None:
            out["G4"] = {"backend": backend_name(self.g4.backend), **self.g4.stats(),
                         "hit_tokens": t.tier_hits["G4"], "miss_tokens": p.tier_misses["G4"]}
        return out

    def flush(self) -> None:
        """Wait until every queued store and G3 write has finished."""
        self.transfer.flush()

    def close(self) -> None:
        self.transfer.close()

    def check_integrity(self) -> None:
        if self.write_back is not None:
            self.write_back.check_integrity()
