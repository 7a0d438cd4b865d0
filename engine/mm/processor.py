"""Images and text into token ids and `MMInputs` (the API side), through the checkpoint's own
transformers processor: its resizing, normalisation and placeholder expansion are the model's.

An item is one run of placeholder tokens with the pixel values the processor made for it (an
image, or a crop of one); its digest is over those pixel values (and patch grid), so the same
picture under other preprocessing settings is another item.

Gemma 4 (`ImageLayout.PATCHES`): transformers' `Gemma4Processor` cannot be built without a video
processor, which needs torchvision; images alone need neither. So the checkpoint's image
processor runs here and the placeholder expansion is done as `Gemma4Processor.replace_image_token`
does it (boi, one image token per soft token, eoi, in place of each image token of the text;
tests/engine/test_multimodal_gemma4.py checks it against that method).
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.mm.inputs import DIGEST_BYTES, MMInputs, items_from_spans
from engine.mm.spec import ImageLayout, ImageSpec


def pixel_digest(pixels: torch.Tensor, grid: tuple[int, int] | None = None) -> bytes:
    """A digest of one item's pixel values (shape, dtype and patch grid included)."""
    t = pixels.detach().cpu().contiguous()
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(repr((tuple(t.shape), str(t.dtype)) + ((grid,) if grid is not None else ())).encode())
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

    def __init__(self, model_dir: Path, spec: ImageSpec) -> None:
        from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

        self.spec = spec
        if spec.layout is ImageLayout.FIXED:
            self._proc = AutoProcessor.from_pretrained(model_dir)
            if getattr(self._proc, "image_processor", None) is None:
                raise ValueError(f"{model_dir} has no image processor (processor_config.json or "
                                 "preprocessor_config.json): a model that takes images needs one")
            self.tokenizer = self._proc.tokenizer
            self.marker: str = self._proc.image_token  # what a prompt's text puts where an image goes
        else:
            self._images = AutoImageProcessor.from_pretrained(model_dir)
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            tok = self.tokenizer
            for attr in ("image_token", "boi_token", "eoi_token"):
                if not getattr(tok, attr, None):
                    raise ValueError(f"{model_dir}'s tokenizer names no {attr}: a model that takes images needs it")
            if tok.image_token_id != spec.image_token_id:
                raise ValueError(f"{model_dir}'s tokenizer has image token id {tok.image_token_id}, its config "
                                 f"{spec.image_token_id}")
            self.marker = tok.image_token

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
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)), None
        if self.spec.layout is ImageLayout.FIXED:
            out = self._proc(text=text, images=images, return_tensors="pt", add_special_tokens=add_special_tokens)
            ids, pixels = out["input_ids"][0].tolist(), out["pixel_values"]
            rows = [pixels[i:i + 1] for i in range(pixels.shape[0])]
            grids: list[tuple[int, int] | None] = [None] * len(rows)
        else:
            ids, rows, grids = self._patches(text, images, add_special_tokens)
        runs = placeholder_runs(ids, self.spec.image_token_id)
        want = [self.spec.tokens_for(g) for g in grids]
        if [n for _, n in runs] != want:
            raise ValueError(f"the processor made {len(runs)} placeholder run(s) of lengths {[n for _, n in runs]} "
                             f"for {len(rows)} image(s) of {want} tokens")
        return ids, items_from_spans(runs, [pixel_digest(r, g) for r, g in zip(rows, grids)], rows, grids)

    def _patches(self, text: str, images: list[Any], add_special_tokens: bool
                 ) -> tuple[list[int], list[torch.Tensor], list[tuple[int, int] | None]]:
        """Gemma 4: each image's patch rows and grid (the checkpoint's image processor), and the
        text with each marker expanded to boi + one image token per soft token + eoi."""
        out = self._images(images=images, return_tensors="pt")
        pixels, positions = out["pixel_values"], out["image_position_ids"]
        rows, grids = [], []
        for i in range(pixels.shape[0]):
            real = positions[i][(positions[i] >= 0).all(dim=-1)]  # (x, y) of each real patch
            grid = (int(real[:, 1].max()) + 1, int(real[:, 0].max()) + 1)
            if grid[0] * grid[1] != real.shape[0] or \
                    self.spec.tokens_for(grid) != int(out["num_soft_tokens_per_image"][i]):
                raise ValueError(f"the image processor's patches for image {i} are not a {grid} grid of "
                                 f"{out['num_soft_tokens_per_image'][i]} soft tokens")
            rows.append(pixels[i:i + 1])
            grids.append(grid)
        tok = self.tokenizer
        pieces = text.split(self.marker)
        expanded = pieces[0] + "".join(
            f"{tok.boi_token}{tok.image_token * self.spec.tokens_for(g)}{tok.eoi_token}{piece}"
            for g, piece in zip(grids, pieces[1:]))
        return list(tok.encode(expanded, add_special_tokens=add_special_tokens)), rows, grids


def _as_image(im: Any) -> Any:
    from PIL import Image

    if isinstance(im, Image.Image):
        return im
    if isinstance(im, np.ndarray) and im.dtype == np.uint8 and im.ndim == 3 and im.shape[2] in (1, 3, 4):
        return Image.fromarray(im if im.shape[2] != 1 else im[:, :, 0])
    raise ValueError(f"an image must be a PIL image or an HxWxC uint8 array; got {type(im).__name__}")
