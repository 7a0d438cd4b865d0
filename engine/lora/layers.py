"""Batched LoRA in one forward (runner side): each targeted projection of the model becomes a
`LoRALinear` that adds, to the rows of each adapter in the step, that adapter's low-rank update.

Rows are grouped by adapter slot once per step (`LoRABatch`); the scheduler orders a step's
requests by adapter, so each group is a slice of rows and costs two thin GEMMs (x A^T, then an
addmm of B^T into the base output, the scaling folded into B); a step mixing three adapters and
the base model costs three small GEMM pairs per projection beside the base GEMM, whatever the
number of requests. (Rows that are not side by side take a gather and an index_add.) The base projection runs as before (prepacked on
CPU, engine/models/packed_linear.py).

The engine's fused projections hold several PEFT modules (q/k/v in `qkv_proj`, gate/up in
`gate_up_proj`): their A matrices are stacked and their B matrices laid out block-diagonally, so
one pair of GEMMs serves all parts; a part the adapter does not target stays zero.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


LoRARows = slice | torch.Tensor  # a slot's rows in a step: side by side, or indices


@dataclass
class LoRABatch:
    """The step's rows of each adapter slot (rows of no adapter are in none). Written by the
    runner before each forward (`LoRASlots.set_step`), read by every LoRALinear."""
    groups: list[tuple[int, LoRARows]] = field(default_factory=list)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, parts: tuple[str, ...], sizes: tuple[int, ...], slots: int, rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: str | torch.device) -> None:
        """`base`: an nn.Linear or a PackedLinear (it has in_features and out_features)."""
        super().__init__()
        if sum(sizes) != base.out_features or len(parts) != len(sizes):
            raise ValueError(f"LoRA parts {parts} of sizes {sizes} do not cover {base.out_features} outputs")
        self.base, self.parts, self.sizes, self.rank, self.batch = base, parts, sizes, rank, batch
        self.register_buffer("lora_a", torch.zeros(slots, len(parts) * rank, base.in_features, dtype=dtype,
                                                   device=device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(slots, base.out_features, len(parts) * rank, dtype=dtype,
                                                   device=device), persistent=False)

    @property
    def in_features(self) -> int:
        return self.lora_a.shape[2]

    @property
    def out_features(self) -> int:
        return self.lora_b.shape[1]

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Slot `slot` holds `weights` (PEFT module name -> (A [r, in], B [out_part, r])); parts
        not given are zero (the adapter does not touch them)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        out = 0
        for i, (part, size) in enumerate(zip(self.parts, self.sizes)):
            if part in weights:
                a, b = weights[part]
                r = a.shape[0]
                if r > self.rank or a.shape[1] != self.in_features or b.shape != (size, r):
                    raise ValueError(f"LoRA {part}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                                     f"[<= {self.rank}, {self.in_features}] / [{size}, r]")
                lo = i * self.rank
                self.lora_a[slot, lo:lo + r] = a.to(self.lora_a.dtype)
                self.lora_b[slot, out:out + size, lo:lo + r] = (b.float() * scaling).to(self.lora_b.dtype)
            out += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, rows in self.batch.groups:
            if isinstance(rows, slice):  # the scheduler orders a step by adapter: usually side by side
                y[rows].addmm_(x[rows] @ self.lora_a[slot].T, self.lora_b[slot].T)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ self.lora_a[slot].T) @ self.lora_b[slot].T)
        return y
