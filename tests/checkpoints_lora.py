"""Random-weight LoRA adapters in PEFT's format for the small checkpoints of
`tests/checkpoints.py`, and the oracle: transformers + peft with the adapter merged.

An adapter's A and B are drawn at `std` (PEFT initialises B to zero, which would change nothing),
so that it moves the greedy tokens; `build_adapter` saves through PEFT's own `save_pretrained`."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

import checkpoints as C

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@torch.no_grad()
def build_adapter(base: Path, path: Path, *, rank: int = 8, targets: Sequence[str] = ALL, seed: int = 0,
                  alpha: float | None = None, std: float = 0.15, **config) -> Path:
    from peft import LoraConfig, get_peft_model

    model = C.load_hf(base)
    cfg = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=list(targets),
                     lora_dropout=0.0, init_lora_weights=False, **config)
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(1000 + seed)
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.copy_(std * torch.randn(p.shape, generator=g))
    peft_model.save_pretrained(path)
    return Path(path)


def load_merged(base: Path, adapter: Path | None):
    """The base model, with `adapter` merged into its weights (None: as it is)."""
    model = C.load_hf(base)
    if adapter is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


def hf_greedy(base: Path, adapter: Path | None, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    model = load_merged(base, adapter)
    return [C.hf_greedy(model, p, max_new_tokens) for p in prompts]
