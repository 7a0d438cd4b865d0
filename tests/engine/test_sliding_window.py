"""Issue 16: sliding-window attention (Mistral's `sliding_window`, Qwen's `layer_types`).
Oracle: transformers' greedy tokens (float32) for prompts below, at and well past the window,
with prompts chunked across the window boundary, with prefix caching off and on (second pass from
cached blocks), on every layer (mistral_swa) and on some layers only (qwen3_swa, gemma3).
test_parity.py runs mistral_swa and gemma3 eagerly and compiled to 1030 tokens."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoints import SLIDING_WINDOW, build_checkpoint, hf_greedy, load_hf, random_prompt

LENGTHS = (5, SLIDING_WINDOW - 1, SLIDING_WINDOW, SLIDING_WINDOW + 1, 3 * SLIDING_WINDOW + 7)


@pytest.fixture(scope="module")
def qwen3_swa(tmp_path_factory):
    return build_checkpoint("qwen3_swa", tmp_path_factory.mktemp("qwen3_swa"))


@pytest.mark.parametrize("kind", ["mistral_swa", "qwen3_swa", "gemma3"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_chunked_sliding_window_prefill_and_decode_equal_transformers(kind, prefix_caching, ckpt_dir, qwen3_swa):
    from engine import LLM, SamplingParams

    path = qwen3_swa if kind == "qwen3_swa" else ckpt_dir(kind)
    windows = LLM(str(path), dtype="float32", num_gpu_blocks=128, max_num_batched_tokens=37,
                  enable_prefix_caching=prefix_caching)
    assert set(windows.engine.model_config.sliding_windows) == ({SLIDING_WINDOW} if kind == "mistral_swa"
                                                                 else {0, SLIDING_WINDOW})
    prompts = [random_prompt(n, 300 + n) for n in LENGTHS]
    hf = load_hf(path)
    want = [list(hf_greedy(hf, p, 2 * SLIDING_WINDOW)) for p in prompts]  # decodes run past the window too
    sp = SamplingParams(temperature=0.0, max_tokens=2 * SLIDING_WINDOW, ignore_eos=True)
    for _ in range(2 if prefix_caching else 1):  # the second pass starts from cached blocks
        outs = windows.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    if prefix_caching:
        assert outs[-1].num_cached_tokens > SLIDING_WINDOW


def test_unknown_layer_types_are_refused(tmp_path):
    from engine import LLM

    path = build_checkpoint("qwen3_swa", tmp_path / "ck")
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = ["full_attention", "chunked_attention"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="chunked_attention"):
        LLM(str(path), dtype="float32", num_gpu_blocks=16)


@pytest.mark.parametrize("key, value", [("hidden_activation", "silu"), ("attn_logit_softcapping", 50.0),
                                        ("use_bidirectional_attention", True)])
def test_gemma3_settings_it_does_not_compute_are_refused(ckpt_dir, tmp_path, key, value):
    import shutil

    from engine import LLM

    path = Path(shutil.copytree(ckpt_dir("gemma3"), tmp_path / "g"))
    cfg = json.loads((path / "config.json").read_text())
    cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=key):
        LLM(str(path), dtype="float32", num_gpu_blocks=16)
