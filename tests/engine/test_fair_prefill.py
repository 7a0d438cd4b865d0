"""Issue 38's scheduler rules: a prefix being computed is computed once (n sequences of one
prompt prefill it once), and prompt log-prob work takes a share of a step while other requests
have work, all of it when alone. Oracles: transformers' greedy tokens, the engine's own
prompt log-probs computed alone, and the step-by-step schedule."""
from __future__ import annotations

import pytest

from checkpoints import hf_greedy, random_prompt
from schedule_log import drain, record
from engine.core import step_cost

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


@pytest.mark.parametrize("budget", [64, 512])  # over several steps, and in one
def test_n_sequences_of_one_prompt_prefill_it_once(ckpt_dir, hf_model, budget):
    from engine import LLM

    llm = LLM(str(ckpt_dir(KIND)), dtype="float32", num_gpu_blocks=256, max_num_batched_tokens=budget, seed=0)
    core = llm.engine
    steps = record(core)
    reqs = [core.make_request(f"s{j}", PROMPT, _params()) for j in range(4)]
    other = core.make_request("other", random_prompt(20, 4301), _params())
    for r in (*reqs, other):
        core.add_request(r)
    drain(core, [*reqs, other])
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
        steps = record(core)
        reqs = [core.make_request(f"s{j}", PROMPT, _params()) for j in range(2)]
        for r in reqs:
            core.add_request(r)
        core.step()
        assert steps[0] == {"s0": 200, "s1": 200}
        drain(core, reqs)
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
        monkeypatch.setattr(core.scheduler.expensive.share, "observe", lambda *a: None)  # unfitted: a fixed schedule
        steps = record(core)
        probe_prompt = random_prompt(10, 4302)
        probe = core.make_request("probe", probe_prompt, _params(4))
        core.add_request(probe)
        core.step()  # the probe is decoding
        scored = core.make_request("scored", PROMPT, _params(1, prompt_logprobs=3))
        core.add_request(scored)
        drain(core, [probe, scored])
        cap = step_cost.PROMPT_LOGPROBS_UNFITTED
        with_probe = [s["scored"] for s in steps if "scored" in s and "probe" in s]
        alone = [s["scored"] for s in steps if "scored" in s and "probe" not in s]
        assert with_probe and all(n <= cap for n in with_probe), steps
        assert alone and max(alone) == step_cost.PROMPT_LOGPROBS_UNFITTED_ALONE  # bigger bites once it is done
        assert sum(with_probe) + sum(alone) == 200
        assert probe.output_token_ids == hf_greedy(hf_model(KIND), probe_prompt, 4)
        assert len(scored.prompt_logprobs) == 199
        for (rank, lps), want in zip(scored.prompt_logprobs, want_plp[1:]):  # the first prompt token has none
            target = next(iter(want))
            assert rank == want[target].rank and set(lps) == set(want)
            assert [lps[t] for t in want] == pytest.approx([w.logprob for w in want.values()], abs=1e-4)
    finally:
        llm.close()


def _fitted(share: float = 0.5, alone: float = 3.0):
    """A controller that has seen plain steps of 30 ms + 1 ms a token."""
    from engine.core.step_cost import ShareController

    ctl = ShareController(share, alone, 16, 128)
    assert ctl.allowance(4) == 16 and ctl.allowance(0) == 128  # nothing measured: fixed counts
    for tokens in (1, 2, 4, 64, 128, 1, 3):
        ctl.observe(tokens, 0.030 + 0.001 * tokens, 0, None)
    return ctl


def test_expensive_work_is_paid_from_a_bucket_of_the_others_time():
    """Bites cost 10 ms fixed + 1 ms a token beyond the others' step. Each step beside others adds
    share * their step time (0.5 * 34 ms) to the bucket, up to `alone` steps' worth; a bite takes
    what the bucket covers, and its measured extra time is taken out."""
    ctl = _fitted()
    assert ctl.allowance(4) == 16  # no bite measured yet
    for n in (16, 4, 8, 2, 12):
        ctl.observe(4 + n, 0.034 + 0.010 + 0.001 * n, n, n)
    ctl.credit = 0.0
    assert ctl.allowance(4) == 7  # (17 - 10) / 1
    assert ctl.allowance(4) == 24  # nothing spent: 34 ms in the bucket
    for _ in range(10):
        ctl.allowance(4)
    assert ctl.allowance(4) == 92  # at most 3 steps' worth: (102 - 10) / 1
    ctl.observe(4 + 92, 0.034 + 0.010 + 0.092, 92, 92)
    assert ctl.allowance(4) == 7  # spent: 102 - 102 + 17
    assert ctl.allowance(0) == 80  # alone: bites of 3 plain steps' cost, (90 - 10) / 1


def test_bites_of_one_size_are_priced_by_their_mean_cost():
    ctl = _fitted()
    ctl.observe(1 + 16, 0.031 + 0.032, 16, 16)  # 2 ms a token, fixed part included
    ctl.credit = 0.0
    assert ctl.allowance(1) == 7  # 15.5 ms / 2 ms


def test_a_full_bucket_buys_a_token_whatever_the_fit_says():
    """A bite's fixed part measured above `alone` plain steps (a loaded CI machine) priced every
    allowance at 0 tokens: alone the work never ran and the engine raised "no progress"."""
    ctl = _fitted()
    for n in (16, 4, 8, 2, 12):
        ctl.observe(n, 0.030 + 0.200 + 0.001 * n, n, n)  # alone, 200 ms fixed: more than 3 * 30 ms
    assert ctl.allowance(0) == 1
    ctl.credit = 0.0
    assert ctl.allowance(4) == 0  # beside others: the bucket fills first
    for _ in range(8):
        ctl.allowance(4)
    assert ctl.allowance(4) == 1  # full (3 plain steps' worth): one token


def test_plain_steps_of_one_size_keep_the_bucket_in_force():
    """Beside a probe, every plain step is its 1-token decode (its prefills ride with a bite), so
    the plain fit loses its slope. Their mean is then their cost: the bucket goes on, instead of
    the unfitted counts (16 tokens every step, 128 alone) that let a bite take 3.5x a probe's step."""
    ctl = _fitted()
    for n in (16, 4, 8, 2, 12):
        ctl.observe(1 + n, 0.031 + 0.010 + 0.001 * n, n, n)
    for _ in range(400):  # the fit's memory is ~50 steps: only 1-token steps are left in it
        ctl.observe(1, 0.031, 0, None)
    assert ctl.fit.coefficients() is None
    ctl.credit = 0.0
    assert ctl.allowance(1) == 5  # (0.5 * 31 ms - 10 ms) / 1 ms, not 16
    assert ctl.allowance(0) == 83  # alone: (3 * 31 ms - 10 ms) / 1 ms, not 128


def test_the_scheduler_cuts_prompt_logprob_chunks_to_the_allowance(ckpt_dir, monkeypatch):
    """Alone, the scored request takes the alone allowance; beside the probe (waiting or
    running), the allowance beside others; everything else is the oracle's schedule."""
    from engine import LLM

    llm = LLM(str(ckpt_dir(KIND)), dtype="float32", num_gpu_blocks=256, max_num_batched_tokens=512)
    try:
        core = llm.engine
        monkeypatch.setattr(core.scheduler.expensive.share, "allowance", lambda others: 7 if others else 90)
        steps = record(core)
        scored = core.make_request("scored", random_prompt(300, 4303), _params(1, prompt_logprobs=1))
        core.add_request(scored)
        core.step()
        probe = core.make_request("probe", random_prompt(10, 4304), _params(3))
        core.add_request(probe)
        drain(core, [scored, probe])
        assert steps[0] == {"scored": 90}
        assert steps[1] == {"scored": 7, "probe": 10}  # the probe waiting counts as other work
        assert all(s["scored"] == 7 for s in steps[2:4])
        assert sum(s.get("scored", 0) for s in steps) == 300
    finally:
        llm.close()


def test_the_sequences_of_a_prompt_logprobs_request_wait_for_its_prefill(engine):
    """The first sequence computes the prompt with its log-probs (no cache reads); the others,
    without log-probs, wait for its blocks instead of computing the prompt themselves."""
    core = engine
    steps = record(core)
    first = core.make_request("s0", PROMPT, _params(1, prompt_logprobs=2))
    rest = [core.make_request(f"s{j}", PROMPT, _params(1)) for j in (1, 2)]
    for r in (first, *rest):
        core.add_request(r)
    drain(core, [first, *rest])
    assert sum(s.get("s0", 0) for s in steps) == 200
    assert all(sum(s.get(r.request_id, 0) for s in steps) == 8 for r in rest), steps
    assert all(r.output_token_ids == first.output_token_ids for r in rest)
