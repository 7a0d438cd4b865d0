"""server.api_output.encode_body renders a response body exactly as JSONResponse's json.dumps would
(the oracle), whatever its shape: it splits large lists, shares repeated ones and joins once."""
import json
import random
from types import SimpleNamespace

import pytest

from server.api_output import CHUNK, encode_body, heavy_output


def _oracle(body):
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


def test_n_choices_sharing_one_large_prompt_logprobs_list():
    rng = random.Random(0)
    shared = [None] + [{str(rng.randrange(50_000)): {"logprob": -rng.random(), "rank": i, "decoded_token": "é\n\""}
                        for i in range(3)} for _ in range(5 * CHUNK + 7)]
    body = {"id": "x", "choices": [{"index": i, "text": "t", "prompt_logprobs": shared} for i in range(4)],
            "usage": {"prompt_tokens": 1}}
    assert encode_body(body) == _oracle(body)


@pytest.mark.parametrize("body", [
    {}, {"a": []}, {"a": {}}, {"a": [1, {"b": [None, True, "ü"]}], "c": list(range(CHUNK))},
    {"a": list(range(CHUNK + 1))}, {"deep": [[[[[[1, [2]]]]]]]}, {"a": [[] for _ in range(CHUNK * 2)]},
])
def test_shapes(body):
    assert encode_body(body) == _oracle(body)


def test_nan_is_refused_as_jsonresponse_refuses_it():
    with pytest.raises(ValueError):
        encode_body({"choices": [{"x": float("nan")}]})


@pytest.mark.parametrize("fields,heavy", [
    ({}, False), ({"logprobs": None, "prompt_logprobs": None}, False), ({"logprobs": 0}, False),
    ({"logprobs": 5}, True), ({"logprobs": True}, True), ({"prompt_logprobs": 0}, True),
])
def test_responses_with_log_probs_are_built_at_low_priority(fields, heavy):
    assert heavy_output(SimpleNamespace(**fields)) is heavy
