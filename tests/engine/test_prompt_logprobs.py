"""Issue 17: vLLM's prompt_logprobs. Oracle: transformers' log-softmax over its full-prompt logits
(position i's row scores prompt token i + 1), for the token's log-prob, its rank and the top-k;
through chunked prefill, a prompt already in the prefix cache (it must be computed again, not
read) and async scheduling."""
from __future__ import annotations

import pytest
import torch

from checkpoints import load_hf, random_prompt
from engine.sampling_params import SamplingParams

TOP = 3


@pytest.fixture(scope="module")
def oracle(ckpt_dir):
    path = ckpt_dir("qwen3")
    hf = load_hf(path)
    prompts = [random_prompt(n, 300 + n) for n in (2, 37, 150)]
    want = []
    with torch.no_grad():
        for p in prompts:
            lp = torch.log_softmax(hf(input_ids=torch.tensor([p])).logits[0].float(), dim=-1)
            want.append([(lp[i], p[i + 1]) for i in range(len(p) - 1)])
    return path, prompts, want


def _check(out, want):
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(want) + 1
    for entry, (row, token) in zip(out.prompt_logprobs[1:], want):
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(TOP)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t].logprob == pytest.approx(v, abs=1e-4)
        assert set(entry) == set(top.indices.tolist()) | {token}
        assert sorted((entry[t].rank for t in top.indices.tolist())) == list(range(1, TOP + 1))


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 32}, {"async_scheduling": True}],
                         ids=["one-chunk", "chunked", "async"])
def test_prompt_logprobs_equal_transformers(oracle, kw):
    from engine import LLM

    path, prompts, want = oracle
    with LLM(str(path), dtype="float32", num_gpu_blocks=64, **kw) as llm:
        sp = SamplingParams(max_tokens=2, prompt_logprobs=TOP, temperature=0)
        plain = SamplingParams(max_tokens=2, temperature=0)
        llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)  # fill the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
    for out, w in zip(outs, want):
        _check(out, w)
        assert out.num_cached_tokens == 0  # computed, not read from the cache
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
    assert again[2].num_cached_tokens > 0 and again[2].prompt_logprobs is None


def test_prompt_logprobs_zero_gives_the_prompt_token_only(oracle):
    from engine import LLM

    path, prompts, want = oracle
    with LLM(str(path), dtype="float32", num_gpu_blocks=64) as llm:
        out = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
    assert all(set(e) == {token} for e, (_, token) in zip(out.prompt_logprobs[1:], want[1]))


@pytest.mark.parametrize("bad", [-1, 21])
def test_out_of_range_is_a_value_error(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
