"""Loading a multimodal checkpoint: the language model's tensors go to its own loader, each
vision module's into that module (engine/models/gemma3_mm.py, gemma4_mm.py)."""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

_LANGUAGE = ("model.language_model.", "language_model.model.")
_HEAD = ("lm_head.weight", "language_model.lm_head.weight")


def _strip(name: str, prefixes: tuple[str, ...]) -> str | None:
    return next((name[len(p):] for p in prefixes if name.startswith(p)), None)


def load_multimodal(weights: Iterable[tuple[str, torch.Tensor]],
                    load_language: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
                    parts: dict[str, tuple[nn.Module, tuple[str, ...]]], *,
                    skip: tuple[str, ...] = (), optional: Callable[[str], bool] = lambda n: False) -> int:
    """Routes `weights`: the language model's (under `model.` names, the output matrix as
    `lm_head.weight`) to `load_language`; those under a part's prefixes into that module's state;
    those under `skip` nowhere (returns how many). ValueError for a tensor that fits none, and for
    a part's tensor the checkpoint lacks (unless `optional(name)`)."""
    states = {part: module.state_dict(keep_vars=True) for part, (module, _) in parts.items()}
    seen: set[tuple[str, str]] = set()
    skipped = 0

    def language() -> Iterable[tuple[str, torch.Tensor]]:
        nonlocal skipped
        for name, tensor in weights:
            if (rest := _strip(name, _LANGUAGE)) is not None:
                yield "model." + rest, tensor
                continue
            if name in _HEAD:
                yield "lm_head.weight", tensor
                continue
            if name.startswith(skip):
                skipped += 1
                continue
            for part, (_, prefixes) in parts.items():
                if (rest := _strip(name, prefixes)) is not None:
                    break
            else:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            dst = states[part].get(rest)
            if dst is None or dst.shape != tensor.shape:
                raise ValueError(f"unexpected weight {name!r} (shape {tuple(tensor.shape)}) in checkpoint")
            dst.data.copy_(tensor)
            seen.add((part, rest))

    load_language(language())
    missing = [f"{part}.{n}" for part, sd in states.items() for n in sd if (part, n) not in seen and not optional(n)]
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
    return skipped
