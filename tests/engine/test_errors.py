"""Bad input raises ValueError naming the problem, and leaves the engine working."""

from __future__ import annotations

import gc
import json
import shutil

import pytest

from checkpoints import MIN_REL_MARGIN, hf_greedy, random_prompt, relative_margin

KIND = "qwen3"
MAX_MODEL_LEN = 256
GOOD = random_prompt(30, 6000)
GOOD2 = random_prompt(100, 6001)


def SP(**kw):
    from engine import SamplingParams

    return SamplingParams(**kw)


def _ids(p):
    return {"prompt_token_ids": p}


@pytest.fixture(scope="module")
def llm(ckpt_dir):
    from engine import LLM

    engine = LLM(model=str(ckpt_dir(KIND)), dtype="float32", block_size=16, seed=0, num_gpu_blocks=256,
                 max_model_len=MAX_MODEL_LEN)
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def expected(hf_model):
    model = hf_model(KIND)
    result = {}
    for p in (GOOD, GOOD2):
        toks, steps = hf_greedy(model, p, 8, return_scores=True)
        assert min(relative_margin(s) for s in steps) > MIN_REL_MARGIN, "oracle near-tie: pick other seeds"
        result[tuple(p)] = toks
    return result


def _assert_still_works(llm, expected):
    outs = llm.generate([_ids(GOOD), _ids(GOOD2)], SP(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs) == 2, "requests of a failed call leaked into the next one"
    assert list(outs[0].outputs[0].token_ids) == expected[tuple(GOOD)]
    assert list(outs[1].outputs[0].token_ids) == expected[tuple(GOOD2)]
    stats = llm.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0


BAD_PROMPTS = {
    "empty_text": ("", r"(?i)empty"),
    "empty_ids": (_ids([]), r"(?i)empty"),
    "too_long": (_ids(random_prompt(MAX_MODEL_LEN + 1, 6002)), r"(?i)max_model_len|maximum model length"),
    "much_too_long": (_ids(random_prompt(3000, 6003)), r"(?i)max_model_len|maximum model length"),
    # not in the acceptance list, but an id >= vocab_size must not reach the embedding
    "token_id_out_of_vocab": (_ids([10, 11, 512, 12]), r"(?i)vocab|out of range|token id"),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompt_raises_and_engine_still_works(llm, expected, case):
    prompt, match = BAD_PROMPTS[case]
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SP(temperature=0.0, max_tokens=4), use_tqdm=False)
    # a bad prompt inside a batch of good ones: the whole call fails, nothing is left queued
    with pytest.raises(ValueError, match=match):
        llm.generate([_ids(GOOD), prompt, _ids(GOOD2)], SP(temperature=0.0, max_tokens=4), use_tqdm=False)
    _assert_still_works(llm, expected)


BAD_PARAMS = {
    "temperature<0": (dict(temperature=-0.5), "temperature"),
    "top_p=0": (dict(top_p=0.0), "top_p"),
    "top_p=1.5": (dict(top_p=1.5), "top_p"),
    "top_p<0": (dict(top_p=-0.1), "top_p"),
    "min_p=1.5": (dict(min_p=1.5), "min_p"),
    "max_tokens=0": (dict(max_tokens=0), "max_tokens"),
    "repetition_penalty=0": (dict(repetition_penalty=0.0), "repetition_penalty"),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_bad_sampling_params_raise(case):
    kwargs, match = BAD_PARAMS[case]
    with pytest.raises(ValueError, match=match):
        SP(**kwargs)


def test_prompt_near_max_model_len_stops_at_it(llm, hf_model):
    """250 prompt tokens + max_tokens 16 > max_model_len 256: either rejected up front naming
    max_model_len, or generation stops at max_model_len with finish_reason 'length'."""
    prompt = random_prompt(MAX_MODEL_LEN - 6, 6004)
    try:
        (out,) = llm.generate([_ids(prompt)], SP(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    except ValueError as e:
        assert "max_model_len" in str(e) or "maximum model length" in str(e)
        return
    toks = list(out.outputs[0].token_ids)
    assert 1 <= len(toks) <= 6 and len(prompt) + len(toks) <= MAX_MODEL_LEN
    assert out.outputs[0].finish_reason == "length"
    assert toks == hf_greedy(hf_model(KIND), prompt, len(toks))


def test_unknown_architecture_is_rejected(ckpt_dir, tmp_path):
    from engine import LLM

    bad = tmp_path / "gpt2ish"
    shutil.copytree(ckpt_dir(KIND), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"(?i)architecture") as exc:
        LLM(model=str(bad), dtype="float32", num_gpu_blocks=64)
    msg = str(exc.value)
    assert "GPT2LMHeadModel" in msg, "the message names the unsupported architecture"
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in msg, f"the message lists the supported architectures ({supported} missing)"


def test_engine_works_after_all_errors(llm, expected):
    for prompt, match in BAD_PROMPTS.values():
        with pytest.raises(ValueError, match=match):
            llm.generate([_ids(GOOD), prompt], SP(temperature=0.0, max_tokens=4), use_tqdm=False)
    _assert_still_works(llm, expected)
