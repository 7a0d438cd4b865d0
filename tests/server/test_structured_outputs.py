"""Issue 17, acceptance 1 (structured outputs and logit_bias), with the official `openai` client
against `kvtier serve` on the demo model (SmolLM2-135M-Instruct, a real byte-level tokenizer).
Oracle: `json.loads` and a check of every schema rule the schema states; the regex and the
choice list themselves."""
from __future__ import annotations

import json
import re

import pytest


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"enum": ["Paris", "London", "Rome"]}}}
ASK = [{"role": "user", "content": "Describe a person as JSON with their name, age and city."}]


def _valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return (isinstance(obj, dict) and set(obj) == {"name", "age", "city"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 12 and type(obj["age"]) is int and 0 <= obj["age"] <= 120
            and obj["city"] in ("Paris", "London", "Rome"))


@pytest.fixture
def client(demo_server):
    import openai

    with openai.OpenAI(base_url=demo_server.v1, api_key="none", timeout=120, max_retries=0) as c:
        yield c


def test_json_schema_outputs_parse_and_validate_20_of_20_at_temperature_1(client, demo_server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    texts = []
    for seed in (1, 2):
        r = client.chat.completions.create(model=demo_server.model, messages=ASK, response_format=fmt, n=10,
                                           temperature=1.0, seed=seed, max_tokens=120)
        texts += [c.message.content for c in r.choices]
        assert all(c.finish_reason == "stop" for c in r.choices), [c.finish_reason for c in r.choices]
    assert len(texts) == 20 and all(_valid(t) for t in texts), [t for t in texts if not _valid(t)]


def test_json_object_streamed_reassembles_to_an_object(client, demo_server):
    stream = client.chat.completions.create(model=demo_server.model, messages=ASK, temperature=0, max_tokens=200,
                                            response_format={"type": "json_object"}, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert isinstance(json.loads(text), dict)


def test_vllm_structured_outputs_regex_and_choice(client, demo_server):
    r = client.completions.create(model=demo_server.model, prompt="My phone number is", max_tokens=20,
                                  temperature=1.0, seed=3, extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].text), r.choices[0].text
    r = client.chat.completions.create(model=demo_server.model, messages=[{"role": "user", "content": "Capital of France?"}],
                                       max_tokens=10, temperature=1.0, n=4, seed=4,
                                       extra_body={"guided_choice": ["Paris", "Lyon"]})
    assert {c.message.content for c in r.choices} <= {"Paris", "Lyon"}


def test_logit_bias_minus_100_never_produces_the_token(client, demo_server):
    free = client.completions.create(model=demo_server.model, prompt="The capital of France is", max_tokens=8,
                                     temperature=0, extra_body={"return_token_ids": True})
    banned = sorted(set(free.choices[0].token_ids))
    r = client.completions.create(model=demo_server.model, prompt="The capital of France is", max_tokens=8, n=8,
                                  temperature=1.0, seed=5, logit_bias={str(t): -100 for t in banned},
                                  extra_body={"return_token_ids": True})
    assert not {t for c in r.choices for t in c.token_ids} & set(banned)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, None),
    ({"guided_regex": "a", "guided_choice": ["b"]}, None),
])
def test_bad_constraints_are_400s(client, demo_server, extra, param):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=demo_server.model, messages=ASK, max_tokens=5, extra_body=extra)
    if param:
        assert e.value.body["param"] == param, e.value.body


def test_vllm_guided_names_are_served_like_structured_outputs(client, demo_server):
    """vLLM's older guided_json / guided_regex / guided_grammar fields."""
    ask = [{"role": "user", "content": "Is Paris in France?"}]
    r = client.chat.completions.create(model=demo_server.model, messages=ask, max_tokens=40, temperature=1.0, seed=6,
                                       extra_body={"guided_json": {"type": "object", "additionalProperties": False,
                                                                   "properties": {"yes": {"type": "boolean"}},
                                                                   "required": ["yes"]}})
    assert isinstance(json.loads(r.choices[0].message.content)["yes"], bool)
    r = client.chat.completions.create(model=demo_server.model, messages=ask, max_tokens=10, temperature=1.0, seed=7,
                                       extra_body={"guided_regex": "(yes|no), [a-z]{1,5}"})
    assert re.fullmatch("(yes|no), [a-z]{1,5}", r.choices[0].message.content)
    r = client.chat.completions.create(model=demo_server.model, messages=ask, max_tokens=10, temperature=1.0, seed=8,
                                       extra_body={"guided_grammar": 'root ::= ("Yes" | "No") "."'})
    assert r.choices[0].message.content in ("Yes.", "No.")
