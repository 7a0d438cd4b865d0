"""KV cache groups: which layers share a block table (vLLM's hybrid allocator idea).

Layers that attend the same way (the whole context, or one sliding window) form groups of equal
size; a G1 block holds one group's layers (`slots` of them), so the cache tensor is
`[slots, 2, num_blocks, block_size, kv_heads, head_dim]` and slot j serves layer j of whichever
group owns the block. Each group has its own block table per request, drawn from the one pool;
a sliding group releases the blocks that left its window, so G1 holds sliding layers' windows
and only the full-attention layers' history. Gemma 3 270M (15 sliding layers, 3 global) becomes
one full group and five sliding ones of 3 layers: a block is 3 layers' KV, and an 8k-token
request holds 8k tokens of 3 layers plus five 512-token windows, against 8k of all 18.

With one kind of layer there is one group of every layer: the layout kvtier always had.

Layers whose K and V differ in shape (Gemma 4: global layers with another head size and KV head
count) share the tensor as rows of the widest layer's width, `[slots, 2, num_blocks, block_size,
1, width]`, each layer a strided view `[num_blocks, block_size, kv_heads, head_dim]` of its slot
(and part of the row, where narrower layers are packed side by side). Layers that reuse an
earlier layer's KV (Gemma 4's KV sharing) have no cache: they read their source's.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    layer_ids: tuple[int, ...]  # layer_ids[j] lives in slot j // per_slot, part j % per_slot of the group's blocks
    window: int  # the layers' sliding window; 0: full attention
    # Layers side by side in one slot: a token's row is as wide as the widest layer's K (or V), and
    # narrower layers (Gemma 4's global layers, with fewer KV heads) share it rather than pad it.
    per_slot: int = 1

    def __post_init__(self) -> None:
        if not self.layer_ids or self.window < 0 or self.per_slot < 1:
            raise ValueError(f"a KV group needs layers, a window >= 0 and per_slot >= 1; got {self}")

    @property
    def slots(self) -> int:
        return -(-len(self.layer_ids) // self.per_slot)


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]  # full-attention groups first (group 0 is the one drafts and connectors index)
    # (layer, earlier layer whose KV it attends to): layers without a cache of their own (Gemma 4's
    # KV sharing) read their source's slot and block table.
    aliases: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        owners = {i for g in self.groups for i in g.layer_ids}
        layers = sorted([i for g in self.groups for i in g.layer_ids] + [a for a, _ in self.aliases])
        if not layers or layers != list(range(len(layers))):
            raise ValueError(f"KV groups and aliases must cover layers 0..n-1 once each; got {layers}")
        if any(src not in owners or src >= a for a, src in self.aliases):
            raise ValueError(f"an alias must name an earlier layer with a cache; got {self.aliases}")

    @staticmethod
    def single(num_layers: int, window: int = 0, sources: tuple[int, ...] = ()) -> KVLayout:
        """Every layer with a cache in one group (`sources`: ModelConfig.kv_sources): one block
        table a request, every layer's history in G1 (unless all share `window`)."""
        sources = sources or tuple(range(num_layers))
        owners = tuple(i for i in range(num_layers) if sources[i] == i)
        return KVLayout((KVGroup(owners, window),), _aliases(sources))

    @property
    def slots(self) -> int:
        """Slots a block holds: the largest group's."""
        return max(g.slots for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_ids) for g in self.groups) + len(self.aliases)

    def blocks_per_sequence(self, num_tokens: int, block_size: int, step_tokens: int) -> int:
        """The most G1 blocks one sequence of `num_tokens` can hold at once, computing at most
        `step_tokens` a step: every block in a full group; in a sliding group the window's and
        the step's (a prompt chunk writes every token's KV before the window moves past it)."""
        whole = -(-num_tokens // block_size)
        return sum(whole if not g.window else
                   min(whole, -(-(g.window - 1 + min(step_tokens, num_tokens)) // block_size) + 2)
                   for g in self.groups)

    def placement(self) -> list[tuple[int, int, int]]:
        """(group, slot, part) of each layer's cache, by layer id (an alias: its source's)."""
        out = [(0, 0, 0)] * self.num_layers
        for gi, g in enumerate(self.groups):
            for j, layer in enumerate(g.layer_ids):
                out[layer] = (gi, j // g.per_slot, j % g.per_slot)
        for layer, src in self.aliases:
            out[layer] = out[src]
        return out


def _aliases(sources: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((i, s) for i, s in enumerate(sources) if s != i)


def plan_kv_layout(windows: tuple[int, ...], widths: tuple[int, ...] = (), sources: tuple[int, ...] = ()) -> KVLayout:
    """Groups for layers with these windows (0 = full attention), K widths (kv_heads * head_dim;
    default all equal) and KV sources (ModelConfig.kv_sources; default each its own). Layers
    that own a cache are sorted into kinds by (window, width); a kind narrower than the widest
    packs `widest // width` layers a slot. Every kind is cut into groups of the slot count of the
    rarest, so blocks are the same size for all of them (the last group of a kind may be smaller
    and leave slots unused). One kind: one group."""
    n = len(windows)
    widths, sources = widths or (1,) * n, sources or tuple(range(n))
    kinds: dict[tuple[int, int], list[int]] = {}
    for layer in range(n):
        if sources[layer] == layer:
            kinds.setdefault((windows[layer], widths[layer]), []).append(layer)
    row = max(w for _, w in kinds)
    if len(kinds) == 1:
        (window, _), layers = next(iter(kinds.items()))
        return KVLayout((KVGroup(tuple(layers), window),), _aliases(sources))
    per = {kind: max(1, row // kind[1]) for kind in kinds}
    size = min(-(-len(layers) // per[kind]) for kind, layers in kinds.items())
    groups = [KVGroup(tuple(layers[i:i + size * per[kind]]), kind[0], per[kind])
              for kind in sorted(kinds) for layers in [kinds[kind]] for i in range(0, len(layers), size * per[kind])]
    return KVLayout(tuple(groups), _aliases(sources))
