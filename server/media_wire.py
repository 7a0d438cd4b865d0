"""A prompt's images between the API process and the engine core: `MMInputs` to the channel's
`MediaItem`s and back. The pixel values travel as raw bytes with a dtype from a fixed list."""
from __future__ import annotations

import torch

from engine.mm.inputs import MMInputs, MMItem
from server.channel import MediaItem

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_wire(mm: MMInputs) -> list[MediaItem]:
    out = []
    for it in mm.items:
        t = it.pixels.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"image pixel values of dtype {name} cannot be sent to the engine")
        out.append(MediaItem(it.offset, it.length, it.digest, list(t.shape), name, t.view(torch.uint8).numpy().tobytes(),
                             list(it.grid) if it.grid is not None else None))
    return out


def from_wire(items: list[MediaItem]) -> MMInputs:
    """ValueError for an item whose bytes do not match its shape and dtype."""
    out = []
    for w in items:
        dtype = _DTYPES.get(w.dtype)
        if dtype is None or any(d < 1 for d in w.shape):
            raise ValueError(f"image item with dtype {w.dtype!r} and shape {w.shape}")
        numel = 1
        for d in w.shape:
            numel *= d
        if numel * dtype.itemsize != len(w.data):
            raise ValueError(f"image item of shape {w.shape} holds {len(w.data)} bytes")
        pixels = torch.frombuffer(bytearray(w.data), dtype=torch.uint8).view(dtype).view(w.shape)
        if w.grid is not None and len(w.grid) != 2:
            raise ValueError(f"image item with patch grid {w.grid}")
        out.append(MMItem(w.offset, w.length, w.digest, pixels, tuple(w.grid) if w.grid is not None else None))
    return MMInputs(tuple(out))
