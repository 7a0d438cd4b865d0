"""server/limits.py: the request cost bounds of issue 38 (the server-level behaviour is in
test_hostile_requests.py). Oracles: hand-counted shapes, and the limits' own definitions."""
from __future__ import annotations

import json

import pytest

from engine.sample.structured import StructuredOutputsParams
from server.limits import LimitExceeded, RequestLimits, check_constraint, check_lists, schema_shape
from server.protocol import ChatCompletionRequest, CompletionRequest


def _nested(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def test_schema_shape_counts_nesting_and_enums_without_recursion():
    assert schema_shape({"type": "string"}) == (1, 0)
    assert schema_shape({"enum": [1, 2, 3], "x": [{"enum": ["a"]}, []]}) == (4, 4)  # dict, list, dict, list
    # each schema level is two JSON levels (the schema, its properties); 10,000 levels need no recursion
    assert schema_shape(_nested(10_000)) == (20_001, 0)


def test_from_json_overrides_and_names_unknown_or_bad_limits():
    lim = RequestLimits.from_json('{"bad_words": 4096, "compile_timeout_s": 2.5}')
    assert lim.bad_words == 4096 and lim.compile_timeout_s == 2.5 and lim.tools == RequestLimits.tools
    assert RequestLimits.from_json(None) == RequestLimits()
    for text, named in (('{"bad_word": 1}', "bad_word"), ('{"tools": 0}', "tools"), ('{"tools": 1.5}', "tools"),
                        ("[1]", "JSON object"), ("{", "not valid JSON"), ('{"choice": true}', "choice")):
        with pytest.raises(ValueError, match=named):
            RequestLimits.from_json(text)
    assert "bad_words 256" in RequestLimits.describe()


@pytest.mark.parametrize("field,value,limit", [
    ("bad_words", ["w"] * 257, "bad_words"),
    ("logit_bias", {str(i): 1.0 for i in range(1025)}, "logit_bias"),
    ("allowed_token_ids", list(range(3)) * 21846, "allowed_token_ids"),
    ("stop_token_ids", [5] * 257, "stop_token_ids"),
])
def test_list_fields_over_their_limit_are_named(field, value, limit):
    req = CompletionRequest.model_validate({"prompt": "hi", field: value})
    with pytest.raises(LimitExceeded, match=rf"{field} has {len(value)} entries; .* at most .*--request-limits {limit}") as e:
        check_lists(req, RequestLimits())
    assert e.value.param == field
    check_lists(req, RequestLimits(**{limit: len(value)}))  # at the limit: fine


def test_tools_over_the_limit():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [tool] * 129})
    with pytest.raises(LimitExceeded, match="tools has 129 tools"):
        check_lists(req, RequestLimits())
    check_lists(req, RequestLimits(tools=129))


@pytest.mark.parametrize("so,named", [
    ({"choice": [f"c{i}" for i in range(1025)]}, "1025 choices"),
    ({"choice": ["x" * 70_000]}, "70000 characters of choices"),
    ({"regex": "a" * 16_385}, "characters of regex"),
    ({"grammar": "root ::= " + '"a" ' * 20_000}, "characters of grammar"),
    ({"json": _nested(32)}, "65 levels of nesting"),
    ({"json": json.dumps(_nested(32))}, "65 levels of nesting"),
    ({"json": {"type": "object", "properties": {f"p{i}": {"enum": list(range(11))} for i in range(100)}}},
     "1100 enum values"),
    ({"json": {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 200}
                                                for i in range(1000)}}}, "bytes of JSON schema"),
])
def test_constraints_over_their_limits_are_named(so, named):
    with pytest.raises(LimitExceeded, match=named) as e:
        check_constraint("structured_outputs", StructuredOutputsParams.coerce(so), RequestLimits())
    assert e.value.param == "structured_outputs"


def test_constraints_within_the_limits_pass():
    for so in ({"choice": [f"c{i}" for i in range(1024)]}, {"json": _nested(31)}, {"regex": "[a-z]+"},
               {"json_object": True}, {"grammar": 'root ::= "a"'}):
        check_constraint("structured_outputs", StructuredOutputsParams.coerce(so), RequestLimits())


def test_a_checked_schema_is_sent_as_its_canonical_text():
    """The engine core keys (and compiles) a schema by its text: the server sends one text per
    schema however it was spelled, so the core never sorts or re-encodes a tree on its step loop."""
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spelled = '{ "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},  "type": "object" }'
    got = [check_constraint("response_format", StructuredOutputsParams(json=s, disable_any_whitespace=w), RequestLimits())
           for s in (schema, spelled) for w in (False, True)]
    assert got[0].json == got[2].json == json.dumps(schema, sort_keys=True, separators=(",", ":"))
    assert [g.key() for g in got] == [("json", got[0].json), ("compact_json", got[0].json)] * 2
    for bad, why in (("{not json", "not valid JSON"), ("[1]", "JSON schema object")):
        with pytest.raises(ValueError, match=why):
            check_constraint("response_format", StructuredOutputsParams.coerce({"json": bad}), RequestLimits())
