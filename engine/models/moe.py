"""Mixture-of-experts MLP (Qwen3-MoE): a softmax top-k router over experts without a shared one.

The experts run grouped, not token by token: the step's (token, expert) pairs are sorted by expert
so that each expert with work does one GEMM over its contiguous slice of tokens (a loop over at
most `num_experts`, whatever the token count), and the weighted outputs are summed back with one
`index_add_` in expert order, as transformers sums them. The grouped computation is one opaque
op, `kvtier::moe_experts`, so that the compiled graph keeps its single dynamic size (the token
count): how many tokens each expert gets is data, not a shape the graph sees.
"""
from __future__ import annotations

import itertools
import re
import weakref
from collections.abc import Callable

import torch
from torch import nn

from engine.model_config import ModelConfig

# Packed experts by key, for `kvtier::moe_experts_packed` (as engine/models/packed_linear.py does
# for linears: oneDNN's packed tensors cannot be graph constants).
_live: dict[int, weakref.ref[Experts]] = {}
_keys = itertools.count()


def _grouped(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum over each token's k experts of weight * expert(e, token), one `expert` call per expert
    with tokens (its rows contiguous)."""
    k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # stable: a token's pairs stay in token order per expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // k
    xs = x.index_select(0, tokens)
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start:start + n] = expert(e, xs[start:start + n])
            start += n
    out.mul_(topk_weights.reshape(-1).index_select(0, order).unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, tokens, out)


@torch.library.custom_op("kvtier::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, gelu: bool) -> torch.Tensor:
    """`x` [T, H], `topk_ids`/`topk_weights` [T, k], `gate_up` [E, 2I, H] (gate rows first),
    `down` [E, H, I]. Returns sum over each token's k experts of weight * down(act(gate) * up),
    act SiLU (Qwen3-MoE) or with `gelu` GELU-tanh (Gemma 4)."""
    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        gate, up = nn.functional.linear(xe, gate_up[e]).chunk(2, dim=-1)
        return nn.functional.linear(_act(gate, gelu) * up, down[e])

    return _grouped(x, topk_ids, topk_weights, gate_up.shape[0], expert)


def _act(x: torch.Tensor, gelu: bool, inplace: bool = False) -> torch.Tensor:
    return nn.functional.gelu(x, approximate="tanh") if gelu else nn.functional.silu(x, inplace=inplace)


@moe_experts.register_fake
def _(x, topk_ids, topk_weights, gate_up, down, gelu):
    return torch.empty_like(x)


@torch.library.custom_op("kvtier::moe_experts_packed", mutates_args=())
def moe_experts_packed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, key: int,
                       gelu: bool) -> torch.Tensor:
    """`moe_experts` with the weights of packed `Experts` number `key` (oneDNN's blocked layout)."""
    owner = _live[key]()
    if owner is None:
        raise RuntimeError(f"packed experts {key} were released")
    linear = torch.ops.mkldnn._linear_pointwise

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        gate, up, down = owner.packed[e]
        h = _act(linear(xe, gate, None, "none", [], ""), gelu, inplace=True)
        return linear(h.mul_(linear(xe, up, None, "none", [], "")), down, None, "none", [], "")

    return _grouped(x, topk_ids, topk_weights, len(owner.packed), expert)


@moe_experts_packed.register_fake
def _(x, topk_ids, topk_weights, key, gelu):
    return torch.empty_like(x)


class Experts(nn.Module):
    # The grouped path reads each expert's token count on the host (`_grouped`): no CUDA graph
    # can replay that, so the engine runs a model holding these eagerly (engine/core/build.py).
    syncs_with_host = True

    def __init__(self, num_experts: int, hidden: int, inter: int, gelu: bool = False) -> None:
        super().__init__()
        self.gelu = gelu  # GELU-tanh experts (Gemma 4); SiLU otherwise
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.packed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.key: int | None = None

    def prepack(self) -> None:
        """Packs each expert's gate, up and down into oneDNN's layout (engine/models/packed_linear.py
        explains why: the dense MLP's GEMMs ran ~2x faster packed, and so do the experts') and
        releases the plain copies."""
        reorder = torch.ops.mkldnn._reorder_linear_weight
        inter = self.down_proj.shape[2]
        self.packed = [(reorder(gu[:inter].contiguous(), None), reorder(gu[inter:].contiguous(), None),
                        reorder(d.contiguous(), None))
                       for gu, d in zip(self.gate_up_proj.detach(), self.down_proj.detach())]
        self.gate_up_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        self.key = next(_keys)
        _live[self.key] = weakref.ref(self, lambda _, k=self.key: _live.pop(k, None))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.key is not None:
            return torch.ops.kvtier.moe_experts_packed(x, ids, weights, self.key, self.gelu)
        return torch.ops.kvtier.moe_experts(x, ids, weights, self.gate_up_proj, self.down_proj, self.gelu)


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))


class SparseMoeBlock(nn.Module):
    """Qwen3-MoE's sparse MLP. Parameter names follow transformers 5 (`gate.weight`,
    `experts.gate_up_proj`, `experts.down_proj`); `expert_weight_slot` maps the per-expert names
    of checkpoints saved by earlier versions onto them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.top_k, self.norm_topk_prob = hf.num_experts_per_tok, bool(hf.norm_topk_prob)
        self.gate = Router(hf.num_experts, cfg.hidden_size)
        self.experts = Experts(hf.num_experts, cfg.hidden_size, hf.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' order: float32 softmax, top-k, renormalise, back to the model's dtype.
        logits = nn.functional.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.experts(x, ids, weights.to(logits.dtype))


def is_moe_layer(cfg: ModelConfig, layer_idx: int) -> bool:
    hf = cfg.hf_config
    num_experts = getattr(hf, "num_experts", 0) or 0
    return (num_experts > 0 and layer_idx not in (getattr(hf, "mlp_only_layers", None) or [])
            and (layer_idx + 1) % getattr(hf, "decoder_sparse_step", 1) == 0)


_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def expert_weight_slot(name: str, moe_inter: int) -> tuple[str, int, int, int] | None:
    """For a per-expert checkpoint name (`layers.L.mlp.experts.E.up_proj.weight`): the fused
    parameter it goes into, the expert, and its first row and row count there; else None."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    prefix, expert, kind = m.group(1), int(m.group(2)), m.group(3)
    if kind == "down_proj":
        return f"{prefix}.down_proj", expert, 0, -1
    return f"{prefix}.gate_up_proj", expert, 0 if kind == "gate_proj" else moe_inter, moe_inter
