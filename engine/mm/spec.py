"""What a model's images look like to the engine: how many placeholder tokens an item has, what
its pixel values must be, and how its placeholders attend. Built from the checkpoint's config
(`ModelConfig.image_spec`), read on the API side (the processor), the core side (request checks)
and the runner (attention spans), so each reads one description, not the config's fields.

Two layouts:
- FIXED (Gemma 3, SigLIP): every image is resized to one square; `tokens_per_image` placeholders,
  pixels `[1, C, H, W]`.
- PATCHES (Gemma 4): an image keeps its aspect ratio under a patch budget; its pixels are the
  processor's patch rows `[1, max_patches, 3 * patch**2]` (padded), its `grid` the (rows, cols) of
  real patches, and it has rows * cols / pool**2 placeholders.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.mm.inputs import MMItem


class ImageLayout(enum.Enum):
    FIXED = "fixed"
    PATCHES = "patches"


class ImageAttention(enum.Enum):
    """How an image's placeholders attend to each other in the prefill."""
    CAUSAL = "causal"
    BIDIRECTIONAL = "bidirectional"  # both ways in every layer (Gemma 3)
    BIDIRECTIONAL_SLIDING = "bidirectional-sliding"  # both ways in sliding-window layers only (Gemma 4)


@dataclass(frozen=True)
class ImageSpec:
    image_token_id: int
    layout: ImageLayout
    attention: ImageAttention
    tokens_per_image: int = 0  # FIXED
    pixel_shape: tuple[int, ...] = ()  # FIXED: [1, C, H, W]
    patch_dim: int = 0  # PATCHES: values per patch row
    pool: int = 1  # PATCHES: patches pooled per side into one token

    def __post_init__(self) -> None:
        if self.layout is ImageLayout.FIXED and (self.tokens_per_image < 1 or len(self.pixel_shape) != 4):
            raise ValueError(f"a fixed image layout needs tokens_per_image >= 1 and a 4-d pixel shape; got "
                             f"{self.tokens_per_image}, {self.pixel_shape}")
        if self.layout is ImageLayout.PATCHES and (self.patch_dim < 1 or self.pool < 1):
            raise ValueError(f"a patch image layout needs patch_dim and pool >= 1; got {self.patch_dim}, {self.pool}")

    def tokens_for(self, grid: tuple[int, int] | None) -> int:
        """Placeholder tokens of an item with this patch `grid` (FIXED: None)."""
        if self.layout is ImageLayout.FIXED:
            return self.tokens_per_image
        rows, cols = grid
        return rows * cols // (self.pool * self.pool)

    def check(self, item: MMItem) -> None:
        """ValueError unless `item`'s pixels, grid and length are what this model's encoder takes
        (a request built elsewhere, the server's channel, must not reach the encoder malformed)."""
        shape = tuple(item.pixels.shape)
        if self.layout is ImageLayout.FIXED:
            if item.grid is not None or shape != self.pixel_shape:
                raise ValueError(f"an image item's pixels are {shape}, not {self.pixel_shape}")
        else:
            k2 = self.pool * self.pool
            if item.grid is None or len(shape) != 3 or shape[0] != 1 or shape[2] != self.patch_dim or \
                    shape[1] % k2:
                raise ValueError(f"an image item's pixels are {shape} with grid {item.grid}; expected "
                                 f"[1, patches (a multiple of {k2}), {self.patch_dim}] with a grid")
            rows, cols = item.grid
            if rows < 1 or cols < 1 or rows % self.pool or cols % self.pool or rows * cols > shape[1]:
                raise ValueError(f"an image item's patch grid {item.grid} does not fit its {shape[1]} patch rows "
                                 f"in multiples of {self.pool}")
        if item.length != self.tokens_for(item.grid):
            raise ValueError(f"an image item at {item.offset} has {item.length} placeholder tokens; its pixels "
                             f"make {self.tokens_for(item.grid)}")

    def identity(self) -> dict[str, Any]:
        """What the KV namespace must differ on (ModelConfig.fingerprint)."""
        if self.layout is ImageLayout.FIXED:
            return {"mm_tokens_per_image": self.tokens_per_image}
        return {"image_layout": self.layout.value, "image_attention": self.attention.value}


def image_spec(mm_config: Any) -> ImageSpec:
    """The spec of a multimodal checkpoint's config (transformers' Gemma3Config / Gemma4Config);
    ValueError for a vision tower this engine does not run."""
    vc = mm_config.vision_config
    kind = vc.model_type
    if kind == "siglip_vision_model":
        return ImageSpec(int(mm_config.image_token_id), ImageLayout.FIXED, ImageAttention.BIDIRECTIONAL,
                         tokens_per_image=int(mm_config.mm_tokens_per_image),
                         pixel_shape=(1, vc.num_channels, vc.image_size, vc.image_size))
    if kind == "gemma4_vision":
        bidir = mm_config.get_text_config().use_bidirectional_attention
        if bidir not in (None, "vision"):
            raise ValueError(f"Gemma 4 with use_bidirectional_attention={bidir!r} is not supported (None or "
                             "'vision' are)")
        return ImageSpec(int(mm_config.image_token_id), ImageLayout.PATCHES,
                         ImageAttention.BIDIRECTIONAL_SLIDING if bidir == "vision" else ImageAttention.CAUSAL,
                         patch_dim=3 * vc.patch_size ** 2, pool=int(vc.pooling_kernel_size))
    raise ValueError(f"vision tower {kind!r} is not supported (siglip_vision_model, gemma4_vision are)")
