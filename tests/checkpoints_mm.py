"""Small random-weight multimodal checkpoints (Gemma 3 with a SigLIP tower) with a processor,
for the image tests; `tests/checkpoints.py` has the text kinds and the conventions.

``gemma3_mm``: the ``gemma3`` text kind (layer 0 sliding 48, layer 1 full) under a 2-layer SigLIP
tower of 32x32 images in 8x8 patches (16 patches), pooled to 4 tokens per image; the output matrix
is untied. The tokenizer is ``tests/checkpoints.py``'s with its last three words replaced by Gemma's image tokens
(``<start_of_image>`` 6, ``<end_of_image>`` 7, ``<image_soft_token>`` 8), so a prompt's marker is
``<start_of_image>`` and each image becomes ``\\n\\n<start_of_image>`` + 4 soft tokens +
``<end_of_image>\\n\\n`` (the newlines vanish in this tokenizer).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import checkpoints as C

BOI, EOI, IMG = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# checkpoints.CHAT_TEMPLATE, with content as a list of parts too (Gemma's way): an image part
# renders as the image marker.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }} "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %} " + BOI + " {% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)
IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 32, 8, 4


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = C.SPECIAL_TOKENS + [BOI, EOI, IMG]
    vocab = {t: i for i, t in enumerate(specials + C._vocab_words()[:-3])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=C.UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=C.UNK, bos_token=C.BOS, eos_token=C.EOS, pad_token=C.PAD,
        extra_special_tokens={"boi_token": BOI, "eoi_token": EOI, "image_token": IMG},
        chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False, model_max_length=C.MAX_POS)
    assert len(fast) == C.VOCAB_SIZE, len(fast)
    return fast


def build_gemma3_mm(path: Path, *, seed: int = 0, text: dict | None = None, vision: dict | None = None,
                    tokens_per_image: int = TOKENS_PER_IMAGE, randomize: bool = True) -> Path:
    """Writes the ``gemma3_mm`` checkpoint (weights, tokenizer, processor) to ``path``. `text` and
    `vision` override config fields (benchmarks/multimodal.py builds a bigger one); `randomize`
    False keeps transformers' own initialisation (for timing only)."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, GenerationConfig,
                              SiglipVisionConfig)
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    # Untied (unlike the gemma3 text kind): tied, greedy decoding here repeats one token whatever
    # the image, and the image tests need outputs that depend on it.
    text_cfg = C._config("gemma3", len(tok), {"tie_word_embeddings": False, **(text or {})}).to_dict()
    vision_cfg = SiglipVisionConfig(**{**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH),
                                       **(vision or {})})
    cfg = Gemma3Config(text_config=text_cfg, vision_config=vision_cfg.to_dict(), mm_tokens_per_image=tokens_per_image,
                       boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                       image_token_index=tok.image_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    if randomize:
        _randomize(model, seed)
    model.generation_config = GenerationConfig(bos_token_id=C.BOS_ID, eos_token_id=C.EOS_ID, pad_token_id=C.PAD_ID)
    model.save_pretrained(path, safe_serialization=True)
    side = vision_cfg.image_size
    proc = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": side, "width": side}),
                           tokenizer=tok, image_seq_length=tokens_per_image)
    proc.save_pretrained(path)
    return path


@torch.no_grad()
def _randomize(model, seed: int, vision: list | None = None) -> None:
    """The text model as ``checkpoints._randomize`` draws it; the vision tower and projector
    (`vision`: named parameters, default Gemma 3's) at the same scale, so that an image moves the output."""
    g = torch.Generator().manual_seed(seed + 1)
    lm = model.model.language_model

    class _Text:  # what checkpoints._randomize reads: the embeddings, the output matrix, the final norm
        def __init__(self) -> None:
            self.model = lm

        def named_parameters(self):
            return lm.named_parameters()

        def named_buffers(self):
            return lm.named_buffers()

        def get_output_embeddings(self):
            return model.get_output_embeddings()

        def get_input_embeddings(self):
            return lm.get_input_embeddings()

    C._randomize(_Text(), seed)
    if vision is None:
        vision = [*model.model.vision_tower.named_parameters(), *model.model.multi_modal_projector.named_parameters()]
    for name, p in vision:
        if "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + C.INIT_STD * torch.randn(p.shape, generator=g))
        else:
            p.copy_(C.INIT_STD * torch.randn(p.shape, generator=g))


def words(n: int, seed: int) -> str:
    """`n` random words of the test vocabulary (no special tokens)."""
    vocab = C._vocab_words()[:-3]
    return " ".join(vocab[i] for i in np.random.default_rng(seed).integers(0, len(vocab), n))


def image(seed: int, size: tuple[int, int] = (40, 50)):
    """A random RGB PIL image (resized to 32x32 by the processor)."""
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


def data_url(im, fmt: str = "PNG") -> str:
    """`im` as a data: URL, as an OpenAI client sends an image."""
    import base64
    import io

    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def load_hf_mm(path: Path):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), AutoProcessor.from_pretrained(path)


@torch.no_grad()
def hf_greedy_mm(model, processor, text: str, images: list, max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `text` with `images` (EOS never stops it)."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[],
                         pad_token_id=C.PAD_ID)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


# Gemma 4: its image token is the prompt's marker (expanded to boi + soft tokens + eoi), so its
# chat template renders an image part as the image token.
GEMMA4_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(BOI, IMG)
GEMMA4_PATCH, GEMMA4_POOL, GEMMA4_MAX_SOFT = 4, 2, 70  # up to 70 tokens an image (280 patches of 4x4)


def build_gemma4_mm(path: Path, *, seed: int = 0, text: dict | None = None, vision: dict | None = None,
                    bidirectional: str | None = "vision", randomize: bool = True) -> Path:
    """Writes the ``gemma4_mm`` checkpoint: the ``gemma4`` text kind (untied, sliding window 48,
    KV sharing, per-layer embeddings) with `use_bidirectional_attention` = `bidirectional`, under a
    2-layer Gemma 4 vision tower of 4x4 patches pooled 2x2; images keep their aspect ratio within
    70 soft tokens (a 40x50 image: 63). Weights, tokenizer (with GEMMA4_CHAT_TEMPLATE) and the
    image processor; no Gemma4Processor (it needs torchvision for its video part)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig, GenerationConfig
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.chat_template = GEMMA4_CHAT_TEMPLATE
    text_cfg = C._config("gemma4", len(tok), {"use_bidirectional_attention": bidirectional, **(text or {})}).to_dict()
    vision_cfg = Gemma4VisionConfig(**{**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                              pooling_kernel_size=GEMMA4_POOL, patch_size=GEMMA4_PATCH,
                                              position_embedding_size=64), **(vision or {})})
    cfg = Gemma4Config(text_config=text_cfg, vision_config=vision_cfg.to_dict(), audio_config=None,
                       boi_token_id=tok.boi_token_id, eoi_token_id=tok.eoi_token_id,
                       image_token_id=tok.image_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(cfg).eval()
    if randomize:
        _randomize(model, seed, vision=[*model.model.vision_tower.named_parameters(),
                                        *model.model.embed_vision.named_parameters()])
    model.generation_config = GenerationConfig(bos_token_id=C.BOS_ID, eos_token_id=C.EOS_ID, pad_token_id=C.PAD_ID)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    Gemma4ImageProcessorPil(patch_size=vision_cfg.patch_size, pooling_kernel_size=vision_cfg.pooling_kernel_size,
                            max_soft_tokens=GEMMA4_MAX_SOFT).save_pretrained(path)
    return path


def gemma4_inputs(text: str, images: list) -> dict:
    """What transformers' Gemma4Processor would give for `text` with `images` (built from its
    image processor and its `replace_image_token`, since the processor needs torchvision)."""
    from types import SimpleNamespace

    from transformers import Gemma4Processor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    tok = build_tokenizer()
    pieces = text.split(IMG)
    assert len(pieces) == len(images) + 1
    feats = {}
    if images:
        ip = Gemma4ImageProcessorPil(patch_size=GEMMA4_PATCH, pooling_kernel_size=GEMMA4_POOL,
                                     max_soft_tokens=GEMMA4_MAX_SOFT)
        feats = ip(images=images, return_tensors="pt")
        me = SimpleNamespace(boi_token=BOI, eoi_token=EOI, image_token=IMG)
        text = pieces[0] + "".join(Gemma4Processor.replace_image_token(me, feats, i) + p
                                   for i, p in enumerate(pieces[1:]))
    ids = torch.tensor([tok.encode(text)])
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
           "mm_token_type_ids": (ids == tok.image_token_id).long()}
    if images:
        out.update(pixel_values=feats["pixel_values"], image_position_ids=feats["image_position_ids"])
    return out


def load_hf_gemma4_mm(path: Path):
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@torch.no_grad()
def hf_greedy_gemma4_mm(model, text: str, images: list, max_new_tokens: int) -> list[int]:
    inputs = gemma4_inputs(text, images)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[],
                         pad_token_id=C.PAD_ID)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
