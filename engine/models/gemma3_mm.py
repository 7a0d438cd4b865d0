"""Gemma 3 with images (`Gemma3ForConditionalGeneration`): the Gemma 3 language model, a SigLIP
vision tower and Gemma 3's projector (average-pooled patches, normed, one matrix).

The vision tower and projector are transformers' own modules: they hold no KV and see no paged
state, so running the oracle's code is both exact and the least to maintain; what kvtier adds is
around them (the encoder cache, engine/mm/encoder.py, and image spans in attention). The language
model is kvtier's (engine/models/gemma3.py): an image's embeddings replace its placeholder tokens'
embeddings (unscaled, as transformers inserts them after the text embedding's scaling), and its
placeholders attend to each other both ways in the prefill (`PrefillSeq.bidir`).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from engine.mm.inputs import MMItem
from engine.model_config import ModelConfig
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.mm_weights import load_multimodal
from engine.runner.attention import AttentionBackend

# Where checkpoints keep each part, by transformers version (4.x on the Hub, 5.x's own names).
_VISION = ("model.vision_tower.vision_model.", "model.vision_tower.", "vision_tower.vision_model.", "vision_tower.")
_PROJECTOR = ("model.multi_modal_projector.", "multi_modal_projector.")
_OWN = ("vision_tower.", "multi_modal_projector.")  # this class's modules, loaded by it


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_len: int) -> None:
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        mm = cfg.mm_config
        if mm is None or mm.vision_config.model_type != "siglip_vision_model":
            raise ValueError("Gemma3ForConditionalGeneration needs a SigLIP vision_config")
        super().__init__(cfg, backend, max_len)
        self.vision_tower = AutoModel.from_config(mm.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(mm)
        self.image_token_id = int(mm.image_token_id)
        self.tokens_per_image = int(mm.mm_tokens_per_image)

    def reset_rope(self, max_len: int, device: str | torch.device = "cpu") -> None:
        super().reset_rope(max_len, device)
        if hasattr(self, "vision_tower"):  # to_empty() left SigLIP's position ids uninitialised too
            emb = self.vision_tower.embeddings
            emb.position_ids = torch.arange(emb.num_positions, device=device).expand((1, -1))

    @torch.inference_mode()
    def encode_images(self, items: Sequence[MMItem]) -> torch.Tensor:
        """`[n, tokens_per_image, hidden]` embeddings of `n` items' `[1, C, H, W]` pixel values."""
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        pixels = torch.cat([it.pixels for it in items]).to(device=self.embed_tokens.weight.device, dtype=dtype)
        hidden = self.vision_tower(pixel_values=pixels).last_hidden_state
        return self.multi_modal_projector(hidden)

    def language_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in super().language_parameters().items() if not n.startswith(_OWN)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The language model's tensors go to Gemma 3's loader (under its names), the vision
        tower's and projector's into those modules; an unknown or missing tensor is an error."""
        load_multimodal(weights, super().load_weights,
                        {"vision_tower": (self.vision_tower, _VISION),
                         "multi_modal_projector": (self.multi_modal_projector, _PROJECTOR)},
                        optional=lambda n: n.endswith("position_ids"))
