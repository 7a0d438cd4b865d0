"""LoRA adapters: PEFT's files and their identity (`adapter`), which adapter has which slot
(`registry`, core side), and the slots' weights in the model's projections (`slots`, `layers`,
runner side)."""
from engine.lora.adapter import LoRARequest

__all__ = ["LoRARequest"]
