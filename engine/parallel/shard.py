"""What one tensor-parallel rank holds, Megatron-style.

q/k/v and gate/up are split by output rows (each rank its heads, its MLP columns), o_proj and
down_proj by input columns, each followed by an all-reduce of its output, so the residual stream
is whole on every rank. KV heads go with their query heads: each rank caches only its own, and
when there are fewer KV heads than ranks each is held by the ranks whose query heads use it. The
embedding and the LM head are replicated rather than vocab-parallel: a vocab-parallel head needs
a gather of the logits every step, and at the sizes this runs today (a 49k vocabulary, a 576-wide
hidden state) the head is a small share of the weights; sampling then needs only rank 0's.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from engine.model_config import ModelConfig

# Dense models whose attention and MLP blocks have the Llama layout (q/k/v, o, gate/up, down).
# Qwen3-MoE: its experts are tensor-parallel (each rank every expert's slice of moe_intermediate_size,
# the router replicated), not expert-parallel: every rank routes each token the same way and does the
# same share of work whatever the routing, and the all-reduce is the dense MLP's, one per layer.
SHARDABLE = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                       "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma4ForCausalLM"})
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")  # the modules whose outputs are all-reduced
MOE_BLOCK = "SparseMoeBlock"  # engine/models/moe.py: its output (the experts' partial sums) is all-reduced
# A module a model marks so (Gemma 4's experts, whose partial sums are normed before they join the
# MLP's): its output is all-reduced too.
REDUCE_OUTPUT = "tp_reduce_output"


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} out of range for size {self.size}")

    def check(self, mc: ModelConfig) -> None:
        """ValueError naming what cannot be split `size` ways."""
        n = self.size
        if mc.architecture not in SHARDABLE:
            raise ValueError(f"tensor_parallel_size={n}: {mc.architecture} cannot be sharded yet (supported: "
                             f"{', '.join(sorted(SHARDABLE))})")
        moe = getattr(mc.hf_config, "moe_intermediate_size", 0) if getattr(mc.hf_config, "num_experts", 0) else 0
        for what, value in (("attention heads", mc.num_heads), ("intermediate_size", mc.intermediate_size),
                            ("moe_intermediate_size", moe)):
            if value % n:
                raise ValueError(f"tensor_parallel_size={n} does not divide the model's {what} ({value})")
        for kv in sorted({mc.kv_shape(i)[0] for i in range(mc.num_layers)}):
            if kv % n and n % kv:
                raise ValueError(f"tensor_parallel_size={n}: the model's {kv} KV heads can be neither split nor "
                                 "replicated evenly over the ranks")

    @property
    def trivial(self) -> bool:
        return self.size == 1

    def q_heads(self, mc: ModelConfig) -> range:
        per = mc.num_heads // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def kv_heads(self, mc: ModelConfig, layer: int = 0) -> range:
        """The KV heads of `layer` this rank holds (layers differ in Gemma 4)."""
        kv = mc.kv_shape(layer)[0]
        if kv >= self.size:
            per = kv // self.size
            return range(self.rank * per, (self.rank + 1) * per)
        first = self.rank * kv // self.size  # replicated: the head this rank's query heads use
        return range(first, first + 1)

    def config(self, mc: ModelConfig) -> ModelConfig:
        """The rank's shapes: its heads and MLP columns (the checkpoint's config otherwise)."""
        if self.trivial:
            return mc
        self.check(mc)
        hf = mc.hf_config
        if getattr(hf, "num_experts", 0):  # the MoE block reads its sizes from the checkpoint's config
            hf = copy.deepcopy(hf)
            hf.moe_intermediate_size //= self.size
        shapes = tuple((len(self.kv_heads(mc, i)), mc.kv_shape(i)[1]) for i in range(mc.num_layers))
        return replace(mc, num_heads=len(self.q_heads(mc)), num_kv_heads=len(self.kv_heads(mc)),
                       intermediate_size=mc.intermediate_size // self.size, hf_config=hf,
                       layer_kv_shapes=shapes if mc.layer_kv_shapes else ())

    def weights(self, mc: ModelConfig, tensors: Iterator[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors cut to this rank's part (`mc`: the whole model's config)."""
        if self.trivial:
            yield from tensors
            return
        q = self.q_heads(mc)
        moe_full = getattr(mc.hf_config, "moe_intermediate_size", 0) or 0
        mi = moe_full // self.size
        for name, t in tensors:
            parts = name.split(".")
            module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
            if ".experts." in name:
                yield name, self._expert_part(name, t, moe_full, mi)
                continue
            layer = _layer_of(parts)
            if module in ("q_proj", "o_proj") and kind == "weight":  # a layer's own head size (Gemma 4)
                d = t.shape[0 if module == "q_proj" else 1] // mc.num_heads
                t = t.narrow(0 if module == "q_proj" else 1, q.start * d, len(q) * d)
            elif module == "q_proj":  # its bias
                d = t.shape[0] // mc.num_heads
                t = t.narrow(0, q.start * d, len(q) * d)
            elif module in ("k_proj", "v_proj"):
                kv, d = self.kv_heads(mc, layer), mc.kv_shape(layer)[1]
                t = t.narrow(0, kv.start * d, len(kv) * d)
            elif module in ("gate_proj", "up_proj"):  # MLP columns: a double-wide layer's too
                per = t.shape[0] // self.size
                t = t.narrow(0, self.rank * per, per)
            elif module == "down_proj" and kind == "weight":
                per = t.shape[1] // self.size
                t = t.narrow(1, self.rank * per, per)
            elif module in ("o_proj", "down_proj") and kind == "bias" and self.rank:
                t = torch.zeros_like(t)  # added once, by rank 0, before the all-reduce sums the ranks
            yield name, t.contiguous()

    def lora_part(self, mc: ModelConfig, layer: int, module: str, a: torch.Tensor, b: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA adapter's (A [r, in], B [out, r]) for `module` of `layer`,
        cut as its base weight is (`mc`: the whole model's config): a column-parallel module
        (q/k/v, gate/up) keeps A whole and its rows of B; a row-parallel one (o, down) its columns of
        A and B whole, so each rank adds x_r A_r^T B^T to its partial output and the all-reduce that
        follows sums the update with the base (o and down stay wrapped by the hook: engine/lora/slots.py)."""
        if self.trivial:
            return a, b
        q = self.q_heads(mc)
        if module == "q_proj":
            d = b.shape[0] // mc.num_heads
            b = b.narrow(0, q.start * d, len(q) * d)
        elif module in ("k_proj", "v_proj"):
            kv, d = self.kv_heads(mc, layer), mc.kv_shape(layer)[1]
            b = b.narrow(0, kv.start * d, len(kv) * d)
        elif module in ("gate_proj", "up_proj"):
            per = b.shape[0] // self.size
            b = b.narrow(0, self.rank * per, per)
        elif module == "o_proj":
            d = a.shape[1] // mc.num_heads
            a = a.narrow(1, q.start * d, len(q) * d)
        elif module == "down_proj":
            per = a.shape[1] // self.size
            a = a.narrow(1, self.rank * per, per)
        else:
            raise ValueError(f"tensor-parallel sharding: no LoRA rule for {module!r}")
        return a.contiguous(), b.contiguous()

    def _expert_part(self, name: str, t: torch.Tensor, full: int, mi: int) -> torch.Tensor:
        """This rank's slice of an expert tensor: per-expert gate/up rows and down columns, or of the
        fused `experts.gate_up_proj` [E, 2 * full, hidden] both halves' rows, `experts.down_proj`
        [E, hidden, full] its columns."""
        r = self.rank * mi
        if name.endswith(("gate_proj.weight", "up_proj.weight")):
            t = t.narrow(0, r, mi)
        elif name.endswith("experts.gate_up_proj"):
            t = torch.cat([t.narrow(1, r, mi), t.narrow(1, full + r, mi)], dim=1)
        elif name.endswith("down_proj.weight"):
            t = t.narrow(1, r, mi)
        elif name.endswith("experts.down_proj"):
            t = t.narrow(2, r, mi)
        else:
            raise ValueError(f"tensor-parallel sharding: unexpected expert weight {name!r}")
        return t.contiguous()

    def attach(self, model: torch.nn.Module, all_reduce: Callable[[torch.Tensor], None]) -> int:
        """All-reduces (in place) the output of every row-parallel module; returns how many."""
        if self.trivial:
            return 0
        def hook(_module: torch.nn.Module, _inputs: object, out: torch.Tensor) -> None:
            all_reduce(out)  # and return None: a forward hook's non-None result would replace the output

        count = 0
        for name, module in model.named_modules():
            if name.endswith(ROW_PARALLEL) or type(module).__name__ == MOE_BLOCK or getattr(module, REDUCE_OUTPUT, False):
                module.register_forward_hook(hook)
                count += 1
        return count


def _layer_of(parts: list[str]) -> int:
    """The decoder layer a checkpoint tensor name belongs to (`...layers.L....`); 0 outside layers."""
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return 0
