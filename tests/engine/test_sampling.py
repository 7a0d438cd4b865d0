"""Sampling: seeds, greedy equivalents, the top-k/top-p/min-p supports, stop conditions,
EOS handling and logprobs.  Oracles: transformers (greedy tokens, logits, repetition
penalty, min_tokens) and the engine's own greedy baseline (stop conditions)."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from checkpoints import EOS_ID, MIN_REL_MARGIN, PAD_ID, hf_greedy, hf_last_logits, random_prompt, relative_margin

KIND = "qwen3"
PROMPT = random_prompt(20, 4000)
OTHERS = [random_prompt(n, 4010 + i) for i, n in enumerate((7, 33, 150))]
GREEDY_LEN = 48
DIST_PROMPT = random_prompt(20, 4100)
DIST_T = 3.0
DIST_N = 200


def SP(**kw):
    from engine import SamplingParams

    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


def _ids(p):
    return {"prompt_token_ids": p}


def _toks(out):
    return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def llm(ckpt_dir):
    from engine import LLM

    engine = LLM(model=str(ckpt_dir(KIND)), dtype="float32", block_size=16, seed=0, num_gpu_blocks=1024)
    yield engine
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def model(hf_model):
    return hf_model(KIND)


@pytest.fixture(scope="module")
def greedy(llm, model):
    """The engine's greedy continuation of PROMPT (checked against transformers) and its text."""
    want, steps = hf_greedy(model, PROMPT, GREEDY_LEN, return_scores=True)
    assert min(relative_margin(s) for s in steps) > MIN_REL_MARGIN, "oracle near-tie: pick another prompt"
    (out,) = llm.generate([_ids(PROMPT)], SP(temperature=0.0, max_tokens=GREEDY_LEN), use_tqdm=False)
    assert _toks(out) == want
    return want, out.outputs[0].text


# ------------------------------------------------------------------ seeds


def test_seeded_request_is_batch_invariant(llm, greedy):
    seeded = SP(temperature=1.0, seed=123, max_tokens=32)
    (alone,) = llm.generate([_ids(PROMPT)], seeded, use_tqdm=False)
    (again,) = llm.generate([_ids(PROMPT)], seeded, use_tqdm=False)
    batch = llm.generate(
        [_ids(OTHERS[0]), _ids(PROMPT), _ids(OTHERS[1]), _ids(PROMPT), _ids(OTHERS[2])],
        [
            SP(temperature=1.0, max_tokens=40),  # unseeded
            seeded,
            SP(temperature=1.0, seed=7, max_tokens=20),
            SP(temperature=1.0, max_tokens=32),  # same prompt, unseeded
            SP(temperature=0.8, top_p=0.9, seed=9, max_tokens=32),
        ],
        use_tqdm=False,
    )
    assert len(_toks(alone)) == 32
    assert _toks(again) == _toks(alone), "the same seed must give the same tokens"
    assert _toks(batch[1]) == _toks(alone), "a seeded request must not depend on its batch"
    assert _toks(alone) != greedy[0][:32], "temperature 1 should not reproduce greedy here"


def test_different_seeds_give_different_tokens(llm):
    a, b = llm.generate([_ids(PROMPT)] * 2, [SP(temperature=1.0, seed=1, max_tokens=GREEDY_LEN),
                                              SP(temperature=1.0, seed=2, max_tokens=GREEDY_LEN)], use_tqdm=False)
    assert _toks(a) != _toks(b)


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.7, top_p=1e-6),
    dict(temperature=1.3, min_p=1.0),
], ids=["top_k=1", "top_p=1e-6", "min_p=1"])
def test_greedy_equivalents(llm, greedy, kw):
    (out,) = llm.generate([_ids(PROMPT)], SP(max_tokens=32, **kw), use_tqdm=False)
    assert _toks(out) == greedy[0][:32]


# ------------------------------------------------------------------ the sampling distribution


@pytest.fixture(scope="module")
def dist(model):
    """First-token probabilities of DIST_PROMPT at DIST_T, from transformers' logits."""
    probs = torch.softmax(hf_last_logits(model, DIST_PROMPT).double() / DIST_T, -1)
    sorted_p, order = probs.sort(descending=True)
    # preconditions that make the checks below meaningful
    assert sorted_p[0] < 0.8 and sorted_p[1] > 0.1 and sorted_p[2] > 0.03, sorted_p[:4]
    assert sorted_p[2] - sorted_p[3] > 1e-3
    return probs, sorted_p, order


def _first_tokens(llm, **kw):
    outs = llm.generate([_ids(DIST_PROMPT)] * DIST_N,
                        [SP(temperature=DIST_T, seed=s, max_tokens=1, **kw) for s in range(DIST_N)],
                        use_tqdm=False)
    return [_toks(o)[0] for o in outs]


def _check_frequencies(samples, probs):
    """Each of the likeliest tokens' frequency is within 5 sigma of its probability."""
    n = len(samples)
    for tok in probs.argsort(descending=True)[:3].tolist():
        p = float(probs[tok])
        freq = samples.count(tok) / n
        sigma = math.sqrt(max(p * (1 - p), 1e-4) / n)
        assert abs(freq - p) < 5 * sigma + 1e-9, f"token {tok}: frequency {freq:.3f}, probability {p:.3f}"


def test_temperature_sampling_follows_softmax(llm, dist):
    probs, _, _ = dist
    samples = _first_tokens(llm)
    assert all(probs[t] > 1e-6 for t in samples)
    _check_frequencies(samples, probs)


def test_top_k_support_and_renormalisation(llm, dist):
    probs, _, order = dist
    allowed = order[:3]
    samples = _first_tokens(llm, top_k=3)
    assert set(samples) <= set(allowed.tolist()), set(samples) - set(allowed.tolist())
    renorm = torch.zeros_like(probs)
    renorm[allowed] = probs[allowed] / probs[allowed].sum()
    _check_frequencies(samples, renorm)


def test_top_p_support(llm, dist):
    probs, sorted_p, order = dist
    cum = sorted_p.cumsum(0)
    top_p = float(cum[0] + cum[1]) / 2  # the smallest set reaching top_p is the top 2
    samples = _first_tokens(llm, top_p=top_p)
    assert set(samples) <= set(order[:2].tolist())
    assert len(set(samples)) == 2
    renorm = torch.zeros_like(probs)
    renorm[order[:2]] = probs[order[:2]] / probs[order[:2]].sum()
    _check_frequencies(samples, renorm)


def test_min_p_support(llm, dist):
    probs, sorted_p, order = dist
    min_p = float(sorted_p[1] + sorted_p[2]) / 2 / float(sorted_p[0])  # keeps the top 2
    samples = _first_tokens(llm, min_p=min_p)
    assert set(samples) <= set(order[:2].tolist())
    assert len(set(samples)) == 2


# ------------------------------------------------------------------ stop conditions


def test_max_tokens_finishes_with_length(llm, greedy):
    (out,) = llm.generate([_ids(PROMPT)], SP(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert _toks(out) == greedy[0][:5]
    assert out.outputs[0].finish_reason == "length"


def test_stop_token_ids(llm, greedy):
    toks = greedy[0]
    k = next(i for i in range(2, len(toks)) if toks[i] not in toks[:i])  # first new token from the 3rd on
    stop = toks[k]
    (out,) = llm.generate([_ids(PROMPT)], SP(temperature=0.0, max_tokens=GREEDY_LEN, stop_token_ids=[stop]),
                          use_tqdm=False)
    got = _toks(out)
    assert got in (toks[:k], toks[:k + 1]), f"expected to stop at index {k} (token {stop}): {got}"
    assert out.outputs[0].finish_reason == "stop"


def _first_unique_word(toks, tokenizer, start):
    """Index k >= start whose word occurs in no earlier token's text (so text.find is exact);
    neither it nor the token before it is EOS (not in the text)."""
    words = [tokenizer.convert_ids_to_tokens(t) for t in toks]
    for k in range(start, len(toks)):
        w = words[k]
        if EOS_ID not in toks[k - 1:k + 1] and len(w) >= 2 and not any(w in x for x in words[:k]):
            return k, w, words
    pytest.fail("no usable stop word in the greedy output")


def test_stop_string_truncates_text(llm, greedy, tokenizer):
    toks, text = greedy
    k, word, _ = _first_unique_word(toks, tokenizer, 3)
    assert word in text
    (out,) = llm.generate([_ids(PROMPT)], SP(temperature=0.0, max_tokens=GREEDY_LEN, stop=[word]), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop"
    assert c.text == text[: text.find(word)], (c.text, word)
    assert list(c.token_ids) in (toks[:k], toks[:k + 1])


def test_multi_token_stop_string(llm, greedy, tokenizer):
    toks, text = greedy
    k, word, words = _first_unique_word(toks, tokenizer, 4)
    stop = words[k - 1] + " " + word  # spans two tokens
    pos = text.find(stop)
    assert pos >= 0
    (out,) = llm.generate([_ids(PROMPT)], SP(temperature=0.0, max_tokens=GREEDY_LEN, stop=["zzzz-never", stop]),
                          use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop"
    assert c.text == text[:pos]
    assert list(c.token_ids) in (toks[:k], toks[:k + 1])


def test_unmatched_stop_string_runs_to_length(llm, greedy):
    toks, text = greedy
    (out,) = llm.generate([_ids(PROMPT)], SP(temperature=0.0, max_tokens=GREEDY_LEN, stop=["zzzz-never"]),
                          use_tqdm=False)
    assert _toks(out) == toks and out.outputs[0].text == text
    assert out.outputs[0].finish_reason == "length"


@pytest.fixture(scope="module")
def eos_case(model):
    """A prompt whose greedy continuation (transformers) produces EOS at index k >= 2."""
    for s in range(200):
        prompt = random_prompt(5 + s % 40, 5000 + s)
        toks, steps = hf_greedy(model, prompt, 24, return_scores=True)
        if EOS_ID in toks[2:] and EOS_ID not in toks[:2]:
            if min(relative_margin(x) for x in steps) > MIN_REL_MARGIN:
                return prompt, toks, toks.index(EOS_ID)
    pytest.fail("no prompt whose greedy output contains EOS")


def test_eos_stops_unless_ignored(llm, eos_case, tokenizer):
    prompt, toks, k = eos_case
    stopped, ignored = llm.generate([_ids(prompt)] * 2, [SP(temperature=0.0, max_tokens=24, ignore_eos=False),
                                                         SP(temperature=0.0, max_tokens=24, ignore_eos=True)],
                                    use_tqdm=False)
    assert _toks(stopped) in (toks[:k], toks[:k + 1]), (k, _toks(stopped), toks)
    assert stopped.outputs[0].finish_reason == "stop"
    assert tokenizer.eos_token not in stopped.outputs[0].text
    assert _toks(ignored) == toks
    assert ignored.outputs[0].finish_reason == "length"


def test_min_tokens_suppresses_eos(llm, model, eos_case):
    """min_tokens masks EOS until reached (transformers: min_new_tokens)."""
    prompt, toks, k = eos_case
    m = k + 3
    ids = torch.tensor([prompt])
    hf = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                        min_new_tokens=m, eos_token_id=[EOS_ID], pad_token_id=PAD_ID, output_scores=True,
                        return_dict_in_generate=True)
    want = hf.sequences[0, len(prompt):].tolist()
    assert min(relative_margin(s[0]) for s in hf.scores) > MIN_REL_MARGIN
    assert want[k] != EOS_ID and want[:k] == toks[:k]
    (out,) = llm.generate([_ids(prompt)], SP(temperature=0.0, max_tokens=24, min_tokens=m, ignore_eos=False),
                          use_tqdm=False)
    got = _toks(out)
    assert len(got) >= m
    if EOS_ID in want:  # transformers keeps the EOS it stopped at
        e = want.index(EOS_ID)
        assert got in (want[:e], want[:e + 1]) and out.outputs[0].finish_reason == "stop"
    else:
        assert got == want and out.outputs[0].finish_reason == "length"


def test_repetition_penalty_matches_transformers(llm, model):
    """Both apply it to prompt and output tokens: positive logits / p, negative * p."""
    penalty = 1.3
    ids = torch.tensor([PROMPT])
    hf = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                        repetition_penalty=penalty, eos_token_id=[], pad_token_id=PAD_ID, output_scores=True,
                        return_dict_in_generate=True)
    want = hf.sequences[0, len(PROMPT):].tolist()
    assert min(relative_margin(s[0]) for s in hf.scores) > MIN_REL_MARGIN
    (out,) = llm.generate([_ids(PROMPT)], SP(temperature=0.0, max_tokens=16, repetition_penalty=penalty),
                          use_tqdm=False)
    assert _toks(out) == want


# ------------------------------------------------------------------ logprobs


def test_greedy_logprobs(llm, model, greedy):
    n = 8
    (out,) = llm.generate([_ids(PROMPT)], SP(temperature=0.0, max_tokens=n, logprobs=3), use_tqdm=False)
    toks = _toks(out)
    assert toks == greedy[0][:n]
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == n
    _, steps = hf_greedy(model, PROMPT, n, return_scores=True)
    for i, (tok, d, logits) in enumerate(zip(toks, lps, steps)):
        ref = torch.log_softmax(logits.double(), -1)
        assert tok in d and len(d) >= 3, (i, d)
        assert all(v <= 0 for v in d.values())
        assert max(d, key=d.get) == tok, "the greedy token has the largest logprob"
        third = float(ref.sort(descending=True).values[2])
        for t, v in d.items():
            assert abs(v - float(ref[t])) < 2e-4, (i, t, v, float(ref[t]))  # log-softmax of raw logits
            assert float(ref[t]) >= third - 2e-4, (i, t)  # the returned ids are the top ones


def test_sampled_logprobs_include_the_chosen_token(llm, model):
    """At a high temperature the chosen token is often outside the top-1: it is still listed,
    with its raw-logit logprob."""
    (out,) = llm.generate([_ids(DIST_PROMPT)], SP(temperature=DIST_T, seed=11, max_tokens=24, logprobs=1),
                          use_tqdm=False)
    toks = _toks(out)
    lps = out.outputs[0].logprobs
    assert lps is not None and len(lps) == len(toks) == 24
    not_top = 0
    for tok, d in zip(toks, lps):
        assert tok in d and 1 <= len(d) <= 2 and all(v <= 0 for v in d.values())
        not_top += max(d, key=d.get) != tok
    assert not_top > 0, "no sampled token outside the top-1: the check above tested nothing"
    # the values are transformers' log-softmax over the raw logits of the same sequence
    ids = torch.tensor([DIST_PROMPT + toks])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0, len(DIST_PROMPT) - 1:-1].double(), -1)
    for i, (tok, d) in enumerate(zip(toks, lps)):
        assert abs(d[tok] - float(ref[i, tok])) < 2e-4, (i, d[tok], float(ref[i, tok]))
