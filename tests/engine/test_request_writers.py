"""After admission a `Request` has one writer (issue 40): its own methods and the scheduler's
update path. Checked by running: every attribute write to an admitted request is recorded with
the module that made it, over a workload that takes every path that advances a request (prompt
chunks, prefix hits, G2 offload, ngram speculation, async scheduling, stop strings, log-probs,
prompt log-probs, an abort)."""
from __future__ import annotations

import collections
import sys

import pytest

from engine import LLM, SamplingParams
from engine.core.engine_core import EngineCore
from engine.core.request import Request

KIND = "llama"
OWNERS = {"engine.core.request", "engine.core.scheduler"}
WORKLOADS = {
    "sync": {"max_num_batched_tokens": 32},
    "async": {"async_scheduling": True},
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
    "offload": {"kv_offloading_size": 0.01},
}


@pytest.fixture
def writes(monkeypatch):
    """(writer module, attribute) -> count, for writes to requests after add_request."""
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    admitted: set[int] = set()
    plain = object.__setattr__

    def spy(self, name, value):
        if id(self) in admitted:
            seen[(sys._getframe(1).f_globals.get("__name__", "?"), name)] += 1
        plain(self, name, value)

    add = EngineCore.add_request

    def add_request(self, req):
        admitted.add(id(req))
        return add(self, req)

    monkeypatch.setattr(Request, "__setattr__", spy)
    monkeypatch.setattr(EngineCore, "add_request", add_request)
    return seen


@pytest.mark.parametrize("mode", list(WORKLOADS))
def test_only_the_request_and_the_scheduler_write_an_admitted_request(ckpt_dir, writes, mode):
    llm = LLM(str(ckpt_dir(KIND)), dtype="float32", num_gpu_blocks=128, seed=0, **WORKLOADS[mode])
    try:
        doc = list(range(200, 260)) * 2  # repeats: ngram proposals get accepted
        prompts = [{"prompt_token_ids": doc}, {"prompt_token_ids": doc + [7, 8]}, {"prompt_token_ids": [5, 6, 7]}]
        params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                  SamplingParams(max_tokens=12, temperature=0, logprobs=2, prompt_logprobs=2, ignore_eos=True),
                  SamplingParams(max_tokens=12, temperature=0.8, seed=1, stop=["a"], ignore_eos=True)]
        llm.generate(prompts, params, use_tqdm=False)
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # prefix (and G2) hits
        core = llm.engine
        core.add_request(core.make_request("gone", doc, SamplingParams(max_tokens=50, temperature=0)))
        core.step()
        core.abort_request("gone")
        while core.has_unfinished():
            core.step()
    finally:
        llm.close()
    assert writes, "the spy saw no write: it is not wired"
    outside = sorted({w for w in writes if w[0] not in OWNERS})
    assert not outside, f"written from outside the request and the scheduler: {outside}"
