"""The adapters' weights on the runner side: `max_loras` slots in every targeted projection of
the model (engine/lora/layers.py), the slot each adapter occupies written by `load`, and the step's
rows of each slot set before its forward (`set_step`). The core decides which adapter has which
slot (engine/lora/registry.py); this side only moves bytes.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from engine.lora.adapter import AdapterInfo, read_weights
from engine.lora.layers import LoRABatch, LoRALinear, LoRARows, plan_step
from engine.model_config import ModelConfig
from engine.parallel.shard import TPShard

log = logging.getLogger(__name__)


def _kernels_available() -> bool:
    from engine import kernels

    return kernels.available()


class LoRASlots:
    def __init__(self, model: torch.nn.Module, num_layers: int, slots: int, max_rank: int,
                 targets: frozenset[str], dtype: torch.dtype, device: str | torch.device,
                 shard: TPShard | None = None, full: ModelConfig | None = None) -> None:
        """Wraps `model`'s projections that hold any of `targets` (its `lora_sites()`). `shard`,
        `full`: a tensor-parallel rank's part and the whole model's config; each adapter is then cut
        as the base weights are. Under tensor parallelism the wrapping comes before the all-reduce
        hooks (`TPShard.attach`), so a row-parallel projection's hook sums base and update together."""
        if not hasattr(model, "lora_sites"):
            raise ValueError(f"LoRA adapters on {type(model).__name__} are not supported")
        self.num_layers, self.slots, self.device = num_layers, slots, device
        self.shard, self.full = shard, full
        if shard is not None and not shard.trivial and full is None:
            raise ValueError("a tensor-parallel rank's LoRA slots need the whole model's config")
        self.kernel = torch.device(device).type == "cuda" and _kernels_available()  # engine/kernels/lora_sgmv.py
        self.batch = LoRABatch()
        self.layers: dict[tuple[int, str], LoRALinear] = {}  # (layer, attribute) -> its wrapper
        for layer, parent, attr, parts, sizes in model.lora_sites():
            if not targets & set(parts):
                continue
            wrapped = LoRALinear(getattr(parent, attr), parts, sizes, slots, max_rank, self.batch, dtype, device)
            setattr(parent, attr, wrapped)
            self.layers[(layer, attr)] = wrapped
        self._sites = {(layer, part): lin for (layer, _), lin in self.layers.items() for part in lin.parts}
        log.info("LoRA: %d projections take adapters (%s), %d slots of rank <= %d", len(self.layers),
                 ", ".join(sorted(targets)), slots, max_rank)

    def load(self, slot: int, info: AdapterInfo) -> None:
        """Writes `info`'s weights into `slot` of every wrapped projection (zero where it has none);
        ValueError, with the slot left as it was, for weights this model cannot take."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"LoRA slot {slot} out of range (max_loras {self.slots})")
        weights = read_weights(info, self.num_layers)
        per_layer: dict[LoRALinear, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, part), ab in weights.items():
            lin = self._sites.get((layer, part))
            if lin is None:
                raise ValueError(f"LoRA adapter {info.name!r}: layer {layer} {part} takes no adapter in this model "
                                 "(an MoE layer's experts, or outside --lora-target-modules)")
            if self.shard is not None and not self.shard.trivial:
                ab = self.shard.lora_part(self.full, layer, part, *ab)
            per_layer.setdefault(lin, {})[part] = ab
        for lin in self.layers.values():
            lin.set_slot(slot, per_layer.get(lin, {}), info.scaling)

    def set_step(self, groups: Sequence[tuple[int, LoRARows]]) -> None:
        """The rows of each slot in the next forward (runner thread, just before it)."""
        self.batch.step = plan_step(groups, self.device, self.kernel)

    def check_integrity(self) -> None:
        for slot, rows in self.batch.step.groups:
            if not 0 <= slot < self.slots or (not isinstance(rows, slice) and rows.dim() != 1):
                raise AssertionError(f"LoRA step group for slot {slot} with rows {rows}")
