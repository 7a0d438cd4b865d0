"""Per-request block tables over the G1 block pool, with prefix-cache lookups.

Scheduler side: no tensors. The model runner reads `block_table(request)` to build slots.
"""
from __future__ import annotations

from kvstore.events import BlockStored
from kvstore.g1 import BlockId, BlockPool
from kvstore.keys import extend_keys
from engine.request import Request, RequestId


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int = 0) -> None:
        """`sliding_window` > 0: every layer attends only to the last that many keys, so a
        request's blocks that no later query can see are released as its computed tokens pass
        them (vLLM's sliding-window manager, for models with one KV group)."""
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        self._tables: dict[RequestId, list[BlockId]] = {}
        # Leading entries of a table whose blocks were released (out of the window): the entries
        # stay, so positions still index the table, and attention masks what they point at now.
        self._released: dict[RequestId, int] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    def block_table(self, req: Request) -> list[BlockId]:
        return self._tables.get(req.request_id, [])

    def _extend_keys(self, req: Request) -> None:
        extend_keys(req.block_keys, req.all_token_ids, self.block_size, req.cache_salt)

    def get_computed_blocks(self, req: Request) -> list[BlockId]:
        """The longest run of the request's leading full blocks already in G1. At least one
        token is always left to compute, because sampling needs the last position's logits."""
        if not self.pool.enable_caching:
            return []
        self._extend_keys(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[BlockId] = []
        for key in req.block_keys[:max_blocks]:
            bid = self.pool.lookup(key)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[BlockId] = ()) -> bool:
        """Make room for `num_new_tokens` after the request's computed and in-flight tokens (plus `computed`
        prefix-hit blocks, which are acquired here). All-or-nothing."""
        table = self._tables.setdefault(req.request_id, [])
        total = req.num_scheduled_tokens + len(computed) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - len(table) - len(computed)
        # Hit blocks that sit idle in the pool count as free until we acquire them.
        idle_hits = sum(1 for b in computed if self.pool.blocks[b].ref_cnt == 0)
        if need > self.pool.num_free_blocks() - idle_hits:
            if not table:
                del self._tables[req.request_id]
            return False
        self.pool.acquire(computed, req.priority)
        table.extend(computed)
        if need > 0:
            new = self.pool.allocate(need)
            if new is None:
                raise RuntimeError("block pool refused an allocation it reported room for")
            table.extend(new)
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register blocks whose tokens are all computed, so later requests can reuse them; with a
        sliding window, then release the ones out of it. Call whenever computed tokens advance."""
        if self.pool.enable_caching:
            self._register(req)
        if self.sliding_window:
            self._release_out_of_window(req)

    def _release_out_of_window(self, req: Request) -> None:
        # Queries from now on sit at positions >= num_computed_tokens and see keys after
        # position - window: a block whose last key is at or before num_computed - window is dead.
        table = self._tables.get(req.request_id)
        if table is None:
            return
        dead = min(len(table), max(0, req.num_computed_tokens - self.sliding_window + 1) // self.block_size)
        done = self._released.get(req.request_id, 0)
        if dead > done:
            self.pool.release(reversed(table[done:dead]))  # registered ones stay hits until evicted
            self._released[req.request_id] = dead

    def num_held_blocks(self, req: Request) -> int:
        """Blocks the request holds a reference to (its table less the released entries)."""
        return len(self._tables.get(req.request_id, ())) - self._released.get(req.request_id, 0)

    def _register(self, req: Request) -> None:
        self._extend_keys(req)
        table = self._tables.get(req.request_id, [])
        bs = self.block_size
        # Released entries were registered before their release; they may be another request's now.
        for i in range(self._released.get(req.request_id, 0), req.num_computed_tokens // bs):
            block = self.pool.blocks[table[i]]
            if block.key is None:
                self.pool.cache(table[i], req.block_keys[i], req.priority)
                if self.pool.events is not None and block.key is not None:
                    self.pool.events.append(BlockStored([block.key], req.block_keys[i - 1] if i else None,
                                                        req.all_token_ids[i * bs:(i + 1) * bs], bs, "GPU"))

    def free(self, req: Request) -> None:
        table = self._tables.pop(req.request_id, [])
        self.pool.release(reversed(table[self._released.pop(req.request_id, 0):]))

    def num_requests(self) -> int:
        return len(self._tables)
