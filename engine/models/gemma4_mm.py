"""Gemma 4 with images (`Gemma4ForConditionalGeneration`): the Gemma 4 language model, Gemma 4's
variable-resolution vision tower (2-D RoPE over patch coordinates, average pooling of pool x pool
patches into one soft token) and its embedder (a weightless norm and one matrix).

As for Gemma 3 (engine/models/gemma3_mm.py), the tower and embedder are transformers' own modules
(stateless: running the oracle's code is exact); the language model is kvtier's. What differs:
- an image's placeholder count follows its aspect ratio (`MMItem.grid`, engine/mm/spec.py);
- its placeholders' per-layer embeddings come from the pad token (engine/models/gemma4.py);
- with `use_bidirectional_attention == "vision"` they attend both ways in sliding-window layers
  only, causally in full-attention ones (`PrefillSeq.bidir_sliding_only`); without it, causally.
The audio tower of a checkpoint that has one is not loaded: audio content is refused by name
(engine/mm/images.py), so its weights are skipped, with a log line.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from engine.mm.inputs import MMItem
from engine.model_config import ModelConfig
from engine.models.gemma4 import Gemma4ForCausalLM
from engine.models.mm_weights import load_multimodal
from engine.runner.attention import AttentionBackend

log = logging.getLogger(__name__)

_AUDIO = ("model.audio_tower.", "model.embed_audio.", "audio_tower.", "embed_audio.")


def patch_positions(grid: tuple[int, int], num_patches: int) -> torch.Tensor:
    """`[num_patches, 2]` (x, y) of a grid's patches in row-major order, then (-1, -1) padding
    (transformers' Gemma 4 image processor lays pixels out so)."""
    rows, cols = grid
    y, x = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    real = torch.stack([x.reshape(-1), y.reshape(-1)], dim=-1)
    return torch.cat([real, torch.full((num_patches - rows * cols, 2), -1, dtype=torch.long)])


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    own_prefixes = ("vision_tower.", "embed_vision.")  # loaded here, not by the language model's loader

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_len: int) -> None:
        from transformers import AutoModel
        from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

        mm = cfg.mm_config
        if mm is None or mm.vision_config is None or mm.vision_config.model_type != "gemma4_vision":
            raise ValueError("Gemma4ForConditionalGeneration needs a gemma4_vision vision_config")
        super().__init__(cfg, backend, max_len)
        self.vision_tower = AutoModel.from_config(mm.vision_config)
        self.embed_vision = Gemma4MultimodalEmbedder(mm.vision_config, mm.get_text_config())
        self.pool = int(mm.vision_config.pooling_kernel_size)
        media = [getattr(mm, f, None) for f in ("image_token_id", "video_token_id", "audio_token_id")]
        self.media_ids = [int(t) for t in media if t is not None]
        self.pad_token_id = int(cfg.hf_config.pad_token_id)
        self.register_buffer("media_token_ids", torch.tensor(self.media_ids), persistent=False)

    def language_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Media tokens embed as the pad token, in the prompt (an image's placeholders: their
        embeddings are then replaced, their per-layer embeddings stay the pad's) and when sampled
        (transformers' Gemma4Model does so wherever they appear)."""
        return torch.where(torch.isin(input_ids, self.media_token_ids), self.pad_token_id, input_ids)

    def unpacked_modules(self) -> tuple[torch.nn.Module, ...]:
        """Left as nn.Linear on CPU (engine/models/packed_linear.py): the tower reads `input_proj.weight`."""
        return (self.vision_tower,)

    def reset_rope(self, max_len: int, device: str | torch.device = "cpu") -> None:
        super().reset_rope(max_len, device)
        if hasattr(self, "vision_tower"):  # to_empty() left the tower's rotary frequencies uninitialised too
            rotary = self.vision_tower.encoder.rotary_emb
            inv_freq, _ = rotary.compute_axial_rope_parameters(rotary.config)
            rotary.inv_freq = inv_freq.to(device)
            rotary.original_inv_freq = inv_freq.clone().to(device)
        if hasattr(self, "media_ids"):
            self.register_buffer("media_token_ids", torch.tensor(self.media_ids, device=device), persistent=False)

    @torch.inference_mode()
    def encode_images(self, items: Sequence[MMItem]) -> list[torch.Tensor]:
        """Each item's `[tokens, hidden]` embeddings; the items' pixels share one shape
        `[1, max_patches, 3 * patch**2]` (EncoderCache batches by shape)."""
        device = self.embed_tokens.weight.device
        pixels = torch.cat([it.pixels for it in items]).to(device)
        positions = torch.stack([patch_positions(it.grid, it.pixels.shape[1]) for it in items]).to(device)
        hidden = self.vision_tower(pixel_values=pixels, pixel_position_ids=positions).last_hidden_state
        embs = self.embed_vision(hidden.to(self.embed_tokens.weight.dtype))  # the real tokens, images in order
        return list(torch.split(embs, [it.length for it in items]))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The language model's tensors go to Gemma 4's loader, the vision tower's and embedder's
        into those modules, an audio tower's nowhere; an unknown or missing tensor is an error."""
        audio = load_multimodal(weights, super().load_weights,
                                {"vision_tower": (self.vision_tower, ("model.vision_tower.", "vision_tower.")),
                                 "embed_vision": (self.embed_vision, ("model.embed_vision.", "embed_vision."))},
                                skip=_AUDIO)
        if audio:
            log.info("Gemma 4: skipped the audio tower's %d tensors (audio content is not supported)", audio)
