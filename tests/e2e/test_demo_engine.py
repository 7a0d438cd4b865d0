"""The real demo model, end to end through the engine (slow: loads 135M params, converts once)."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams


@pytest.mark.slow
def test_demo_model_answers_paris_through_the_engine():
    llm = LLM(max_num_batched_tokens=512)  # no model: the embedded demo model
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert out.outputs[0].text.strip() == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"
    # The same question again is a prefix-cache hit and gives the same answer.
    again = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    llm.engine.check_integrity()
