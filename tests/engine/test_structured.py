"""Issue 17: structured outputs in the engine (engine/sample/structured.py, xgrammar), on the demo model
(a real byte-level tokenizer: the test checkpoints' word vocabulary has no JSON punctuation).
Oracles: the regex / choice / JSON parser itself; the unconstrained output as the control that
the constraint changed something; sync vs async scheduling and a speculating engine for identity."""
from __future__ import annotations

import json
import re

import pytest

from engine.sampling_params import SamplingParams
from engine.sample.structured import StructuredOutputsParams

PROMPT = "The phone number of the office is"


@pytest.fixture(scope="module")
def demo_dir():
    from engine.demo.demo_model import ensure_demo_model

    try:
        return ensure_demo_model()
    except FileNotFoundError as e:
        pytest.skip(str(e))


def _texts(llm, sps, prompt=PROMPT):
    outs = llm.generate([prompt] * len(sps), sps, use_tqdm=False)
    return [o.outputs[0].text for o in outs], [o.outputs[0].finish_reason for o in outs]


@pytest.mark.parametrize("mode", ["sync", "async", "ngram"])
def test_constraints_hold_and_match_across_engines(demo_dir, mode):
    from engine import LLM

    kw = {"async": {"async_scheduling": True},
          "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}}.get(mode, {})
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    sps = [SamplingParams(temperature=0, max_tokens=30, structured_outputs={"regex": regex}),
           SamplingParams(temperature=0, max_tokens=30, structured_outputs={"choice": ["yes", "no", "maybe"]}),
           SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": schema}),
           SamplingParams(temperature=1.0, seed=7, max_tokens=60, structured_outputs={"json": json.dumps(schema)}),
           SamplingParams(temperature=0, max_tokens=30)]  # unconstrained, in the same batch
    with LLM(str(demo_dir), dtype="float32", num_gpu_blocks=128, **kw) as llm:
        texts, reasons = _texts(llm, sps)
    assert re.fullmatch(regex, texts[0]) and texts[1] in ("yes", "no", "maybe"), texts
    for t in texts[2:4]:
        obj = json.loads(t)
        assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and obj["n"] in (1, 2, 3)
    assert reasons[:4] == ["stop"] * 4
    assert not re.fullmatch(regex, texts[4])  # control: the constraint is what made the first match
    if mode == "sync":
        pytest.texts = texts  # compared by the later modes
    else:
        assert texts == pytest.texts


@pytest.mark.parametrize("bad, match", [
    ({"json": "{not json"}, "json"), ({"regex": "("}, "regex"), ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"), ({"choice": []}, "choice"), ({"frob": 1}, "keys"),
])
def test_bad_constraints_are_value_errors_before_anything_runs(demo_dir, bad, match):
    from engine import LLM

    with LLM(str(demo_dir), dtype="float32", num_gpu_blocks=32) as llm:
        with pytest.raises(ValueError, match=match):
            llm.generate([PROMPT], SamplingParams(max_tokens=2, structured_outputs=bad), use_tqdm=False)
        assert llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_ignore_eos_cannot_be_combined():
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))


def test_prefetched_masks_are_those_of_the_state_at_sampling(demo_dir):
    """Masks filled on the mask thread during the forward equal a fresh matcher's at the same
    point; a mask filled before the state moved on is not used."""
    import torch

    from engine.runner.loader import load_tokenizer
    from engine.sample.structured import GrammarCompiler, MaskPrefetch

    tok = load_tokenizer(demo_dir)
    gc = GrammarCompiler(tok, 49152, frozenset({tok.eos_token_id}))
    params = StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}")
    prefetched, fresh, masks = gc.matcher(params), gc.matcher(params), MaskPrefetch()
    text_ids = tok.encode("(415) 555", add_special_tokens=False)
    for step, t in enumerate(text_ids):
        masks.start([prefetched])
        masks.wait()
        if step == 2:  # the state moves on after the fill: that mask is stale and must not be applied
            prefetched.accept(t)
            fresh.accept(t)
            a, b = prefetched.mask(torch.zeros(49152)), fresh.mask(torch.zeros(49152))
            assert torch.equal(torch.isinf(a), torch.isinf(b))
            continue
        a, b = prefetched.mask(torch.zeros(49152)), fresh.mask(torch.zeros(49152))
        assert torch.equal(torch.isinf(a), torch.isinf(b)) and not torch.isinf(a[t])
        prefetched.accept(t)
        fresh.accept(t)
    a, b = prefetched.mask(torch.zeros(49152)), fresh.mask(torch.zeros(49152))
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    masks.close()
