"""kvtier's engine: `from engine import LLM, SamplingParams`.

The names below load on first use (PEP 562), so importing a light submodule (the CLI's allocator
check, `engine.sampling_params`) does not import torch and the whole engine: `kvtier serve` decides
whether to re-execute itself under tcmalloc before it pays for those imports."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "LLM": "engine.llm",
    "LoRARequest": "engine.lora.adapter",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "EngineStats": "engine.core.stats",
}
__all__ = list(_LAZY)

if TYPE_CHECKING:
    from engine.core.stats import EngineStats as EngineStats
    from engine.llm import LLM as LLM
    from engine.lora.adapter import LoRARequest as LoRARequest
    from engine.outputs import CompletionOutput as CompletionOutput, RequestOutput as RequestOutput
    from engine.sampling_params import SamplingParams as SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
