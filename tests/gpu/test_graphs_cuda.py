"""CUDA graphs (issue 42) on a real GPU: greedy tokens identical with graphs on and off for every
model kind, graphs replayed, padded rows confined to the pad block; decode-only steps from full
graphs, mixed steps from piecewise ones. Marked `gpu` (scripts/gpu-check.sh); the same bookkeeping
runs on CPU in tests/engine/test_graphs.py and tests/engine/test_piecewise.py."""
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


PIECE_SIZES = (1, 2, 4, 8, 16, 32, 64)  # with a 64-token step budget, every prompt chunk fits one


def _run(model: str, mode: str, level: int = 0, filled: list | None = None, pieces: list | None = None, **kw):
    """Greedy tokens, graph stats and the pad block's sum; `filled` gets the async steps whose inputs
    took the last step's ids on the device, `pieces` the piecewise graphs' stats."""
    from engine import LLM, SamplingParams

    llm = LLM(model, dtype="float32", device="cuda", kv_cache_memory_gib=0.25, max_num_seqs=8, max_model_len=1024,
              optimization_level=level, cudagraph_mode=mode,
              cudagraph_capture_sizes=None if mode == "none" else PIECE_SIZES if pieces is not None else (1, 2, 4, 8),
              **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        runner = llm.engine.runner
        stats = runner.graphs.stats() if runner.graphs is not None else None
        pad = runner.kv_cache[:, :, runner.graphs.pad_block].abs().sum().item() if runner.graphs is not None else None
        llm.engine.check_integrity()
        if filled is not None:
            filled.append(llm.engine.device_filled_steps)
        if pieces is not None:
            pieces.append(runner.pieces.stats() if runner.pieces is not None else None)
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


@pytest.mark.parametrize("feature", ["async", "ngram", "draft", "eagle3"])
def test_graphs_compose_with_async_and_speculation(feature, llama_ckpt, tmp_path):
    """Async scheduling with the sampled ids kept on the device, and verify and proposal steps in
    graphs: the plain engine's greedy tokens."""
    from checkpoints import build_eagle3_draft

    want, _, _ = _run(str(llama_ckpt), "none")
    kw: dict = {}
    if feature == "async":
        kw["async_scheduling"] = True
    elif feature == "ngram":
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    elif feature == "draft":
        kw["speculative_config"] = {"method": "draft_model", "model": str(llama_ckpt), "num_speculative_tokens": 3}
    else:
        kw["speculative_config"] = {"method": "eagle3", "model": str(build_eagle3_draft(llama_ckpt, tmp_path / "e3")),
                                    "num_speculative_tokens": 3}
    filled: list[int] = []
    got, stats, _ = _run(str(llama_ckpt), "full_decode_only", filled=filled, **kw)
    assert got == want and sum(stats.replays.values()) > 5, stats
    if feature == "async":
        assert filled[0] > 5, filled


@pytest.mark.parametrize("kind", KINDS)
def test_piecewise_graphs_give_the_same_greedy_tokens(kind, ckpt_dir):
    """Prompt chunks beside decodes, up to 64 tokens a step: replayed as graphs between eager attention calls."""
    want, _, _ = _run(str(ckpt_dir(kind)), "none", max_num_batched_tokens=64)
    pieces: list = []
    got, _, _ = _run(str(ckpt_dir(kind)), "full_and_piecewise", pieces=pieces, max_num_batched_tokens=64)
    assert got == want
    if kind.endswith("_moe"):
        assert pieces == [None]
    else:
        assert sum(n for size, n in pieces[0].replays.items() if size > 1) >= 5, pieces


@pytest.mark.parametrize("feature", ["compiled", "async", "eagle3"])
def test_piecewise_graphs_compose(feature, llama_ckpt, tmp_path):
    """-O2 (its default on CUDA is full_and_piecewise), async scheduling, EAGLE-3's features out of the pieces."""
    from checkpoints import build_eagle3_draft

    want, _, _ = _run(str(llama_ckpt), "none", max_num_batched_tokens=64)
    kw: dict = dict(max_num_batched_tokens=64)
    if feature == "async":
        kw["async_scheduling"] = True
    elif feature == "eagle3":
        kw["speculative_config"] = {"method": "eagle3", "model": str(build_eagle3_draft(llama_ckpt, tmp_path / "e3")),
                                    "num_speculative_tokens": 3}
    pieces: list = []
    got, _, _ = _run(str(llama_ckpt), "full_and_piecewise", level=2 if feature == "compiled" else 0, pieces=pieces, **kw)
    assert got == want and sum(pieces[0].replays.values()) >= 5, pieces
