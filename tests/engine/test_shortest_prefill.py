"""`--scheduling-policy shortest_prefill`: the prompt with the fewest tokens left (after its G1
prefix hits) goes first, a running long prompt sits out the steps that finish a shorter one, and it
cannot sit out more than MAX_PASSED_OVER steps in a row. Oracle: transformers' greedy tokens, and
the step-by-step schedule."""
from __future__ import annotations

import pytest

from checkpoints import hf_greedy, random_prompt
from schedule_log import drain, record

KIND = "llama"
LONG, SHORT = random_prompt(300, 4200), random_prompt(10, 4201)
MAX_TOKENS = 4


@pytest.fixture
def engine(ckpt_dir):
    from engine import LLM

    llm = LLM(str(ckpt_dir(KIND)), dtype="float32", num_gpu_blocks=256, max_num_batched_tokens=64,
              scheduling_policy="shortest_prefill", seed=0)
    yield llm.engine
    llm.close()


def _params(n: int = MAX_TOKENS):
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_short_prompt_goes_first_and_a_running_long_one_sits_out(engine, hf_model):
    core = engine
    steps = record(core)
    # Both waiting: the short one first, alone (its step carries no chunk of the long one).
    long_ = core.make_request("long", LONG, _params())
    short = core.make_request("short", SHORT, _params())
    core.add_request(long_)
    core.add_request(short)
    core.step()
    assert steps[0] == {"short": 10}
    # A short prompt arriving while the long one is mid-prefill: the long one sits out its step.
    core.step()
    assert steps[1] == {"short": 1, "long": 63}
    late = core.make_request("late", SHORT[:7], _params())
    core.add_request(late)
    core.step()
    assert steps[2] == {"short": 1, "late": 7}
    drain(core, [long_, short, late])
    model = hf_model(KIND)
    for r, p in ((long_, LONG), (short, SHORT), (late, SHORT[:7])):
        assert r.output_token_ids == hf_greedy(model, p, MAX_TOKENS), r.request_id


def test_cached_prefix_counts_as_done(engine):
    core = engine
    warm = core.make_request("warm", LONG, _params(1))
    core.add_request(warm)
    drain(core, [warm])
    steps = record(core)
    fresh = core.make_request("fresh", random_prompt(50, 4202), _params(1))
    hit = core.make_request("hit", LONG + SHORT, _params(1))  # 310 tokens, 288 of them in G1
    core.add_request(fresh)
    core.add_request(hit)
    core.step()
    assert steps[0] == {"hit": 310 - 288}  # 22 left: before the 50-token prompt, which would not finish


def test_a_long_prompt_sits_out_at_most_max_passed_over_steps_in_a_row(engine):
    from engine.core.scheduler import MAX_PASSED_OVER

    core = engine
    steps = record(core)
    long_ = core.make_request("long", LONG, _params(1))
    core.add_request(long_)
    core.step()  # the long prompt starts
    shorts = []
    for i in range(3 * MAX_PASSED_OVER):  # a new short prompt before every step
        shorts.append(core.make_request(f"s{i}", random_prompt(5, 4300 + i), _params(1)))
        core.add_request(shorts[-1])
        core.step()
        if long_.status.finished:
            break
    runs = [i for i, s in enumerate(steps) if "long" in s]
    gaps = [b - a - 1 for a, b in zip(runs, runs[1:])]
    assert gaps and max(gaps) == MAX_PASSED_OVER, gaps  # it sat out, and never longer than the bound
    drain(core, [long_, *shorts])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mixed_batch_gives_fcfs_tokens(ckpt_dir, async_scheduling):
    """Reordering never changes what a request computes: a mixed batch (shared prefixes, long and
    short prompts, preemption by a small G1) gives the same tokens as FCFS."""
    from engine import LLM

    prompts = [random_prompt(n, 4400 + n) for n in (300, 12, 150, 40, 7, 90)]
    prompts += [prompts[0][:200] + random_prompt(20, 4500), prompts[2] + random_prompt(5, 4501)]
    got = {}
    for policy in ("fcfs", "shortest_prefill"):
        llm = LLM(str(ckpt_dir(KIND)), dtype="float32", num_gpu_blocks=48, max_num_batched_tokens=64,
                  scheduling_policy=policy, async_scheduling=async_scheduling, seed=0)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(8), use_tqdm=False)
            got[policy] = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.close()
    assert got["shortest_prefill"] == got["fcfs"]
