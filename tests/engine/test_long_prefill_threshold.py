"""`long_prefill_token_threshold` (vLLM's flag): no request computes more than that many prompt
tokens in a step, so a short prompt queued behind a long one starts in the long one's first step
instead of after its whole prefill. Oracle: transformers' greedy tokens, the same with and without
the cap."""
from __future__ import annotations

import argparse

import pytest

from checkpoints import hf_greedy, random_prompt

KIND = "llama"
LONG, SHORT = random_prompt(300, 4100), random_prompt(10, 4101)
MAX_TOKENS = 6


def _run(ckpt_dir, threshold: int):
    """Tokens of [LONG, SHORT] and each step's {request: tokens scheduled}."""
    from engine import LLM, SamplingParams

    llm = LLM(str(ckpt_dir(KIND)), dtype="float32", num_gpu_blocks=256, max_num_batched_tokens=64,
              long_prefill_token_threshold=threshold, seed=0)
    steps: list[dict[str, int]] = []
    sched = llm.engine.scheduler
    schedule = sched.schedule

    def spy():
        out = schedule()
        steps.append({s.req.request_id: s.num_new_tokens for s in out.scheduled})
        return out

    sched.schedule = spy
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in (LONG, SHORT)],
                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], steps, [o.request_id for o in outs]
    finally:
        llm.close()


def test_long_prompt_leaves_room_for_a_short_one_and_tokens_are_unchanged(ckpt_dir, hf_model):
    model = hf_model(KIND)
    want = [hf_greedy(model, p, MAX_TOKENS) for p in (LONG, SHORT)]
    capped, steps, (long_id, short_id) = _run(ckpt_dir, 16)
    plain, plain_steps, (plong, pshort) = _run(ckpt_dir, 0)
    assert capped == plain == want
    # Capped: every step gives the long prompt at most 16 tokens, and the short one starts at once.
    assert all(s.get(long_id, 0) <= 16 for s in steps)
    assert steps[0] == {long_id: 16, short_id: 10}
    # Uncapped: the long prompt takes the whole 64-token budget until 300 tokens are done.
    first_short = next(i for i, s in enumerate(plain_steps) if pshort in s)
    assert first_short == 4 and plain_steps[0] == {plong: 64}


def test_bad_values_are_refused():
    from engine.config import EngineConfig
    from server.args import add_engine_args

    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        EngineConfig(model="m", long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="needs enable_chunked_prefill"):
        EngineConfig(model="m", long_prefill_token_threshold=8, enable_chunked_prefill=False)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--long-prefill-token-threshold", "128"]).long_prefill_token_threshold == 128
