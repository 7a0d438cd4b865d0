"""One request's failure stays that request's (issue 11, findings 1 and 6): token ids outside the
vocabulary are refused before queueing, an exception while stepping one request fails that
request alone, and degenerate sampling settings (a tiny temperature or top_p) behave like greedy
instead of returning token 0. Oracle: the engine's own greedy run, itself checked against
transformers in test_errors.py / test_sampling.py."""
from __future__ import annotations

import pytest

from checkpoints import random_prompt
# llm and expected are test_errors' fixtures (a module-scoped engine of this module's own)
from test_errors import GOOD, GOOD2, SP, _assert_still_works, _ids, expected, llm  # noqa: F401


def _greedy(llm, prompt, n=8):
    (out,) = llm.generate([_ids(prompt)], SP(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("bad", [-600, 100_000, 2**63 - 1, -(2**63)])
def test_stop_token_ids_outside_the_vocabulary_are_refused(llm, expected, bad):
    """The finding's repro ([-600], [100000], [2**63-1] with min_tokens=1) raised inside the sampler."""
    with pytest.raises(ValueError, match=r"stop_token_ids entry .* outside the vocabulary"):
        llm.generate([_ids(GOOD)], SP(temperature=0.0, max_tokens=4, min_tokens=1, stop_token_ids=[bad]),
                     use_tqdm=False)
    _assert_still_works(llm, expected)


def _add_unchecked(llm, rid, prompt, params):
    """A request that skipped validation (what a bug in a check, or a plugin, would let through)."""
    from engine.core.request import Request, RequestId

    core = llm.engine
    req = Request(RequestId(rid), prompt, params, eos_token_ids=core.eos_token_ids, max_total_tokens=core.max_model_len)
    core.add_request(req)
    return req


def _run(llm):
    core = llm.engine
    for _ in range(500):
        if not core.has_unfinished():
            return
        core.step()
    raise AssertionError("requests did not finish")


def test_a_request_that_breaks_the_sampler_fails_alone(llm):
    from engine.core.request import RequestStatus

    want = _greedy(llm, GOOD)
    good = _add_unchecked(llm, "good", GOOD, SP(temperature=0.0, max_tokens=8, ignore_eos=True))
    bad = _add_unchecked(llm, "bad", GOOD2, SP(temperature=0.0, max_tokens=8, min_tokens=2, stop_token_ids=[-600]))
    _run(llm)
    assert bad.status is RequestStatus.FINISHED_ERROR and "sampling failed" in bad.error
    assert good.status is RequestStatus.FINISHED_LENGTH and good.output_token_ids == want
    llm.engine.check_integrity()
    assert llm.engine.pool.usage() == 0 or llm.get_stats().num_running == 0


def test_a_request_that_breaks_the_forward_fails_alone(llm, monkeypatch):
    """The forward is rerun request by request to find the culprit; the others go on, token-identical."""
    from engine.core.request import RequestStatus

    want = [_greedy(llm, GOOD), _greedy(llm, GOOD2)]
    trigger = random_prompt(20, 6100)
    runner = llm.engine.runner
    real = runner.execute

    def execute(plan, tables):  # the runner sees a typed plan: the trigger is request r1
        if any(s.request_id == "r1" for s in plan.requests):
            raise RuntimeError("boom")
        return real(plan, tables)

    monkeypatch.setattr(runner, "execute", execute)
    reqs = [_add_unchecked(llm, f"r{i}", p, SP(temperature=0.0, max_tokens=8, ignore_eos=True))
            for i, p in enumerate([GOOD, trigger, GOOD2])]
    _run(llm)
    assert reqs[1].status is RequestStatus.FINISHED_ERROR and "boom" in reqs[1].error
    assert [reqs[0].output_token_ids, reqs[2].output_token_ids] == want
    llm.engine.check_integrity()


def test_an_error_every_request_hits_is_the_engines(llm, monkeypatch):
    """Nothing to blame on one request: the step raises (the server then reports the core dead)."""
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "execute", lambda sched, tables: (_ for _ in ()).throw(RuntimeError("device lost")))
    for i, p in enumerate([GOOD, GOOD2]):
        _add_unchecked(llm, f"e{i}", p, SP(temperature=0.0, max_tokens=4))
    with pytest.raises(RuntimeError, match="device lost"):
        llm.engine.step()
    monkeypatch.undo()
    for rid in ("e0", "e1"):
        llm.engine.abort_request(rid)
    _run(llm)


@pytest.mark.parametrize("params", [dict(temperature=1e-38), dict(temperature=1e-6), dict(temperature=1.0, top_p=1e-46),
                                    dict(temperature=0.7, top_p=1e-30, top_k=5), dict(temperature=1.0, min_p=1.0)],
                         ids=["temperature=1e-38", "temperature=1e-6", "top_p=1e-46", "top_p=1e-30,top_k=5", "min_p=1"])
def test_degenerate_sampling_settings_sample_the_top_token(llm, params):
    """temperature 1e-38 and top_p 1e-46 returned token 0 every step (float32 underflow/overflow);
    each of these keeps only the most likely token, so the output is the greedy one."""
    want = _greedy(llm, GOOD, 12)
    (out,) = llm.generate([_ids(GOOD)], SP(max_tokens=12, ignore_eos=True, seed=1, **params), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == want
