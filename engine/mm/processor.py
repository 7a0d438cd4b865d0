"""Images and text into token ids and `MMInputs` (the API side), through the checkpoint's own
transformers processor: its resizing, normalisation and placeholder expansion are the model's.

An item is one run of placeholder tokens with the pixel values the processor made for it (an
image, or a crop of one); its digest is over those pixel values, so the same picture under other
preprocessing settings is another item.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.mm.inputs import DIGEST_BYTES, MMInputs, items_from_spans


def pixel_digest(pixels: torch.Tensor) -> bytes:
    """A digest of one item's pixel values (shape and dtype included)."""
    t = pixels.detach().cpu().contiguous()
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(repr((tuple(t.shape), str(t.dtype))).encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes())
    return h.digest()


def placeholder_runs(token_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of `image_token_id` in `token_ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(token_ids):
        if t != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class ImageProcessor:
    """The checkpoint's processor, for prompts with images."""

    def __init__(self, model_dir: Path, image_token_id: int, tokens_per_image: int) -> None:
        from transformers import AutoProcessor

        self._proc = AutoProcessor.from_pretrained(model_dir)
        if getattr(self._proc, "image_processor", None) is None:
            raise ValueError(f"{model_dir} has no image processor (processor_config.json or "
                             "preprocessor_config.json): a model that takes images needs one")
        self.image_token_id, self.tokens_per_image = image_token_id, tokens_per_image
        self.marker: str = self._proc.image_token  # what a prompt's text puts where an image goes

    def process(self, text: str, images: Sequence[Any], add_special_tokens: bool = True
                ) -> tuple[list[int], MMInputs | None]:
        """Token ids (placeholders expanded) and items of `text` with `images` (PIL images or
        HWC uint8 arrays), one per marker in the text; ValueError naming what does not match.
        `add_special_tokens` False for text a chat template rendered (it has them already)."""
        images = [_as_image(im) for im in images]
        count = text.count(self.marker)
        if count != len(images):
            raise ValueError(f"the prompt has {count} image marker(s) ({self.marker!r}) but {len(images)} image(s) "
                             "were given")
        if not images:
            return list(self._proc.tokenizer.encode(text, add_special_tokens=add_special_tokens)), None
        out = self._proc(text=text, images=images, return_tensors="pt", add_special_tokens=add_special_tokens)
        ids = out["input_ids"][0].tolist()
        pixels = out["pixel_values"]
        runs = placeholder_runs(ids, self.image_token_id)
        if len(runs) != pixels.shape[0] or any(n != self.tokens_per_image for _, n in runs):
            raise ValueError(f"the processor made {len(runs)} placeholder run(s) of lengths {[n for _, n in runs]} "
                             f"for {pixels.shape[0]} pixel array(s) of {self.tokens_per_image} tokens each")
        rows = [pixels[i:i + 1] for i in range(pixels.shape[0])]
        return ids, items_from_spans(runs, [pixel_digest(r) for r in rows], rows)


def _as_image(im: Any) -> Any:
    from PIL import Image

    if isinstance(im, Image.Image):
        return im
    if isinstance(im, np.ndarray) and im.dtype == np.uint8 and im.ndim == 3 and im.shape[2] in (1, 3, 4):
        return Image.fromarray(im if im.shape[2] != 1 else im[:, :, 0])
    raise ValueError(f"an image must be a PIL image or an HxWxC uint8 array; got {type(im).__name__}")
