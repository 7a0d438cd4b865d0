"""G1 bookkeeping: the paged block pool with reference counts and the prefix cache.

No tensors live here (the model runner owns the cache tensors); this is the scheduler-side
index of which block holds what. Every block is in exactly one of three states:

- in use: ref_cnt > 0 (may also be cached, i.e. reachable by its key);
- evictable: ref_cnt == 0, cached, and a candidate in the eviction policy;
- free: ref_cnt == 0, not cached, in the free list.

Allocation takes free blocks first and evicts cached ones through the policy only when it
must, so that reusable prefixes survive as long as possible.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NewType

from kvstore.events import BlockRemoved, EventBuffer
from kvstore.keys import BlockKey
from policies import EvictionPolicy

BlockId = NewType("BlockId", int)


@dataclass
class Block:
    block_id: BlockId
    ref_cnt: int = 0
    key: BlockKey | None = None  # set only while the block is registered in the prefix cache
    priority: int = 0  # most urgent priority among the requests that used it since it was cached
    announced: bool = True  # its caching was published as a KV event, so its removal is too


class BlockPool:
    def __init__(self, num_blocks: int, policy: EvictionPolicy[BlockId], enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(BlockId(i)) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self.policy = policy
        self._free: deque[BlockId] = deque(BlockId(i) for i in range(num_blocks))
        self._cached: dict[BlockKey, BlockId] = {}
        self.num_evictions = 0
        self.events: EventBuffer | None = None  # set when KV events are enabled
        # Called with cached blocks about to lose their contents (eviction, prefix-cache reset)
        # while their keys and bytes are still valid: how write-back offload sees them.
        self.evict_hooks: list[Callable[[list[BlockId]], None]] = []

    # -- queries ---------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Blocks an allocation could get: free plus evictable."""
        return len(self._free) + len(self.policy)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks() / self.num_blocks

    def lookup(self, key: BlockKey) -> BlockId | None:
        return self._cached.get(key) if self.enable_caching else None

    def key_of(self, block_id: BlockId) -> BlockKey | None:
        return self.blocks[block_id].key

    # -- state changes ---------------------------------------------------------------------
    def allocate(self, n: int) -> list[BlockId] | None:
        """n fresh blocks (ref_cnt 1, uncached), or None and no change if the pool can't."""
        if n > self.num_free_blocks():
            return None
        taken = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        if len(taken) < n:
            victims = self.policy.evict(n - len(taken))
            if victims is None:  # pinned blocks can make evict refuse
                self._free.extendleft(reversed(taken))
                return None
            for hook in self.evict_hooks:
                hook(victims)
            for bid in victims:
                self._uncache(self.blocks[bid])
            self.num_evictions += len(victims)
            taken.extend(victims)
        for bid in taken:
            self.blocks[bid].ref_cnt = 1
        # Ascending ids make a request's blocks one consecutive run more often (victims come
        # tail-first): attention then reads the context as a view, and offload copies it in
        # one strided copy, instead of gathering block by block.
        taken.sort()
        return taken

    def acquire(self, block_ids: Iterable[BlockId], priority: int = 0) -> None:
        """Take another reference on cached blocks (a prefix hit)."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_cnt == 0:
                self.policy.remove(bid)
            block.ref_cnt += 1
            block.priority = min(block.priority, priority)

    def release(self, block_ids: Iterable[BlockId]) -> None:
        """Drop one reference each; callers pass tails first so tails are evicted first."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {bid} released more times than acquired")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.key is not None:
                    self.policy.insert(bid, priority=block.priority)
                else:
                    self._free.append(bid)

    def cache(self, block_id: BlockId, key: BlockKey, priority: int = 0, announced: bool = True) -> None:
        """Register an in-use, fully written block under `key`. A key that is already cached
        keeps its first block: the duplicate stays private and is freed normally. `announced`:
        the caller publishes a BlockStored for it (a KV group's other than the first does not:
        events describe token blocks), so its eviction publishes a BlockRemoved."""
        if not self.enable_caching or key in self._cached:
            return
        block = self.blocks[block_id]
        if block.ref_cnt <= 0 or block.key is not None:
            raise RuntimeError(f"block {block_id} cannot be cached (ref_cnt={block.ref_cnt}, key set={block.key is not None})")
        block.key, block.priority, block.announced = key, priority, announced
        self._cached[key] = block_id

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached block; returns how many."""
        victims = self.policy.evict(len(self.policy)) or []
        for hook in self.evict_hooks:
            hook(victims)
        for bid in sorted(victims):
            self._uncache(self.blocks[bid])
            self._free.append(bid)
        return len(victims)

    def _uncache(self, block: Block) -> None:
        assert block.key is not None
        del self._cached[block.key]
        if self.events is not None and block.announced:
            self.events.append(BlockRemoved([block.key], "GPU"))
        block.key, block.priority = None, 0

    def check_integrity(self) -> None:
        """Raises RuntimeError if the three-state invariant or the key index is broken."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("free list holds a block twice")
        for block in self.blocks:
            bid = block.block_id
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {bid} has ref_cnt {block.ref_cnt}")
            in_policy = bid in self.policy
            if block.ref_cnt > 0 and (bid in free or in_policy):
                raise RuntimeError(f"in-use block {bid} is also free or evictable")
            if block.ref_cnt == 0 and (bid in free) == in_policy:
                raise RuntimeError(f"idle block {bid} must be exactly one of free/evictable")
            if in_policy and block.key is None:
                raise RuntimeError(f"evictable block {bid} has no key")
            if block.key is not None and self._cached.get(block.key) != bid:
                raise RuntimeError(f"block {bid}'s key is not indexed to it")
        if len(self._cached) != sum(b.key is not None for b in self.blocks):
            raise RuntimeError("key index and blocks disagree")
        self.policy.check_integrity()
