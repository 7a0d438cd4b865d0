"""Per-request block tables over the G1 block pool, one per KV group, with prefix-cache lookups.

Scheduler side: no tensors. The model runner reads `block_tables(request)` to build slots;
connectors and drafts read group 0's (`block_table`), a full-attention group whenever the model
has one. A sliding group's table keeps an entry for every position so positions index it, but
the request holds (and the pool lends out) only the blocks still in its window: the leading
entries are released blocks or, after a prefix hit, placeholders that attention never reads.
"""
from __future__ import annotations

from kvstore.events import BlockStored, TierKind
from kvstore.g1 import BlockId, BlockPool
from kvstore.keys import BlockKey, group_key
from engine.kv.kv_groups import KVLayout
from policies import BlockInfo
from engine.core.request import Request, RequestId

PLACEHOLDER = BlockId(0)  # a table entry out of its group's window: any valid block index
PrefixHit = tuple  # one block id per group, or None where the group's window does not reach


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, layout: KVLayout) -> None:
        self.pool = pool
        self.block_size = block_size
        self.layout = layout
        self.windows = tuple(g.window for g in layout.groups)
        self._tables: dict[RequestId, tuple[list[BlockId], ...]] = {}
        # Per group, the leading entries of a table the request holds no reference to.
        self._released: dict[RequestId, list[int]] = {}
        self._group_keys: dict[RequestId, list[list[BlockKey]]] = {}  # groups 1.. (group 0 uses block_keys)
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def grouped(self) -> bool:
        """Several groups, or one sliding one: a request does not hold every block of its table,
        and connectors that take KV groups get tables in their per-group form."""
        return len(self.windows) > 1 or any(self.windows)

    def block_table(self, req: Request) -> list[BlockId]:
        """Group 0's table (what connectors and drafts index)."""
        tables = self._tables.get(req.request_id)
        return tables[0] if tables else []

    def block_tables(self, req: Request) -> tuple[list[BlockId], ...]:
        return self._tables.get(req.request_id) or tuple([] for _ in self.windows)

    def _keys(self, req: Request, group: int) -> list[BlockKey]:
        full = req.full_block_keys(self.block_size)
        if group == 0:
            return full
        keys = self._group_keys.setdefault(req.request_id, [[] for _ in self.windows])[group]
        keys += [group_key(k, group) for k in full[len(keys):]]
        return keys

    def prompt_keys(self, req: Request) -> list[BlockKey]:
        """Group 0's keys of the request's full blocks (computed or not)."""
        return self._keys(req, 0)

    def _first_needed(self, group: int, num_tokens: int) -> int:
        """The first block of `group` a query at position >= num_tokens can see."""
        w = self.windows[group]
        return max(0, num_tokens - w + 1) // self.block_size if w else 0

    def get_computed_blocks(self, req: Request) -> list[PrefixHit]:
        """The longest prefix of whole blocks every group can serve from G1: full groups need
        every block of it, sliding groups the blocks their window reaches from its end. At least
        one token is always left to compute, because sampling needs the last position's logits."""
        if not self.pool.enable_caching:
            return []
        n = (req.num_tokens - 1) // self.block_size
        keys = [self._keys(req, g) for g in range(len(self.windows))]
        # Full groups: the leading run of hits bounds the prefix.
        full: list[list[BlockId]] = []
        for g, w in enumerate(self.windows):
            if not w:
                full.append([])
                for key in keys[g][:n]:
                    bid = self.pool.lookup(key)
                    if bid is None:
                        break
                    full[-1].append(bid)
                n = len(full[-1])
        if all(not w for w in self.windows):  # no sliding group: those runs are the hit
            return [tuple(run[i] for run in full) for i in range(n)]
        while n > 0:  # the longest n whose window blocks every sliding group still has
            found = [[self.pool.lookup(keys[g][i]) if i >= self._first_needed(g, n * self.block_size) else None
                      for i in range(n)] for g in range(len(self.windows))]
            missing = [i for g, w in enumerate(self.windows) if w for i in range(self._first_needed(g, n * self.block_size), n)
                       if found[g][i] is None]
            if not missing:
                return [tuple(found[g][i] for g in range(len(self.windows))) for i in range(n)]
            n = max(missing)  # a prefix must end before the missing block
        return []

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[PrefixHit] = ()) -> bool:
        """Make room, in every group, for `num_new_tokens` after the request's computed and in-flight
        tokens (plus `computed` prefix-hit blocks, acquired here). All-or-nothing."""
        fresh = req.request_id not in self._tables
        tables = self._tables.setdefault(req.request_id, tuple([] for _ in self.windows))
        total = req.num_scheduled_tokens + len(computed) * self.block_size + num_new_tokens
        blocks = -(-total // self.block_size)
        need = sum(max(0, blocks - len(t) - len(computed)) for t in tables)
        hits = [(i, g, b) for i, h in enumerate(computed) for g, b in enumerate(h) if b is not None]
        hit_ids = [b for _, _, b in hits]
        # Hit blocks that sit idle in the pool count as free until we acquire them.
        idle_hits = sum(1 for b in hit_ids if self.pool.blocks[b].ref_cnt == 0)
        if need > self.pool.num_free_blocks() - idle_hits:
            if fresh:
                del self._tables[req.request_id]
            return False
        self.pool.acquire(hit_ids, [_info(req, i, computed[i - 1][g] if i else None) for i, g, _ in hits])
        if computed:
            self._released[req.request_id] = [next((i for i, h in enumerate(computed) if h[g] is not None), len(computed))
                                              for g in range(len(tables))]
        for g, table in enumerate(tables):
            table.extend(PLACEHOLDER if h[g] is None else h[g] for h in computed)
            more = blocks - len(table)
            if more > 0:
                new = self.pool.allocate(more)
                if new is None:
                    raise RuntimeError("block pool refused an allocation it reported room for")
                table.extend(new)
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Register blocks whose tokens are all computed, so later requests can reuse them; then
        release sliding groups' blocks out of their window. Call whenever computed tokens advance."""
        tables = self._tables.get(req.request_id)
        if tables is None:
            return
        released = self._released.setdefault(req.request_id, [0] * len(tables))
        for g, table in enumerate(tables):
            if self.pool.enable_caching:
                self._register(req, g, table, released[g])
            dead = min(len(table), self._first_needed(g, req.num_computed_tokens))
            if dead > released[g]:
                self.pool.release(reversed(table[released[g]:dead]))  # registered ones stay hits until evicted
                released[g] = dead

    def held_tables(self, req: Request) -> tuple[list[int], ...]:
        """Per group, the request's table with -1 for entries it holds no block for (a sliding
        group's released or placeholder entries): what a connector may copy out."""
        tables = self._tables.get(req.request_id, ())
        released = self._released.get(req.request_id, [0] * len(tables))
        return tuple([-1] * r + list(t[r:]) for t, r in zip(tables, released))

    def skip_unloaded(self, req: Request, end_token: int) -> None:
        """An external load brought the request to `end_token`, filling sliding groups' blocks
        only from their window at that position (a query there cannot see earlier ones): release
        the earlier ones unregistered, so their unwritten blocks never become prefix-cache hits."""
        tables = self._tables[req.request_id]
        released = self._released.setdefault(req.request_id, [0] * len(tables))
        for g, table in enumerate(tables):
            dead = min(len(table), self._first_needed(g, end_token)) if self.windows[g] else 0
            if dead > released[g]:
                self.pool.release(reversed(table[released[g]:dead]))
                released[g] = dead

    def num_held_blocks(self, req: Request, group: int | None = None) -> int:
        """Blocks the request holds a reference to (in one group, or all)."""
        tables = self._tables.get(req.request_id, ())
        released = self._released.get(req.request_id, [0] * len(tables))
        return sum(len(t) - r for g, (t, r) in enumerate(zip(tables, released)) if group in (None, g))

    def _register(self, req: Request, group: int, table: list[BlockId], start: int) -> None:
        keys = self._keys(req, group)
        bs = self.block_size
        # Entries before `start` were released or are placeholders: they may be another request's now.
        for i in range(start, req.num_computed_tokens // bs):
            block = self.pool.blocks[table[i]]
            if block.key is None:
                # The parent is the block cached under the previous key: this table's may be a
                # private duplicate, or a sliding group's placeholder.
                parent = self.pool.lookup(keys[i - 1]) if i else None
                self.pool.cache(table[i], keys[i], _info(req, i, parent), announced=group == 0)
                # Events describe token blocks (KV-aware routing): group 0's stand for them.
                if group == 0 and self.pool.events is not None and block.key is not None:
                    self.pool.events.append(BlockStored([block.key], keys[i - 1] if i else None,
                                                        req.all_token_ids[i * bs:(i + 1) * bs], bs,
                                                        TierKind.DEVICE, req.lora_tag))

    def free(self, req: Request) -> None:
        tables = self._tables.pop(req.request_id, ())
        released = self._released.pop(req.request_id, [0] * len(tables))
        self._group_keys.pop(req.request_id, None)
        for table, r in zip(reversed(tables), reversed(released)):
            self.pool.release(reversed(table[r:]))

    def group_usage(self) -> list[dict]:
        """Per KV group: its layers, window and the G1 blocks requests hold in it now."""
        held = [0] * len(self.windows)
        for rid, tables in self._tables.items():
            released = self._released.get(rid, [0] * len(tables))
            for g, (t, r) in enumerate(zip(tables, released)):
                held[g] += len(t) - r
        return [{"layers": list(grp.layer_ids), "window": grp.window, "held_blocks": n}
                for grp, n in zip(self.layout.groups, held)]

    def num_requests(self) -> int:
        return len(self._tables)


def _info(req: Request, depth: int, parent: BlockId | None) -> BlockInfo:
    """A G1 block's use by `req`, for the eviction policy: the block's index in the request and
    the block of the one before it."""
    return BlockInfo(depth, parent, req.arrival_time, req.priority, req.session)
