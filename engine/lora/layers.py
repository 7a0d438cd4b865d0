"""Batched LoRA in one forward (runner side): each targeted projection of the model becomes a
`LoRALinear` that adds, to the rows of each adapter in the step, that adapter's low-rank update.

Rows are grouped by adapter slot once per step (`plan_step`); the scheduler orders a step's
requests by adapter, so each group is usually a slice of rows. Two ways to apply the updates:
- batched (decode-sized groups of similar size): the groups, padded to one width, go through two
  `bmm`s over the step's slots, x A^T then (x A^T) B^T added into the base output: two calls per
  projection whatever the number of adapters. Measured on the demo model's shapes (2 cores), 4
  adapters of 16 rows: 40% less time than a GEMM pair per group, whose cost at these sizes is
  mostly per call;
- per group (prefill chunks, or groups too uneven to pad): a GEMM pair per adapter.
On a GPU with Triton, groups that are slices run instead as two launches of one segmented kernel
(engine/kernels/lora_sgmv.py), which needs no padding at any size.
Rows of no adapter are in no group. The scaling is folded into B.

The engine's fused projections hold several PEFT modules (q/k/v in `qkv_proj`, gate/up in
`gate_up_proj`): their A matrices are stacked, so one shrink GEMM serves all parts, and B is laid
out block-diagonally (a part the adapter does not target stays zero). A base whose output comes in
parts (a split PackedLinear: gate and up) keeps doing so (`forward_parts`); each part then takes
only its own block of B.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


LoRARows = slice | torch.Tensor  # a slot's rows in a step: side by side, or indices

# Batch the groups when padding them to the widest costs at most this factor in rows, and the
# widest is decode-sized: past that a GEMM pair per group is as fast and pads nothing.
PAD_FACTOR = 1.5
MAX_BATCHED_WIDTH = 64


@dataclass(frozen=True)
class LoRAStep:
    """A step's adapter rows. `groups`: (slot, rows) of each adapter in the step. When `width`
    is set the groups run batched, each padded to `width` rows: `slots` are their slots in order
    (a slice when consecutive); `rows`, when the groups are equal, consecutive slices, is their
    span (a view, no copy); otherwise `gather` names the row of each padded position and
    `real_pos`/`real_rows` the positions that are real rows and those rows. `segments`, for the
    Triton kernel: (starts, lens, slots) on the device and the longest group, a host int."""
    groups: tuple[tuple[int, LoRARows], ...] = ()
    width: int = 0
    slots: slice | torch.Tensor | None = None
    rows: slice | None = None
    gather: torch.Tensor | None = None
    real_pos: torch.Tensor | None = None
    real_rows: torch.Tensor | None = None
    segments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None


def _row_list(rows: LoRARows) -> list[int]:
    return list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows.tolist()


def plan_step(groups: Sequence[tuple[int, LoRARows]], device: str | torch.device, kernel: bool = False) -> LoRAStep:
    """How the step's groups run (see the module docstring). `kernel`: use the Triton kernel for
    groups that are all slices."""
    groups = tuple(groups)
    if kernel and groups and all(isinstance(rows, slice) for _, rows in groups):
        cols = list(zip(*((rows.start, rows.stop - rows.start, slot) for slot, rows in groups)))
        as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
        return LoRAStep(groups, segments=(as_t(cols[0]), as_t(cols[1]), as_t(cols[2]), max(cols[1])))
    if len(groups) < 2:
        return LoRAStep(groups)
    lists = [_row_list(rows) for _, rows in groups]
    width, total = max(map(len, lists)), sum(map(len, lists))
    if width > MAX_BATCHED_WIDTH or len(groups) * width > PAD_FACTOR * total:
        return LoRAStep(groups)
    ids = [slot for slot, _ in groups]
    slots = slice(ids[0], ids[0] + len(ids)) if ids == list(range(ids[0], ids[0] + len(ids))) \
        else torch.tensor(ids, dtype=torch.long, device=device)
    if all(len(r) == width for r in lists) and all(b[0] == a[-1] + 1 for a, b in zip(lists, lists[1:])) \
            and all(r == list(range(r[0], r[0] + width)) for r in lists):
        return LoRAStep(groups, width, slots, rows=slice(lists[0][0], lists[-1][-1] + 1))
    gather, real_pos, real_rows = [], [], []
    for g, r in enumerate(lists):
        real_pos.extend(range(g * width, g * width + len(r)))
        real_rows.extend(r)
        gather.extend(r + [r[-1]] * (width - len(r)))  # padding repeats a row; its result is dropped
    as_t = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return LoRAStep(groups, width, slots, gather=as_t(gather), real_pos=as_t(real_pos), real_rows=as_t(real_rows))


class LoRABatch:
    """The step's `LoRAStep`, written by the runner before each forward (`LoRASlots.set_step`) and
    read by every LoRALinear."""

    def __init__(self) -> None:
        self.step = LoRAStep()


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, parts: tuple[str, ...], sizes: tuple[int, ...], slots: int, rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: str | torch.device) -> None:
        """`base`: an nn.Linear or a PackedLinear (it has in_features and out_features)."""
        super().__init__()
        if sum(sizes) != base.out_features or len(parts) != len(sizes):
            raise ValueError(f"LoRA parts {parts} of sizes {sizes} do not cover {base.out_features} outputs")
        self.base, self.parts, self.sizes, self.rank, self.batch = base, parts, sizes, rank, batch
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        # Each part's output columns and rank rows (of B^T; its columns of x A^T).
        self._spans = [(slice(lo, lo + size), slice(i * rank, (i + 1) * rank)) for i, (lo, size) in enumerate(zip(starts, sizes))]
        base_parts = tuple(getattr(base, "parts", (base.out_features,)))
        self.splits_output = len(base_parts) > 1
        if self.splits_output and base_parts != tuple(sizes):
            raise ValueError(f"LoRA parts of sizes {sizes} do not match the projection's output parts {base_parts}")
        # Stored transposed, as the GEMMs read them: x @ A^T [in, parts*rank], then @ B^T [parts*rank, out].
        self.register_buffer("lora_a_t", torch.zeros(slots, base.in_features, len(parts) * rank, dtype=dtype,
                                                     device=device), persistent=False)
        self.register_buffer("lora_b_t", torch.zeros(slots, len(parts) * rank, base.out_features, dtype=dtype,
                                                     device=device), persistent=False)

    @property
    def in_features(self) -> int:
        return self.lora_a_t.shape[1]

    @property
    def out_features(self) -> int:
        return self.lora_b_t.shape[2]

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Slot `slot` holds `weights` (PEFT module name -> (A [r, in], B [out_part, r])); parts
        not given are zero (the adapter does not touch them)."""
        a_t, b_t = torch.zeros_like(self.lora_a_t[slot]), torch.zeros_like(self.lora_b_t[slot])
        for part, (cols, ranks) in zip(self.parts, self._spans):
            if part in weights:
                a, b = weights[part]
                r, size = a.shape[0], cols.stop - cols.start
                if r > self.rank or a.shape[1] != self.in_features or b.shape != (size, r):
                    raise ValueError(f"LoRA {part}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                                     f"[<= {self.rank}, {self.in_features}] / [{size}, r]")
                a_t[:, ranks.start:ranks.start + r] = a.T.to(a_t.dtype)
                b_t[ranks.start:ranks.start + r, cols] = (b.float() * scaling).T.to(b_t.dtype)
        self.lora_a_t[slot] = a_t  # written once all parts fit: a refused adapter leaves the slot as it was
        self.lora_b_t[slot] = b_t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.batch.step.groups:  # one output: one block-diagonal B^T serves every part
            self._add_updates(x, [(y, slice(None), slice(None))])
        return y

    def forward_parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The base's `forward_parts` (one contiguous tensor per part), each with its update."""
        outs = self.base.forward_parts(x)
        if self.batch.step.groups:
            self._add_updates(x, [(out, ranks, cols) for out, (cols, ranks) in zip(outs, self._spans)])
        return outs

    def _add_updates(self, x: torch.Tensor, targets: list[tuple[torch.Tensor, slice, slice]]) -> None:
        """Adds each group's update to `targets`: (output, its rank rows of B^T, its columns)."""
        step = self.batch.step
        if step.segments is not None:
            from engine.kernels import sgmv

            starts, lens, slots, longest = step.segments
            t = x.new_empty(x.shape[0], self.lora_a_t.shape[2])  # rows outside the groups: never read
            sgmv(x, self.lora_a_t, t, starts, lens, slots, longest, accumulate=False)
            for out, ranks, cols in targets:
                sgmv(t[:, ranks], self.lora_b_t[:, ranks, cols], out, starts, lens, slots, longest, accumulate=True)
            return
        if step.width:
            a_t, b_t = self.lora_a_t[step.slots], self.lora_b_t[step.slots]
            g = len(step.groups)
            if step.rows is not None:
                t = torch.bmm(x[step.rows].reshape(g, step.width, -1), a_t)
                for out, ranks, cols in targets:
                    out[step.rows].view(g, step.width, -1).baddbmm_(t[:, :, ranks], b_t[:, ranks, cols])
            else:
                t = torch.bmm(x.index_select(0, step.gather).view(g, step.width, -1), a_t)
                for out, ranks, cols in targets:
                    u = torch.bmm(t[:, :, ranks], b_t[:, ranks, cols])
                    out.index_add_(0, step.real_rows, u.view(g * step.width, -1).index_select(0, step.real_pos))
            return
        for slot, rows in step.groups:
            a_t, b_t = self.lora_a_t[slot], self.lora_b_t[slot]
            if isinstance(rows, slice):
                t = x[rows] @ a_t
                for out, ranks, cols in targets:
                    out[rows].addmm_(t[:, ranks], b_t[ranks, cols])
            else:
                t = x.index_select(0, rows) @ a_t
                for out, ranks, cols in targets:
                    out.index_add_(0, rows, t[:, ranks] @ b_t[ranks, cols])
