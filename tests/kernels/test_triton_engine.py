"""The whole engine on TritonPagedAttention (the CUDA backend) gives the torch backend's greedy
tokens: on a GPU natively, here under the Triton interpreter. A 64-token step budget makes the
longer prompts run as chunks after cached context, beside other requests' decodes."""
from __future__ import annotations

import pytest

from checkpoints import random_prompt


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral_swa"])  # mistral_swa: the kernels' window
def test_engine_on_triton_backend_gives_the_torch_backends_tokens(device, ckpt_dir, kind, monkeypatch):
    from engine import LLM, SamplingParams
    from engine.core import build
    from engine.runner.attention import TorchPagedAttention
    from engine.runner.attention_triton import TritonPagedAttention

    prompts = [random_prompt(n, seed) for seed, n in enumerate((5, 40, 70, 130))]
    prompts.append(prompts[3][:100] + random_prompt(20, 9))  # shares 6 full blocks with the 130-token one
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def tokens(backend) -> list[list[int]]:
        monkeypatch.setattr(build, "attention_backend", lambda _device: backend())
        llm = LLM(str(ckpt_dir(kind)), dtype="float32", device=device.type, kv_cache_memory_gib=0.05,
                  max_num_batched_tokens=64)
        try:
            assert isinstance(llm.engine.runner.model.layers[0].self_attn.backend, backend)
            return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                 use_tqdm=False)]
        finally:
            llm.close()

    assert tokens(TritonPagedAttention) == tokens(TorchPagedAttention)
