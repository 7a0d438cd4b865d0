"""Issue 17 (sampling controls): `logit_bias`, `allowed_token_ids`, `bad_words`.
Oracles: a plain-Python reference for one row; transformers' `generate` with its own logits
processors (`sequence_bias`, `bad_words_ids`, `prefix_allowed_tokens_fn`) for greedy tokens."""
from __future__ import annotations

import math
import random

import pytest
import torch

from checkpoints import hf_greedy, load_hf, random_prompt
from engine.sample.logit_controls import BadWords, apply_controls, bad_word_ids
from engine.sampling_params import SamplingParams


def _reference(row: list[float], params: SamplingParams, bad: tuple, output: list[int]) -> list[float]:
    out = list(row)
    if params.allowed_token_ids:
        out = [v if i in params.allowed_token_ids else -math.inf for i, v in enumerate(out)]
    for seq in bad:
        *head, last = seq
        if not head or output[-len(head):] == head:
            out[last] = -math.inf
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    return out


@pytest.mark.parametrize("seed", range(60))
def test_controls_match_a_plain_reference(seed):
    rng = random.Random(seed)
    vocab = 12
    row = [rng.uniform(-5, 5) for _ in range(vocab)]
    output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
    bad = tuple(tuple(rng.randrange(vocab) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(0, 6)))
    bias = {rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(0, 3))} or None
    allowed = rng.sample(range(vocab), rng.randrange(3, vocab)) if rng.random() < 0.5 else None
    params = SamplingParams(logit_bias=bias, allowed_token_ids=allowed, bad_words=["x"] if bad else None)
    want = _reference(row, params, bad, output)
    if all(v == -math.inf for v in want):
        with pytest.raises(ValueError, match="no token is left"):
            apply_controls(torch.tensor(row), params, BadWords(bad), output)
        return
    got = apply_controls(torch.tensor(row), params, BadWords(bad), output)
    assert got.tolist() == pytest.approx(want)


def test_bad_words_are_tokenized_as_written_and_after_a_space(tokenizer):
    seqs = bad_word_ids(["paris", " hello world"], tokenizer)
    assert (tokenizer.encode("paris", add_special_tokens=False)[0],) in seqs
    assert tuple(tokenizer.encode("hello world", add_special_tokens=False)) in seqs


def _byte_level_bpe():
    """A small byte-level BPE (GPT-2 style: a leading space changes the tokens), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(f"w{i} paris hello world" for i in range(j, j + 50)) for j in range(0, 2000, 50)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("which", ["word_level", "byte_level_bpe"])
def test_bad_words_in_chunks_equal_encoding_them_one_by_one(tokenizer, which):
    """The chunked Rust-backend path (engine/sample/logit_controls.py) against tokenizer.encode per
    text, across chunk boundaries; and a slow tokenizer (no backend) takes the per-word path."""
    from engine.sample import logit_controls

    tok = tokenizer if which == "word_level" else _byte_level_bpe()
    words = [f"w{i}" for i in range(2 * logit_controls.BAD_WORDS_CHUNK + 7)] + ["paris", " hello world", "héllo"]
    want = BadWords(tuple(tok.encode(t, add_special_tokens=False)) for w in words for t in (w.lstrip(), " " + w.lstrip()))
    got = bad_word_ids(words, tok)
    assert got.sequences == want.sequences
    assert which == "word_level" or len(got) > len(words)  # the BPE knows w0..w2054: no duplicates

    class Slow:  # what a tokenizer without `backend_tokenizer` offers
        encode = tok.encode
    assert bad_word_ids(words, Slow()).sequences == want.sequences


@pytest.mark.parametrize("bad", [{"logit_bias": {1: 101}}, {"logit_bias": {"1": 5}}, {"allowed_token_ids": []},
                                 {"bad_words": [""]}, {"logit_bias": {True: 1}}])
def test_bad_settings_are_value_errors(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_out_of_vocabulary_ids_are_refused_before_anything_runs(ckpt_dir):
    from engine import LLM

    with LLM(str(ckpt_dir("qwen3")), dtype="float32", num_gpu_blocks=32) as llm:
        for kw, what in [({"logit_bias": {10**6: 1.0}}, "logit_bias"), ({"allowed_token_ids": [-1]}, "allowed")]:
            with pytest.raises(ValueError, match=what):
                llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, **kw), use_tqdm=False)


N_OUT = 12


@pytest.fixture(scope="module")
def setting(ckpt_dir):
    from engine import LLM

    path = ckpt_dir("qwen3")
    prompts = [random_prompt(n, 77 + n) for n in (9, 40)]
    hf = load_hf(path)
    free = [list(hf_greedy(hf, p, N_OUT)) for p in prompts]
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=64)
    yield llm, hf, prompts, free
    llm.close()


def _engine(llm, prompts, **kw):
    sp = SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True, **kw)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                               use_tqdm=False)]


def _hf(hf, prompt, **kw):
    ids = torch.tensor([prompt])
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_OUT,
                      eos_token_id=[], pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_logit_bias_equals_transformers_sequence_bias(setting):
    llm, hf, prompts, free = setting
    banned = {free[0][0], free[1][2]}
    boosted = free[0][5]
    bias = {**{t: -100.0 for t in banned}, boosted: 3.0}
    got = _engine(llm, prompts, logit_bias=bias)
    want = [_hf(hf, p, sequence_bias={(t,): b for t, b in bias.items()}) for p in prompts]
    assert got == want and got != free
    assert not banned & {t for out in got for t in out}


def test_bad_words_equal_transformers_bad_words_ids(setting, tokenizer):
    llm, hf, prompts, free = setting
    word = tokenizer.decode(free[1][3:5])  # a two-token sequence the free run produces
    got = _engine(llm, prompts, bad_words=[word])
    seqs = bad_word_ids([word], tokenizer)
    want = [_hf(hf, p, bad_words_ids=[list(s) for s in seqs]) for p in prompts]
    assert got == want and got[1] != free[1]


def test_allowed_token_ids_equal_transformers_prefix_allowed_tokens(setting):
    llm, hf, prompts, free = setting
    allowed = sorted({t for out in free for t in out[1::2]} | {6, 7, 8})
    got = _engine(llm, prompts, allowed_token_ids=allowed)
    want = [_hf(hf, p, prefix_allowed_tokens_fn=lambda _b, _ids: allowed) for p in prompts]
    assert got == want and all(t in allowed for out in got for t in out)


def test_sampled_requests_never_draw_a_banned_token(setting):
    """At temperature 1 with seeds: a -100 bias on the likeliest tokens bans them in practice."""
    llm, _, prompts, free = setting
    banned = {t for out in free for t in out}
    sp = [SamplingParams(temperature=1.0, max_tokens=N_OUT, ignore_eos=True, seed=s,
                         logit_bias={t: -100.0 for t in banned}) for s in range(8)]
    outs = llm.generate([{"prompt_token_ids": prompts[0]}] * 8, sp, use_tqdm=False)
    drawn = {t for o in outs for t in o.outputs[0].token_ids}
    assert drawn and not drawn & banned


def test_controls_are_the_same_under_async_scheduling(ckpt_dir, setting, tokenizer):
    """Async scheduling applies a step's tokens before the next one samples: bad words see them."""
    from engine import LLM

    llm, _, prompts, free = setting
    kws = [{"logit_bias": {free[0][0]: -100.0}}, {"bad_words": [tokenizer.decode(free[1][3:5])]},
           {"allowed_token_ids": sorted(set(free[0]) | {9})}]
    with LLM(str(ckpt_dir("qwen3")), dtype="float32", num_gpu_blocks=64, async_scheduling=True) as fast:
        for kw in kws:
            assert _engine(fast, prompts, **kw) == _engine(llm, prompts, **kw), kw
