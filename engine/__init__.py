"""kvtier's engine: `from engine import LLM, SamplingParams`."""
from engine.llm import LLM
from engine.lora.adapter import LoRARequest
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams
from engine.core.stats import EngineStats

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineStats"]
