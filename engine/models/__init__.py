"""Supported Hugging Face architectures. An explicit table, so that adding one is one line."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.gemma3_mm import Gemma3ForConditionalGeneration
from engine.models.gemma4 import Gemma4ForCausalLM
from engine.models.gemma4_mm import Gemma4ForConditionalGeneration
from engine.models.llama import LlamaFamilyForCausalLM


@dataclass(frozen=True)
class ArchSpec:
    model_cls: type
    attention_bias: Callable[[Any], bool]
    qk_norm: bool
    multimodal: bool = False  # takes images: its config's text part describes the language model


def _bias_flag(hf: Any) -> bool:
    return bool(getattr(hf, "attention_bias", False))


SUPPORTED_ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(LlamaFamilyForCausalLM, _bias_flag, qk_norm=False),
    "MistralForCausalLM": ArchSpec(LlamaFamilyForCausalLM, _bias_flag, qk_norm=False),
    # Qwen2 always has q/k/v biases (and no config flag for them).
    "Qwen2ForCausalLM": ArchSpec(LlamaFamilyForCausalLM, lambda hf: True, qk_norm=False),
    "Qwen3ForCausalLM": ArchSpec(LlamaFamilyForCausalLM, _bias_flag, qk_norm=True),
    "Qwen3MoeForCausalLM": ArchSpec(LlamaFamilyForCausalLM, _bias_flag, qk_norm=True),
    "Gemma3ForCausalLM": ArchSpec(Gemma3ForCausalLM, _bias_flag, qk_norm=True),
    "Gemma4ForCausalLM": ArchSpec(Gemma4ForCausalLM, _bias_flag, qk_norm=True),
    "Gemma3ForConditionalGeneration": ArchSpec(Gemma3ForConditionalGeneration, _bias_flag, qk_norm=True,
                                               multimodal=True),
    "Gemma4ForConditionalGeneration": ArchSpec(Gemma4ForConditionalGeneration, _bias_flag, qk_norm=True,
                                               multimodal=True),
}
