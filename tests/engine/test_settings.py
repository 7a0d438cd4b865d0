"""Engine settings never change greedy tokens.

Prefix caching on/off, chunked prefill (max_num_batched_tokens=64), preemption under a
tiny G1, max_num_seqs 1 and 32 and the priority policy all schedule the same requests
differently; the tokens must still be transformers' greedy tokens (the oracle), which is
also the baseline of every other setting.
"""

from __future__ import annotations

import gc

import pytest

from checkpoints import MIN_REL_MARGIN, hf_greedy, random_prompt, relative_margin

KIND = "qwen3"
BLOCK = 16


# Prompt seeds are chosen so that no greedy step of the oracle has a top-1/top-2 gap below
# 1e-3 relative (the oracle fixture checks > MIN_REL_MARGIN): settings change float
# rounding (chunking, batch shapes), and a near-tie would flip for no fault of the engine.
def _mixed_prompts() -> list[list[int]]:
    """10 prompts: 3 to 700 tokens, most longer than 64, two sharing long prefixes."""
    base = random_prompt(700, 2000)
    seeds = (2100, 2101, 2102, 2103, 2104, 3105, 2106)
    prompts = [random_prompt(n, s) for n, s in zip((3, 17, 64, 65, 130, 257, 400), seeds)]
    prompts.append(base)
    prompts.append(base[:300] + random_prompt(20, 2200))  # shares 300 (18.75 blocks) with base
    prompts.append(base[:512] + random_prompt(5, 2201))  # shares 32 full blocks with base
    return prompts


MIXED = _mixed_prompts()
MIXED_MAX_TOKENS = 24
# Preemption workloads (see the cases below)
MANY_SHORT = [random_prompt(40, s) for s in (2300, 2302, 2303, 2304, 2306, 2309, 2310, 2312)]
FEW_LONG = [random_prompt(160, s) for s in (2400, 2402, 2407)]

CASES = {
    # name: (LLM kwargs, workload, max_tokens, expect preemption)
    "prefix_caching_on": (dict(enable_prefix_caching=True), "mixed", MIXED_MAX_TOKENS, False),
    "prefix_caching_off": (dict(enable_prefix_caching=False), "mixed", MIXED_MAX_TOKENS, False),
    "chunked_prefill_64": (dict(max_num_batched_tokens=64), "mixed", MIXED_MAX_TOKENS, False),
    "chunked_prefill_64_no_caching": (dict(max_num_batched_tokens=64, enable_prefix_caching=False), "mixed",
                                      MIXED_MAX_TOKENS, False),
    "max_num_seqs_1": (dict(max_num_seqs=1), "mixed", MIXED_MAX_TOKENS, False),
    "max_num_seqs_32": (dict(max_num_seqs=32), "mixed", MIXED_MAX_TOKENS, False),
    "priority_policy": (dict(scheduling_policy="priority"), "mixed", MIXED_MAX_TOKENS, False),
    # 8 prompts of 40 tokens (3 blocks each, 24 in all) fit together; growing to 88 tokens
    # (6 blocks each, 48) does not fit in 30 blocks: running requests must be preempted.
    "preempt_many_short": (dict(num_gpu_blocks=30), "many_short", 48, True),
    # G1 keeps held blocks pinned in its policy (issue 18): the same under another policy, given as JSON.
    "preempt_many_short_priority_eviction": (dict(num_gpu_blocks=30, kv_eviction_policy='{"name": "priority"}'),
                                             "many_short", 48, True),
    # 3 prompts of 160 tokens (10 blocks) growing to 256 (16 blocks); 24 blocks hold ~1.5
    # finished requests: two start, and the second is preempted as they grow.
    "preempt_long": (dict(num_gpu_blocks=24), "few_long", 96, True),
    "preempt_long_no_caching": (dict(num_gpu_blocks=24, enable_prefix_caching=False), "few_long", 96, True),
    "preempt_long_chunked": (dict(num_gpu_blocks=24, max_num_batched_tokens=64), "few_long", 96, True),
}
WORKLOADS = {"mixed": MIXED, "many_short": MANY_SHORT, "few_long": FEW_LONG}


@pytest.fixture(scope="module")
def oracle(hf_model):
    """transformers' greedy tokens for every workload prompt (longest max_tokens used)."""
    model = hf_model(KIND)
    need: dict[str, int] = {}
    for _, workload, max_tokens, _ in CASES.values():
        need[workload] = max(need.get(workload, 0), max_tokens)
    result = {}
    for workload, max_tokens in need.items():
        toks = []
        for p in WORKLOADS[workload]:
            t, steps = hf_greedy(model, p, max_tokens, return_scores=True)
            worst = min(relative_margin(s) for s in steps)
            assert worst > MIN_REL_MARGIN, f"oracle near-tie ({worst:.1e}) in workload {workload}: pick other seeds"
            toks.append(t)
        result[workload] = toks
    return result


def _llm(ckpt_dir, **kwargs):
    from engine import LLM

    # a small G1 unless the test sizes it: the default allocates GiBs and takes seconds
    kwargs.setdefault("num_gpu_blocks", 1024)
    return LLM(model=str(ckpt_dir(KIND)), dtype="float32", block_size=BLOCK, seed=0, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_setting_keeps_greedy_tokens(case, ckpt_dir, oracle):
    from engine import SamplingParams

    kwargs, workload, max_tokens, expect_preemption = CASES[case]
    prompts = WORKLOADS[workload]
    llm = _llm(ckpt_dir, **kwargs)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        gen_kwargs = {}
        if kwargs.get("scheduling_policy") == "priority":
            # later prompts first: a different order than fcfs, same tokens
            gen_kwargs["priority"] = [len(prompts) - i for i in range(len(prompts))]
        rounds = 2 if kwargs.get("enable_prefix_caching", True) and workload == "mixed" else 1
        for rnd in range(rounds):  # the second round is served from the prefix cache
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, **gen_kwargs)
            assert len(outs) == len(prompts)
            for i, (p, o, want) in enumerate(zip(prompts, outs, oracle[workload])):
                assert list(o.prompt_token_ids) == p, f"round {rnd} prompt {i}: outputs not in input order"
                got = list(o.outputs[0].token_ids)
                assert got == want[:max_tokens], (
                    f"{case} round {rnd} prompt {i} (len {len(p)}): engine {got} != transformers {want[:max_tokens]}")
                assert o.outputs[0].finish_reason == "length"
                if not kwargs.get("enable_prefix_caching", True):
                    assert o.num_cached_tokens == 0, "prefix caching is off but tokens were reported cached"
                assert o.num_cached_tokens <= len(p) - 1
            if rnd == 1:
                # every prompt of at least one full block hits the cache the second time
                for p, o in zip(prompts, outs):
                    if len(p) > BLOCK:
                        least = (len(p) - 1) // BLOCK * BLOCK - BLOCK  # all full blocks, one of slack
                        assert o.num_cached_tokens >= least, (len(p), o.num_cached_tokens)
        stats = llm.get_stats()
        if expect_preemption:
            assert stats.num_preemptions > 0, f"{case}: the tiny G1 should have forced a preemption"
        assert stats.num_running == 0 and stats.num_waiting == 0
        if not kwargs.get("enable_prefix_caching", True):
            assert stats.prefix_cache_hits == 0
    finally:
        del llm
        gc.collect()


def test_per_request_sampling_params(ckpt_dir, oracle):
    """A list of SamplingParams applies one per prompt (here: different max_tokens)."""
    from engine import SamplingParams

    llm = _llm(ckpt_dir, max_num_batched_tokens=64)
    try:
        lens = [1 + (7 * i) % MIXED_MAX_TOKENS for i in range(len(MIXED))]
        sps = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        outs = llm.generate([{"prompt_token_ids": p} for p in MIXED], sps, use_tqdm=False)
        for i, (o, n, want) in enumerate(zip(outs, lens, oracle["mixed"])):
            assert list(o.outputs[0].token_ids) == want[:n], f"prompt {i}"
            assert o.outputs[0].finish_reason == "length"
    finally:
        del llm
        gc.collect()


def test_kv_eviction_policy_is_checked_before_any_weights_load(tmp_path):
    """A name, a mapping or its JSON; a bad one is a ValueError naming the setting and the problem."""
    from engine.config import EngineConfig

    for good in ("priority", {"name": "lru"}, '{"name": "lru", "options": {}}'):
        assert EngineConfig(model=str(tmp_path), kv_eviction_policy=good).kv_eviction_policy == good
    for bad, named in (("nope", "unknown eviction policy 'nope'"), ({"name": "lru", "options": {"x": 1}}, "takes no options"),
                       ({"nme": "lru"}, "unknown key")):
        with pytest.raises(ValueError, match=f"kv_eviction_policy: .*{named}"):
            EngineConfig(model=str(tmp_path), kv_eviction_policy=bad)
