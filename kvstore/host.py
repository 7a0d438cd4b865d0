"""G2: the host-memory tier. A slab of fixed-size slots, page-locked when CUDA is present (`pinned.py`).

One slot holds one offload block contiguously across all layers, so one copy moves it.
Bookkeeping follows the two-phase lifecycle shared by every tier:

    lookup -> prepare_load (pins the slots) -> complete_load (unpins)
    prepare_store (reserves slots, evicting through the policy) -> complete_store(success)

A slot is readable only after `complete_store(True)`; a pinned slot is never evicted.
All methods are thread-safe: the scheduler looks up while transfer threads copy.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.events import BlockRemoved, BlockStored, ChunkBlocks, EventBuffer, TierKind
from kvstore.keys import BlockKey
from kvstore.pinned import HostSlab
from policies import BlockInfo, EvictionPolicy, check_candidates


@dataclass
class TierStats:
    hits: int = 0  # tokens served from this tier
    misses: int = 0  # tokens looked up and not found here
    bytes_in: int = 0  # written into the tier
    bytes_out: int = 0  # read out of the tier
    evictions: int = 0
    corrupt: int = 0
    store_failures: int = 0


class HostTier:
    def __init__(self, num_slots: int, slot_bytes: int, policy: EvictionPolicy[BlockKey], pin_memory: bool = False,
                 events: EventBuffer | None = None):
        if num_slots < 1:
            raise ValueError(f"G2 needs at least one slot of {slot_bytes} bytes")
        self.slot_bytes = slot_bytes
        self._memory = HostSlab(num_slots, slot_bytes, pin=pin_memory)
        self.slab = self._memory.tensor
        self.policy = policy
        self._lock = threading.Lock()
        self._slot: dict[BlockKey, int] = {}  # readable entries
        self._digest: dict[BlockKey, bytes] = {}
        self._pending: dict[BlockKey, int] = {}  # reserved by prepare_store, not yet readable
        self._pins: dict[BlockKey, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self.stats = TierStats()
        self.events = events  # KV events of blocks G2 drops (None: off)
        # Readable entries announced by a BlockStored, with the G1 keys it named: their eviction
        # announces the removal of the same keys (an entry stored without them never is).
        self._announced: dict[BlockKey, tuple[BlockKey, ...]] = {}

    def same_span(self, a: int, b: int) -> bool:
        """Whether slots a and b may be moved in one copy (`HostSlab.span_of`)."""
        return self._memory.span_of(a) == self._memory.span_of(b)

    @property
    def num_slots(self) -> int:
        return self.slab.shape[0]

    def lookup(self, keys: Sequence[BlockKey], digests: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are readable here with matching token digests."""
        with self._lock:
            n = 0
            for key, digest in zip(keys, digests):
                if key not in self._slot or self._digest[key] != digest:
                    break
                n += 1
            return n

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._slot or key in self._pending

    def prepare_load(self, keys: Sequence[BlockKey], infos: Sequence[BlockInfo] | None = None) -> list[int] | None:
        """Pin and return the slots of `keys`; None (nothing pinned) if any is gone. `infos`, one
        per key: a request's load, each a use the policy sees (`touch_block`); None: a copy out
        (to a tier below) that is no use."""
        if infos is not None and len(infos) != len(keys):
            raise ValueError(f"prepare_load got {len(keys)} keys but {len(infos)} infos")
        with self._lock:
            if any(k not in self._slot for k in keys):
                return None
            for i, k in enumerate(keys):
                if infos is not None:
                    self.policy.touch_block(k, infos[i])
                self._pins[k] = self._pins.get(k, 0) + 1
                if self._pins[k] == 1:
                    self.policy.pin(k)
            return [self._slot[k] for k in keys]

    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        with self._lock:
            for k in keys:
                self._pins[k] -= 1
                if self._pins[k] == 0:
                    del self._pins[k]
                    self.policy.unpin(k)
            self.stats.bytes_out += len(keys) * self.slot_bytes

    def prepare_store(self, key: BlockKey, digest: bytes) -> int | None:
        """Reserve a slot for `key` (evicting if needed). None if it is already here or no
        slot can be freed (everything pinned)."""
        with self._lock:
            if key in self._slot or key in self._pending:
                return None
            if not self._free:
                victims = self.policy.evict(1)
                if victims is None:
                    self.stats.store_failures += 1
                    return None
                for v in victims:
                    self._free.append(self._slot.pop(v))
                    del self._digest[v]
                removed = [h for v in victims for h in self._announced.pop(v, ())]
                if self.events is not None and removed:
                    self.events.append(BlockRemoved(removed, TierKind.HOST))
                self.stats.evictions += len(victims)
            slot = self._free.pop()
            self._pending[key] = slot
            self._digest[key] = digest
            return slot

    def complete_store(self, key: BlockKey, success: bool, info: BlockInfo | None = None,
                       blocks: ChunkBlocks | None = None) -> None:
        """Publish (or, failed, free) the slot `prepare_store` reserved; `info`: the block as the
        storing request knows it, for the policy (None: unknown); `blocks`: the G1 blocks it
        holds, for KV events (None: not announced, e.g. a KV group's other than the first)."""
        with self._lock:
            slot = self._pending.pop(key)
            if success:
                self._slot[key] = slot
                if info is None:
                    self.policy.insert(key)
                else:
                    self.policy.insert_block(key, info)
                self.stats.bytes_in += self.slot_bytes
                if self.events is not None and blocks is not None:
                    self.events.append(BlockStored.of(blocks, TierKind.HOST))
                    self._announced[key] = blocks.block_hashes
            else:
                del self._digest[key]
                self._free.append(slot)
                self.stats.store_failures += 1

    def slot_view(self, slot: int) -> torch.Tensor:
        return self.slab[slot]

    def __len__(self) -> int:
        with self._lock:
            return len(self._slot)

    def check_integrity(self) -> None:
        with self._lock:
            used = list(self._slot.values()) + list(self._pending.values())
            if len(set(used)) != len(used) or set(used) & set(self._free):
                raise RuntimeError("G2 slot owned twice")
            if len(used) + len(self._free) != self.num_slots:
                raise RuntimeError("G2 leaked slots")
            if set(self._digest) != set(self._slot) | set(self._pending):
                raise RuntimeError("G2 digests out of sync")
            if not self._announced.keys() <= self._slot.keys():
                raise RuntimeError("G2 announced entries that are not readable")
            check_candidates(self.policy, self._slot.keys(), "G2")
