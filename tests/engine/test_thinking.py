"""Issue 17, acceptance 3 (engine side): the thinking-token budget.

Oracles: a plain reference that finds thinking sections by searching the whole token string
(the tracker works incrementally); transformers' greedy `generate` with the same logit bias for
the thinking tokens and, from the prompt plus those tokens and the end marker, for the answer;
the engine itself with speculation or async scheduling off."""
from __future__ import annotations

import random

import pytest
import torch

from checkpoints import END_THINK_ID, EOS_ID, THINK_ID, build_checkpoint, load_hf
from engine.sampling_params import SamplingParams
from engine.sample.thinking import Markers, ReasoningConfig, ThinkingTracker

BIAS = {END_THINK_ID: -100.0, EOS_ID: -100.0}  # keeps the model thinking, and going


def _reference_forced(prompt: list[int], out: list[int], m: Markers, budget: int) -> int | None:
    """The token position len(out) must be, from scratch: the sections of prompt + out found by
    searching, the output tokens inside them (markers excluded) counted against the budget."""
    seq, n_prompt = prompt + out, len(prompt)
    pos, spent = 0, 0
    while True:
        s = _find(seq, m.start, pos)
        if s < 0:
            return None
        first = s + len(m.start)
        e = _find(seq, m.end, first)
        counted = [i for i in range(first, len(seq) if e < 0 else e) if i >= n_prompt]
        if e >= 0:
            spent, pos = spent + len(counted), e + len(m.end)
            continue
        n0 = max(0, budget - spent)  # the section's output token at which the budget ran out
        if len(counted) < n0:
            return None
        head = [seq[i] for i in counted[:n0]]
        begun = max(k for k in range(min(len(m.end) - 1, n0) + 1) if head[n0 - k:] == list(m.end[:k]))
        return m.end[begun + len(counted) - n0]


def _find(seq: list[int], sub: tuple[int, ...], start: int) -> int:
    for i in range(start, len(seq) - len(sub) + 1):
        if tuple(seq[i:i + len(sub)]) == sub:
            return i
    return -1


@pytest.mark.parametrize("seed", range(40))
def test_tracker_forces_exactly_what_the_reference_says(seed):
    rng = random.Random(seed)
    vocab = 6
    m = Markers(start=tuple(rng.choice([[1], [1, 2]])), end=tuple(rng.choice([[3], [3, 4], [3, 4, 5]])))
    budget = rng.randrange(0, 6)
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
    t = ThinkingTracker(m, budget, prompt)
    out: list[int] = []
    for _ in range(40):
        want = _reference_forced(prompt, out, m, budget)
        assert t.forced_next() == want, (prompt, out, m, budget)
        token = want if want is not None else rng.randrange(vocab)
        t.accept(token)
        out.append(token)


def test_budget_counts_thinking_tokens_then_forces_the_end_marker():
    m = Markers((1,), (3, 4))
    t = ThinkingTracker(m, 2, [9, 1])  # the prompt opened the section
    assert t.room() == 2 and not t.answering
    for tok in (7, 8):
        assert t.forced_next() is None
        t.accept(tok)
    assert [t.forced_next(), t.room()] == [3, 0]
    t.accept(3)
    assert t.forced_next() == 4
    t.accept(4)
    assert t.answering and t.forced_next() is None and (t.thinking_tokens, t.forced_tokens) == (2, 2)
    t.accept(1)  # a second section: the budget is spent already
    assert t.forced_next() == 3


def test_an_end_marker_the_model_began_is_completed_not_restarted():
    m = Markers((1,), (3, 4, 5))
    t = ThinkingTracker(m, 3, [1])
    for tok in (7, 8, 3):  # the third thinking token is the marker's first
        t.accept(tok)
    assert t.forced_next() == 4 and t.thinking_tokens == 2
    t.accept(4)
    t.accept(5)
    assert t.answering and t.forced_tokens == 2


def test_clamp_cuts_several_emitted_tokens_at_the_forced_position():
    m = Markers((1,), (3,))
    t = ThinkingTracker(m, 2, [1])
    assert t.clamp([7, 8, 9, 6]) == [7, 8, 3]
    assert t.answering and t.clamp([9, 9]) == [9, 9]


@pytest.mark.parametrize("bad", [{"reasoning_start_str": ""}, {"thinking_token_budget": -1},
                                 {"thinking_token_budget": True}, {"reasoning_end_str": "<think>"}, {"extra": 1}])
def test_bad_reasoning_configs_are_value_errors(bad):
    with pytest.raises(ValueError):
        ReasoningConfig.from_dict(bad)


def test_a_budget_without_markers_is_refused(ckpt_dir):
    from engine import LLM

    with LLM(str(ckpt_dir("qwen3")), dtype="float32", num_gpu_blocks=32) as llm:
        with pytest.raises(ValueError, match="reasoning markers"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, thinking_token_budget=3),
                         use_tqdm=False)


# -- against transformers ---------------------------------------------------------------------
BUDGET, N_OUT = 7, 16


@pytest.fixture(scope="module")
def think(tmp_path_factory):
    from engine import LLM

    path = build_checkpoint("qwen3", tmp_path_factory.mktemp("think") / "qwen3", think=True)
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=64, reasoning_config={"thinking_token_budget": BUDGET})
    tok = llm.get_tokenizer()
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for c in ("hello", "what is the sun")]
    assert all(p[-1] == THINK_ID for p in prompts)  # the template opens the thinking section
    yield path, llm, prompts, load_hf(path)
    llm.close()


def _hf(hf, prompt, n):
    ids = torch.tensor([prompt])
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                      eos_token_id=[], pad_token_id=0, sequence_bias={(t,): b for t, b in BIAS.items()})
    return out[0, len(prompt):].tolist()


def _run(llm, prompts, **kw):
    sp = SamplingParams(temperature=0.0, max_tokens=N_OUT, logit_bias=BIAS, **kw)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]


def test_thinking_has_exactly_the_budget_then_the_forced_marker_then_the_answer(think):
    _, llm, prompts, hf = think
    for prompt, out in zip(prompts, _run(llm, prompts)):
        ids = list(out.token_ids)
        thinking = _hf(hf, prompt, BUDGET)
        assert ids[:BUDGET] == thinking and END_THINK_ID not in thinking
        assert ids[BUDGET] == END_THINK_ID  # forced: the bias forbids it
        assert ids[BUDGET + 1:] == _hf(hf, prompt + ids[:BUDGET + 1], N_OUT - BUDGET - 1)
        assert (out.thinking_tokens, out.thinking_forced_tokens) == (BUDGET, 1)


def test_a_request_budget_wins_and_zero_ends_thinking_at_once(think):
    _, llm, prompts, _ = think
    for budget in (0, 3):
        for out in _run(llm, prompts, thinking_token_budget=budget):
            assert out.token_ids[budget] == END_THINK_ID and END_THINK_ID not in out.token_ids[:budget]
            assert out.thinking_tokens == budget


def test_structured_outputs_constrain_the_answer_not_the_thinking(think):
    _, llm, prompts, hf = think
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0.0, max_tokens=N_OUT, logit_bias={END_THINK_ID: -100.0},
                        structured_outputs={"choice": ["paris", "blue"]})
    for prompt, o in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)):
        ids = list(o.outputs[0].token_ids)
        assert ids[:BUDGET] == _hf(hf, prompt, BUDGET) and ids[BUDGET] == END_THINK_ID
        assert tok.decode(ids[BUDGET + 1:], skip_special_tokens=True).strip() in ("paris", "blue")


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
         "adaptive": False}


@pytest.mark.parametrize("variant", [{"async_scheduling": True}, {"speculative_config": NGRAM},
                                     {"speculative_config": NGRAM, "async_scheduling": True}],
                         ids=["async", "ngram", "ngram-async"])
def test_the_budget_is_the_same_with_async_scheduling_and_speculation(think, variant):
    """No logit bias here (a biased request is not speculated on): greedy output of a repetitive
    prompt, which n-gram lookup proposes across the budget, so verification must cut there.
    Sampled requests too (seeded): the forced position does not depend on the schedule."""
    from engine import LLM

    path, llm, prompts, _ = think
    tok = llm.get_tokenizer()
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": w * 12}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for w in ("one two ", "sun moon sea ")]
    greedy = SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True)
    want = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]
    assert all(o.token_ids[BUDGET] == END_THINK_ID and o.thinking_forced_tokens == 1 for o in want)
    with LLM(str(path), dtype="float32", num_gpu_blocks=64, reasoning_config={"thinking_token_budget": BUDGET},
             **variant) as other:
        got = [o.outputs[0] for o in other.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                    use_tqdm=False)]
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [(o.thinking_tokens, o.thinking_forced_tokens) for o in got] == [(BUDGET, 1)] * len(prompts)
        if "speculative_config" in variant:
            assert other.get_stats().spec_decode["num_accepted_tokens"] > 0
        sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=N_OUT, logit_bias=BIAS)
        for o in other.generate([{"prompt_token_ids": p} for p in prompts], sampled, use_tqdm=False):
            ids = o.outputs[0].token_ids
            assert ids[BUDGET] == END_THINK_ID and END_THINK_ID not in ids[:BUDGET]
