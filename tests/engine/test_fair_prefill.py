"""Issue 38's scheduler rules: a prefix being computed is computed once (n sequences of one
prompt prefill it once), and prompt log-prob work takes a share of a step while other requests
have work, all of it when alone. Oracles: transformers' greedy tokens, the engine's own
prompt log-probs computed alone, and the step-by-step schedule."""
from __future__ import annotations

import pytest

from checkpoints import hf_greedy, random_prompt
from engine import scheduler as sched_mod

KIND = "llama"
PROMPT = random_prompt(200, 4300)  # 12 full blocks of 16 and 8 tokens
MAX_TOKENS = 4


@pytest.fixture
def engine(ckpt_dir):
    from engine import LLM

    llm = LLM(str(ckpt_dir(KIND)), dtype="float32", num_gpu_blocks=256, max_num_batched_tokens=64, seed=0)
    yield llm.engine
    llm.close()


def _params(n: int = MAX_TOKENS, **kw):
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _record(core) -> list[dict[str, int]]:
    steps: list[dict[str, int]] = []
    schedule = core.scheduler.schedule

    def spy():
        out = schedule()
        steps.append({s.req.request_id: s.num_new_tokens for s in out.scheduled})
        return out

    core.scheduler.schedule = spy
    return steps


def _drain(core, reqs) -> None:
    while core.has_unfinished():
        core.step()
    assert all(r.status.finished for r in reqs)


@pytest.mark.parametrize("budget", [64, 512])  # over several steps, and in one
def test_n_sequences_of_one_prompt_prefill_it_once(ckpt_dir, hf_model, budget):
    from engine import LLM

    llm = LLM(str(ckpt_dir(KIND)), dtype="float32", num_gpu_blocks=256, max_num_batched_tokens=budget, seed=0)
    core = llm.engine
    steps = _record(core)
    reqs = [core.make_request(f"s{j}", PROMPT, _params()) for j in range(4)]
    other = core.make_request("other", random_prompt(20, 4301), _params())
    for r in (*reqs, other):
        core.add_request(r)
    _drain(core, [*reqs, other])
    prefill = {rid: sum(s.get(rid, 0) for s in steps) - (MAX_TOKENS - 1) for rid in ("s0", "s1", "s2", "s3")}
    assert prefill["s0"] == 200  # the first computes the prompt ...
    assert all(prefill[f"s{j}"] == 200 - 192 for j in (1, 2, 3)), prefill  # ... the rest read its 12 blocks
    assert all(r.num_cached_tokens == 192 for r in reqs[1:])
    # the held ones did not hold up the queue: the request behind them ran first
    first_other = next(i for i, s in enumerate(steps) if "other" in s)
    assert first_other <= next(i for i, s in enumerate(steps) if "s1" in s)
    if budget > 220:
        assert steps[0] == {"s0": 200, "other": 20}
    want = hf_greedy(hf_model(KIND), PROMPT, MAX_TOKENS)
    assert all(r.output_token_ids == want for r in reqs)
    llm.close()


def test_without_prefix_caching_nobody_waits(ckpt_dir):
    from engine import LLM

    llm = LLM(str(ckpt_dir(KIND)), dtype="float32", num_gpu_blocks=256, max_num_batched_tokens=512,
              enable_prefix_caching=False)
    try:
        core = llm.engine
        steps = _record(core)
        reqs = [core.make_request(f"s{j}", PROMPT, _params()) for j in range(2)]
        for r in reqs:
            core.add_request(r)
        core.step()
        assert steps[0] == {"s0": 200, "s1": 200}
        _drain(core, reqs)
    finally:
        llm.close()


def _plp_alone(ckpt_dir) -> list:
    from engine import LLM

    llm = LLM(str(ckpt_dir(KIND)), dtype="float32", num_gpu_blocks=256, max_num_batched_tokens=512)
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT}], _params(1, prompt_logprobs=3), use_tqdm=False)
        return out[0].prompt_logprobs
    finally:
        llm.close()


def test_prompt_logprobs_take_a_share_of_steps_that_carry_other_work(ckpt_dir, hf_model, monkeypatch):
    from engine import LLM

    want_plp = _plp_alone(ckpt_dir)
    llm = LLM(str(ckpt_dir(KIND)), dtype="float32", num_gpu_blocks=256, max_num_batched_tokens=512)
    try:
        core = llm.engine
        monkeypatch.setattr(core.scheduler, "step_cost", None)  # the unfitted allowance, for a fixed schedule
        steps = _record(core)
        probe_prompt = random_prompt(10, 4302)
        probe = core.make_request("probe", probe_prompt, _params(4))
        core.add_request(probe)
        core.step()  # the probe is decoding
        scored = core.make_request("scored", PROMPT, _params(1, prompt_logprobs=3))
        core.add_request(scored)
        _drain(core, [probe, scored])
        cap = sched_mod.PROMPT_LOGPROBS_UNFITTED
        with_probe = [s["scored"] for s in steps if "scored" in s and "probe" in s]
        alone = [s["scored"] for s in steps if "scored" in s and "probe" not in s]
        assert with_probe and all(n <= cap for n in with_probe), steps
        assert alone and max(alone) > cap  # once the probe is done, the rest in one step
        assert sum(with_probe) + sum(alone) == 200
        assert probe.output_token_ids == hf_greedy(hf_model(KIND), probe_prompt, 4)
        assert len(scored.prompt_logprobs) == 199
        for (rank, lps), want in zip(scored.prompt_logprobs, want_plp[1:]):  # the first prompt token has none
            target = next(iter(want))
            assert rank == want[target].rank and set(lps) == set(want)
            assert [lps[t] for t in want] == pytest.approx([w.logprob for w in want.values()], abs=1e-4)
    finally:
        llm.close()


def test_fitted_allowance_is_the_share_of_the_others_step():
    from engine.step_cost import StepCost

    cost = StepCost()
    assert cost.tokens_for(4, 0.5) is None
    for tokens in (1, 2, 4, 64, 128, 1, 3):  # 30 ms a step + 1 ms a token
        cost.observe(tokens, 0.030 + 0.001 * tokens)
    assert cost.tokens_for(4, 0.5) == 17  # 0.5 * (30 + 4)
    assert cost.tokens_for(0, 0.5) == 15
