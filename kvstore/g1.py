"""G1 bookkeeping: the paged block pool with reference counts and the prefix cache.

No tensors live here (the model runner owns the cache tensors); this is the scheduler-side
index of which block holds what. Every block is in exactly one of three states:

- in use: ref_cnt > 0 (may also be cached, i.e. reachable by its key);
- evictable: ref_cnt == 0, cached, and an unpinned candidate in the eviction policy;
- free: ref_cnt == 0, not cached, in the free list.

A cached block stays in the policy from its first release on: a prefix hit touches it and pins
it while requests hold it, the last release unpins it, so a policy that keeps history keeps it
across uses. An in-use block is in the policy only pinned (or not yet, before its first release).

Allocation takes free blocks first and evicts cached ones through the policy only when it
must, so that reusable prefixes survive as long as possible.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import NewType

from kvstore.events import BlockRemoved, EventBuffer, TierKind
from kvstore.keys import BlockKey
from policies import BlockInfo, EvictionPolicy

BlockId = NewType("BlockId", int)
NO_INFO = BlockInfo()


@dataclass
class Block:
    block_id: BlockId
    ref_cnt: int = 0
    key: BlockKey | None = None  # set only while the block is registered in the prefix cache
    # While cached: its latest use (BlockPool.cache, acquire), with the most urgent priority of
    # the requests that used it since it was cached; what the policy gets at its first release.
    info: BlockInfo = NO_INFO
    announced: bool = True  # its caching was published as a KV event, so its removal is too


class BlockPool:
    def __init__(self, num_blocks: int, policy: EvictionPolicy[BlockId], enable_caching: bool = True,
                 events: EventBuffer | None = None) -> None:
        """`events`: where KV events about G1's prefix cache go (None: off)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(BlockId(i)) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self.policy = policy
        self._free: deque[BlockId] = deque(BlockId(i) for i in range(num_blocks))
        self._cached: dict[BlockKey, BlockId] = {}
        self._pinned: set[BlockId] = set()  # in use and in the policy (pinned there): not evictable
        self.num_evictions = 0
        self.events = events
        # Called with cached blocks about to lose their contents (eviction, prefix-cache reset)
        # while their keys and bytes are still valid: how write-back offload sees them.
        self.evict_hooks: list[Callable[[list[BlockId]], None]] = []

    # -- queries ---------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        """Blocks an allocation could get: free plus evictable."""
        return len(self._free) + self._num_evictable()

    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache (those KV events announced as G1 and have not removed)."""
        return len(self._cached)

    def _num_evictable(self) -> int:
        return len(self.policy) - len(self._pinned)

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

    def acquire(self, block_ids: Sequence[BlockId], infos: Sequence[BlockInfo] | None = None) -> None:
        """Take another reference on cached blocks. `infos`, one per block: a request's prefix
        hit, each block's use as the policy sees it (`touch_block`). None: a hold that is no use
        (a connector keeping blocks until it has copied them). Either way a block that was
        evictable is pinned in the policy until its last release."""
        if infos is not None and len(infos) != len(block_ids):
            raise ValueError(f"acquire got {len(block_ids)} blocks but {len(infos)} infos")
        for i, bid in enumerate(block_ids):
            block = self.blocks[bid]
            if infos is not None and block.key is not None:
                info = infos[i]
                if bid in self.policy:  # a pinned one too: another request's use counts
                    self.policy.touch_block(bid, info)
                block.info = info if info.priority <= block.info.priority else replace(info, priority=block.info.priority)
            if block.ref_cnt == 0:
                self.policy.pin(bid)  # KeyError for a free block: only cached ones are acquired
                self._pinned.add(bid)
            block.ref_cnt += 1

    def release(self, block_ids: Iterable[BlockId]) -> None:
        """Drop one reference each; callers pass tails first so tails are evicted first (a
        block's last release ranks it as just used, or inserts it on its first: the tail first,
        so it is the older)."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {bid} released more times than acquired")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if bid in self._pinned:
                    self._pinned.remove(bid)
                    self.policy.unpin(bid)
                elif block.key is not None:  # its first release since it was cached
                    self.policy.insert_block(bid, block.info)
                else:
                    self._free.append(bid)

    def cache(self, block_id: BlockId, key: BlockKey, info: BlockInfo = NO_INFO, announced: bool = True) -> None:
        """Register an in-use, fully written block under `key`; `info` is its use by the caching
        request. A key that is already cached keeps its first block: the duplicate stays private
        and is freed normally. `announced`: the caller publishes a BlockStored for it (a KV
        group's other than the first does not: events describe token blocks), so its eviction
        publishes a BlockRemoved."""
        if not self.enable_caching or key in self._cached:
            return
        block = self.blocks[block_id]
        if block.ref_cnt <= 0 or block.key is not None:
            raise RuntimeError(f"block {block_id} cannot be cached (ref_cnt={block.ref_cnt}, key set={block.key is not None})")
        block.key, block.info, block.announced = key, info, announced
        self._cached[key] = block_id

    def reset_prefix_cache(self) -> int:
        """Drop every evictable cached block (not those requests hold); returns how many."""
        victims = self.policy.evict(self._num_evictable()) or []
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
            self.events.append(BlockRemoved([block.key], TierKind.DEVICE))
        block.key, block.info = None, NO_INFO

    def check_integrity(self) -> None:
        """Raises RuntimeError if the three-state invariant or the key index is broken."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise RuntimeError("free list holds a block twice")
        for block in self.blocks:
            bid = block.block_id
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {bid} has ref_cnt {block.ref_cnt}")
            in_policy, pinned = bid in self.policy, bid in self._pinned
            if block.ref_cnt > 0 and (bid in free or in_policy != pinned):
                raise RuntimeError(f"in-use block {bid} is free, or in the policy unpinned, or pinned outside it")
            if block.ref_cnt == 0 and (pinned or (bid in free) == in_policy):
                raise RuntimeError(f"idle block {bid} must be exactly one of free/evictable")
            if in_policy and block.key is None:
                raise RuntimeError(f"evictable block {bid} has no key")
            if block.key is not None and self._cached.get(block.key) != bid:
                raise RuntimeError(f"block {bid}'s key is not indexed to it")
        if len(self._cached) != sum(b.key is not None for b in self.blocks):
            raise RuntimeError("key index and blocks disagree")
        self.policy.check_integrity()
