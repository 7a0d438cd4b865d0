"""G1 prefix cache: hits are reported, counted, bounded by the shared prefix, and never
change the outputs (baseline: a fresh engine with prefix caching off, and transformers)."""

from __future__ import annotations

import gc
import inspect

import pytest

from checkpoints import MIN_REL_MARGIN, hf_greedy, random_prompt, relative_margin

KIND = "llama"  # llama3 rope: cached KV at positions far past the original 256 window
BLOCK = 16
MAX_TOKENS = 12

PREFIX = random_prompt(512, 3000)
TAIL_A = random_prompt(20, 3001)
TAIL_B = random_prompt(20, 3002)
TAIL_C = random_prompt(9, 3003)
assert TAIL_A[0] != TAIL_B[0] != TAIL_C[0] != TAIL_A[0]
A = PREFIX + TAIL_A
B = PREFIX + TAIL_B
C = PREFIX[:500] + TAIL_C  # shares 500 tokens = 31 full blocks + 4 tokens with A and B
OTHER = [random_prompt(520, 3010 + i) for i in range(2)]  # unrelated long prompts
SHORT = random_prompt(40, 3020)
ALL_PROMPTS = [A, B, C, PREFIX, SHORT] + OTHER


def _ids(p):
    return {"prompt_token_ids": p}


def _sp():
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _llm(ckpt_dir, **kwargs):
    from engine import LLM

    # a small G1 unless the test sizes it: the default allocates GiBs and takes seconds
    kwargs.setdefault("num_gpu_blocks", 1024)
    return LLM(model=str(ckpt_dir(KIND)), dtype="float32", block_size=BLOCK, seed=0, **kwargs)


@pytest.fixture(scope="module")
def fresh(ckpt_dir, hf_model):
    """Baseline tokens per prompt: a fresh engine without prefix caching; checked against
    transformers too."""
    llm = _llm(ckpt_dir, enable_prefix_caching=False)
    outs = llm.generate([_ids(p) for p in ALL_PROMPTS], _sp(), use_tqdm=False)
    del llm
    gc.collect()
    model = hf_model(KIND)
    base = {}
    for p, o in zip(ALL_PROMPTS, outs):
        want, steps = hf_greedy(model, p, MAX_TOKENS, return_scores=True)
        assert min(relative_margin(s) for s in steps) > MIN_REL_MARGIN, "oracle near-tie: pick other seeds"
        assert list(o.outputs[0].token_ids) == want, "fresh engine differs from transformers"
        assert o.num_cached_tokens == 0
        base[tuple(p)] = want
    return base


def _tokens(out):
    return list(out.outputs[0].token_ids)


def test_shared_512_token_prefix_is_served_from_cache(ckpt_dir, fresh):
    llm = _llm(ckpt_dir, enable_prefix_caching=True)
    s0 = llm.get_stats()
    (oa,) = llm.generate([_ids(A)], _sp(), use_tqdm=False)
    s1 = llm.get_stats()
    assert oa.num_cached_tokens == 0, "nothing can be cached on a fresh engine"
    assert s1.prefix_cache_hits == s0.prefix_cache_hits
    assert _tokens(oa) == fresh[tuple(A)]

    (ob,) = llm.generate([_ids(B)], _sp(), use_tqdm=False)
    s2 = llm.get_stats()
    # the 32 shared full blocks are hits (one block of slack); never more than shared
    assert 512 - BLOCK <= ob.num_cached_tokens <= 512, ob.num_cached_tokens
    assert _tokens(ob) == fresh[tuple(B)]
    hits = s2.prefix_cache_hits - s1.prefix_cache_hits
    queries = s2.prefix_cache_queries - s1.prefix_cache_queries
    assert hits >= 512 - BLOCK, hits
    assert queries >= hits and queries >= len(B) // BLOCK * BLOCK, (queries, hits)  # B's prompt was looked up
    assert s2.num_running == 0 and s2.num_waiting == 0


def test_unaligned_shared_prefix(ckpt_dir, fresh):
    """C shares 500 tokens with A: only the 31 full blocks (496 tokens) can be reused."""
    llm = _llm(ckpt_dir)
    llm.generate([_ids(A)], _sp(), use_tqdm=False)
    (oc,) = llm.generate([_ids(C)], _sp(), use_tqdm=False)
    assert 496 - BLOCK <= oc.num_cached_tokens <= 500, oc.num_cached_tokens
    assert _tokens(oc) == fresh[tuple(C)]


def test_identical_prompt_repeated(ckpt_dir, fresh):
    """A repeated 512-token prompt is (almost) all cached; at least one token is computed."""
    llm = _llm(ckpt_dir)
    (o1,) = llm.generate([_ids(PREFIX)], _sp(), use_tqdm=False)
    (o2,) = llm.generate([_ids(PREFIX)], _sp(), use_tqdm=False)
    assert o1.num_cached_tokens == 0
    assert 512 - BLOCK <= o2.num_cached_tokens <= 511, o2.num_cached_tokens
    assert _tokens(o1) == _tokens(o2) == fresh[tuple(PREFIX)]


def test_a_hit_that_ends_one_token_short_keeps_the_bits(ckpt_dir):
    """A prompt one token past 20 whole blocks, repeated: the repeat computes its last prompt token
    alone over 320 cached ones (a one-token prompt chunk), and every log-prob it samples equals, bit
    for bit, that of an engine computing the whole prompt (prefix caching off): the CPU backend
    sends such a chunk to the prefill kernel, whose rows do not depend on the chunk."""
    from engine import SamplingParams

    prompt = random_prompt(20 * BLOCK + 1, 3030)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5)
    llm = _llm(ckpt_dir, enable_prefix_caching=False)
    (want,) = llm.generate([_ids(prompt)], sp, use_tqdm=False)
    del llm
    gc.collect()
    llm = _llm(ckpt_dir)
    llm.generate([_ids(prompt)], sp, use_tqdm=False)
    (hit,) = llm.generate([_ids(prompt)], sp, use_tqdm=False)
    assert hit.num_cached_tokens == 20 * BLOCK
    assert hit.outputs[0].logprobs == want.outputs[0].logprobs  # floats compared exactly


def test_hits_inside_a_later_batch(ckpt_dir, fresh):
    """After A, a batch mixing prefix sharers and unrelated prompts: sharers hit, all correct."""
    llm = _llm(ckpt_dir)
    llm.generate([_ids(A)], _sp(), use_tqdm=False)
    batch = [B, OTHER[0], C, SHORT]
    outs = llm.generate([_ids(p) for p in batch], _sp(), use_tqdm=False)
    for p, o in zip(batch, outs):
        assert _tokens(o) == fresh[tuple(p)]
    assert outs[0].num_cached_tokens >= 512 - BLOCK
    assert outs[2].num_cached_tokens >= 496 - BLOCK
    assert outs[1].num_cached_tokens == 0 and outs[3].num_cached_tokens == 0


def test_prefix_caching_off_reports_no_hits(ckpt_dir, fresh):
    llm = _llm(ckpt_dir, enable_prefix_caching=False)
    for _ in range(2):
        (o,) = llm.generate([_ids(B)], _sp(), use_tqdm=False)
        assert o.num_cached_tokens == 0
        assert _tokens(o) == fresh[tuple(B)]
    assert llm.get_stats().prefix_cache_hits == 0


def test_evicted_prefix_is_recomputed_correctly(ckpt_dir, fresh):
    """A small G1 (48 blocks; a 532-token request needs 35): the unrelated prompts evict
    A's cached blocks, so B recomputes (part of) the prefix: outputs are still right."""
    llm = _llm(ckpt_dir, num_gpu_blocks=48)
    llm.generate([_ids(A)], _sp(), use_tqdm=False)
    for p in OTHER:
        (o,) = llm.generate([_ids(p)], _sp(), use_tqdm=False)
        assert _tokens(o) == fresh[tuple(p)]
    (ob,) = llm.generate([_ids(B)], _sp(), use_tqdm=False)
    assert _tokens(ob) == fresh[tuple(B)]
    assert ob.num_cached_tokens < 512 - BLOCK, "48 blocks cannot still hold A's prefix after OTHER"
    # and then B's own blocks are cached again
    (ob2,) = llm.generate([_ids(B)], _sp(), use_tqdm=False)
    assert ob2.num_cached_tokens >= 512 - BLOCK and _tokens(ob2) == fresh[tuple(B)]


def test_cache_salt_isolates(ckpt_dir, fresh):
    from engine import LLM

    if "cache_salt" not in inspect.signature(LLM.generate).parameters:
        pytest.skip("generate() takes no cache_salt")
    llm = _llm(ckpt_dir)
    (o1,) = llm.generate([_ids(A)], _sp(), use_tqdm=False, cache_salt="alice")
    (o2,) = llm.generate([_ids(B)], _sp(), use_tqdm=False, cache_salt="bob")
    (o3,) = llm.generate([_ids(B)], _sp(), use_tqdm=False)  # unsalted: not alice's either
    (o4,) = llm.generate([_ids(C)], _sp(), use_tqdm=False, cache_salt="alice")
    assert o1.num_cached_tokens == 0
    assert o2.num_cached_tokens == 0, "a different salt must not see alice's blocks"
    assert o3.num_cached_tokens == 0, "an unsalted request must not see salted blocks"
    assert o4.num_cached_tokens >= 496 - BLOCK, "the same salt shares"
    assert _tokens(o1) == fresh[tuple(A)] and _tokens(o2) == fresh[tuple(B)]
    assert _tokens(o3) == fresh[tuple(B)] and _tokens(o4) == fresh[tuple(C)]
