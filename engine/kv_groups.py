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
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    layer_ids: tuple[int, ...]  # slot j of the group's blocks holds layer layer_ids[j]
    window: int  # the layers' sliding window; 0: full attention

    def __post_init__(self) -> None:
        if not self.layer_ids or self.window < 0:
            raise ValueError(f"a KV group needs layers and a window >= 0; got {self.layer_ids}, {self.window}")


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]  # full-attention groups first (group 0 is the one drafts and connectors index)

    def __post_init__(self) -> None:
        layers = sorted(i for g in self.groups for i in g.layer_ids)
        if not layers or layers != list(range(len(layers))):
            raise ValueError(f"KV groups must cover layers 0..n-1 once each; got {layers}")

    @staticmethod
    def single(num_layers: int, window: int = 0) -> KVLayout:
        """Every layer in one group: one block table a request, every layer's history in G1
        (unless all share `window`)."""
        return KVLayout((KVGroup(tuple(range(num_layers)), window),))

    @property
    def slots(self) -> int:
        """Layers a block holds: the largest group's."""
        return max(len(g.layer_ids) for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_ids) for g in self.groups)

    def blocks_per_sequence(self, num_tokens: int, block_size: int, step_tokens: int) -> int:
        """The most G1 blocks one sequence of `num_tokens` can hold at once, computing at most
        `step_tokens` a step: every block in a full group; in a sliding group the window's and
        the step's (a prompt chunk writes every token's KV before the window moves past it)."""
        whole = -(-num_tokens // block_size)
        return sum(whole if not g.window else
                   min(whole, -(-(g.window - 1 + min(step_tokens, num_tokens)) // block_size) + 2)
                   for g in self.groups)

    def placement(self) -> list[tuple[int, int]]:
        """(group, slot) of each layer, by layer id."""
        out = [(0, 0)] * self.num_layers
        for gi, g in enumerate(self.groups):
            for slot, layer in enumerate(g.layer_ids):
                out[layer] = (gi, slot)
        return out


def plan_kv_layout(windows: tuple[int, ...]) -> KVLayout:
    """Groups for layers with these windows (0 = full attention). Every kind of layer is cut into
    groups of the size of the rarest kind, so blocks are the same size for all of them (the last
    group of a kind may be smaller and leave slots unused). One kind: one group."""
    kinds: dict[int, list[int]] = {}
    for layer, w in enumerate(windows):
        kinds.setdefault(w, []).append(layer)
    if len(kinds) == 1:
        return KVLayout.single(len(windows), windows[0])
    size = min(len(layers) for layers in kinds.values())
    groups = [KVGroup(tuple(layers[i:i + size]), w)
              for w in sorted(kinds) for layers in [kinds[w]] for i in range(0, len(layers), size)]
    return KVLayout(tuple(groups))
