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


def test_triton_backend_through_the_graph_buffers_gives_its_plain_tokens(device, ckpt_dir, monkeypatch):
    """The CUDA graphs' static decode metadata (engine/runner/graphs.py) as the Triton kernels take it:
    padded rows at the pad block, tables as wide as max_model_len, rows in the plain path's order."""
    from engine import LLM, SamplingParams
    from engine.core import build
    from engine.runner.attention_triton import TritonPagedAttention

    monkeypatch.setattr(build, "attention_backend", lambda _device: TritonPagedAttention())
    prompts = [{"prompt_token_ids": random_prompt(n, seed)} for seed, n in enumerate((5, 40, 21))]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out, replays = {}, 0
    for mode in ("none", "eager_replay"):
        llm = LLM(str(ckpt_dir("llama")), dtype="float32", device=device.type, kv_cache_memory_gib=0.05,
                  max_model_len=256, optimization_level=0, cudagraph_mode=mode,
                  cudagraph_capture_sizes=(1, 4) if mode != "none" else None)
        try:
            out[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            if llm.engine.runner.graphs is not None:
                replays = sum(llm.engine.runner.graphs.stats().replays.values())
        finally:
            llm.close()
    assert out["eager_replay"] == out["none"] and replays >= 4


def test_triton_backend_with_images_gives_transformers_tokens(device, tmp_path, monkeypatch):
    """Gemma 3 with images on the Triton backend: steps whose prefills hold image placeholders
    (which attend both ways) go through the torch path, the rest through the kernels."""
    import checkpoints_mm as M
    from engine import LLM, SamplingParams
    from engine.core import build
    from engine.runner.attention_triton import TritonPagedAttention

    ckpt = M.build_gemma3_mm(tmp_path / "mm")
    model, proc = M.load_hf_mm(ckpt)
    text = f"one two three {M.BOI} four five {M.BOI} six seven eight nine ten"
    images = [M.image(1), M.image(2)]
    want = M.hf_greedy_mm(model, proc, text, images, 8)
    monkeypatch.setattr(build, "attention_backend", lambda _device: TritonPagedAttention())
    with LLM(str(ckpt), dtype="float32", device=device.type, kv_cache_memory_gib=0.05, max_num_batched_tokens=12,
             optimization_level=0) as llm:
        out = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}],
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == want
