"""CUDA graphs for decode (issue 42) on a real GPU: greedy tokens identical with graphs on and off
for every model kind, graphs replayed, padded rows confined to the pad block. Marked `gpu`
(scripts/gpu-check.sh); the same bookkeeping runs on CPU in tests/engine/test_graphs.py."""
from __future__ import annotations

import pytest
import torch

from checkpoints import KINDS, random_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = [random_prompt(n, seed) for seed, n in enumerate((5, 17, 40, 130, 9, 300, 64))]


@pytest.fixture(autouse=True)
def _exact_fp32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _run(model: str, mode: str, level: int = 0):
    from engine import LLM, SamplingParams

    llm = LLM(model, dtype="float32", device="cuda", kv_cache_memory_gib=0.25, max_num_seqs=8, max_model_len=1024,
              optimization_level=level, cudagraph_mode=mode,
              cudagraph_capture_sizes=(1, 2, 4, 8) if mode != "none" else None)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        runner = llm.engine.runner
        stats = runner.graphs.stats() if runner.graphs is not None else None
        pad = runner.kv_cache[:, :, runner.graphs.pad_block].abs().sum().item() if runner.graphs is not None else None
        llm.engine.check_integrity()
        return [o.outputs[0].token_ids for o in outs], stats, pad
    finally:
        llm.close()


@pytest.mark.parametrize("kind", KINDS)
def test_graphs_on_and_off_give_the_same_greedy_tokens(kind, ckpt_dir):
    want, _, _ = _run(str(ckpt_dir(kind)), "none")
    got, stats, pad = _run(str(ckpt_dir(kind)), "full_decode_only")
    assert got == want
    if kind.endswith("_moe"):  # MoE routing syncs with the host: those run eagerly, and the log says so
        assert stats is None
    else:
        assert sum(stats.replays.values()) > 10 and pad > 0, stats


def test_compiled_model_in_graphs_gives_the_eager_tokens(llama_ckpt):
    want, _, _ = _run(str(llama_ckpt), "none")
    got, stats, _ = _run(str(llama_ckpt), "full_decode_only", level=1)
    assert got == want and sum(stats.replays.values()) > 10, stats
