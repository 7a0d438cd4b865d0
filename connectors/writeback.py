"""Write-back bookkeeping: offload blocks that filled in G1 and are not below it yet.

With `write_policy=write_back`, a filled offload block is only marked dirty. When G1 is about to
reuse one of its blocks (the pool's evict hook), the whole offload block is copied down at once,
synchronously, since the next forward may overwrite it; the writes below G2 stay asynchronous.
"""
from __future__ import annotations

from collections.abc import Callable

from connectors.offload_plans import StoreJob
from kvstore.g1 import BlockId, BlockPool
from kvstore.keys import BlockKey
from policies import BlockInfo


class WriteBackTracker:
    def __init__(self, pool: BlockPool, store: Callable[[StoreJob], bool]) -> None:
        """`store(job)` copies a job down now and says whether a tier took it."""
        self.pool, self._store = pool, store
        # By the offload block's key -> (token digest, its BlockInfo, keys of its G1 blocks); and the reverse.
        self._dirty: dict[BlockKey, tuple[bytes, BlockInfo, tuple[BlockKey, ...]]] = {}
        self._dirty_chunk: dict[BlockKey, BlockKey] = {}
        self.written = 0  # offload blocks written back on eviction
        self.dropped = 0  # ... that could not be (a G1 block already gone, no room, no write slot)
        pool.evict_hooks.append(self.on_evict)

    def __len__(self) -> int:
        return len(self._dirty)

    def mark_dirty(self, key: BlockKey, digest: bytes, info: BlockInfo, block_keys: tuple[BlockKey, ...]) -> None:
        if key in self._dirty:
            return
        if len(self._dirty) > 2 * self.pool.num_blocks:  # forget chunks whose blocks were never cached
            for ck in [ck for ck, (_, _, bks) in self._dirty.items() if self.pool.lookup(bks[-1]) is None]:
                self._forget(ck)
        self._dirty[key] = (digest, info, block_keys)
        for bk in block_keys:
            self._dirty_chunk[bk] = key

    def _forget(self, key: BlockKey) -> tuple[bytes, BlockInfo, tuple[BlockKey, ...]]:
        entry = self._dirty.pop(key)
        for bk in entry[2]:
            self._dirty_chunk.pop(bk, None)
        return entry

    def on_evict(self, victims: list[BlockId]) -> None:
        """G1 is about to reuse `victims` (their bytes are still valid): copy each dirty offload
        block they belong to down now."""
        chunks = {self._dirty_chunk.get(self.pool.key_of(b)) for b in victims}  # type: ignore[arg-type]
        for ck in chunks - {None}:
            digest, info, block_keys = self._forget(ck)  # type: ignore[arg-type]
            src = [self.pool.lookup(bk) for bk in block_keys]
            if any(b is None for b in src):  # part of it was reused without being cached
                self.dropped += 1
                continue
            if self._store(StoreJob(ck, digest, tuple(src), info)):  # type: ignore[arg-type]
                self.written += 1
            else:
                self.dropped += 1

    def check_integrity(self) -> None:
        for ck, (_, _, bks) in self._dirty.items():
            if any(self._dirty_chunk.get(bk) != ck for bk in bks):
                raise RuntimeError("write-back: a dirty offload block's G1 keys do not point back to it")
