"""vLLM's render endpoints on a real `kvtier serve` (server/render.py).

Oracles: the checkpoint's own tokenizer through transformers (`apply_chat_template`, `encode`) for
the token ids; vLLM's truncation rule ("left" keeps the last N tokens, "right" the first N); and
the request-field inventory of tests/server/test_request_fields.py, which the render endpoints
follow as their generation endpoints do. tests/server/test_speculators_oracle.py runs
`speculators prepare-data --render-endpoint` against it.
"""
from __future__ import annotations

import pytest
from test_request_fields import CHAT_ONLY, COMMON, COMPLETION_ONLY, REFUSED
from test_serve_errors import assert_openai_error
from transformers import AutoTokenizer

CHAT = "/v1/chat/completions/render"
COMPLETIONS = "/v1/completions/render"
MESSAGES = [{"role": "system", "content": "you are a helpful assistant"},
            {"role": "user", "content": "what is the capital of france ?"}]
# vLLM's GenerateRequest, plus the rendered text
KEYS = {"request_id", "token_ids", "features", "sampling_params", "model", "stream", "stream_options", "cache_salt",
        "priority", "kv_transfer_params", "prompt"}


@pytest.fixture(scope="module")
def tok(ckpt_dir):
    return AutoTokenizer.from_pretrained(ckpt_dir("llama"))


def post(server, path: str, body: dict):
    with server.client(timeout=60) as c:
        return c.post(path, json=body)


def test_chat_render_is_the_chat_template(tiny_server, tok):
    want = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    r = post(tiny_server, CHAT, {"messages": MESSAGES, "temperature": 0.5, "max_tokens": 7, "seed": 3,
                                 "request_id": "r-1", "cache_salt": "salt", "priority": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == KEYS
    assert body["token_ids"] == want
    assert body["prompt"] == tok.decode(want, skip_special_tokens=False)
    assert body["features"] is None and body["kv_transfer_params"] is None and body["stream"] is False
    assert (body["request_id"], body["model"], body["cache_salt"], body["priority"]) == ("r-1", "tiny", "salt", 2)
    sp = body["sampling_params"]
    assert (sp["temperature"], sp["max_tokens"], sp["seed"]) == (0.5, 7, 3)
    with tiny_server.client() as c:  # the same ids the generation endpoint runs
        assert c.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"] == want
    without = post(tiny_server, CHAT, {"messages": MESSAGES, "add_generation_prompt": False}).json()["token_ids"]
    assert without == tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=True, return_dict=False)


def test_truncation_keeps_vllms_side(tiny_server, tok):
    full = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)

    def ids(**extra):
        r = post(tiny_server, CHAT, {"messages": MESSAGES, **extra})
        assert r.status_code == 200, r.text
        return r.json()["token_ids"]

    assert ids(truncate_prompt_tokens=5, truncation_side="right") == full[:5]   # speculators' choice
    assert ids(truncate_prompt_tokens=5, truncation_side="left") == full[-5:]
    assert ids(truncate_prompt_tokens=5) == full[-5:]                           # vLLM's default side
    assert ids(truncate_prompt_tokens=len(full) + 10, truncation_side="right") == full
    assert ids(truncate_prompt_tokens=-1) == full                               # as many as fit
    assert ids(truncation_side="right") == full                                 # a side alone truncates nothing
    too_many = post(tiny_server, CHAT, {"messages": MESSAGES, "truncate_prompt_tokens": 5000})
    assert "max_model_len" in assert_openai_error(too_many, 400, "truncate_prompt_tokens")["message"]
    assert_openai_error(post(tiny_server, CHAT, {"messages": MESSAGES, "truncate_prompt_tokens": 0}), 400, "prompt")
    assert_openai_error(post(tiny_server, CHAT, {"messages": MESSAGES, "truncate_prompt_tokens": -2}), 400,
                        "truncate_prompt_tokens")
    assert_openai_error(post(tiny_server, CHAT, {"messages": MESSAGES, "truncation_side": "middle"}), 400,
                        "truncation_side")


def test_completions_render_one_per_prompt(tiny_server, tok):
    r = post(tiny_server, COMPLETIONS, {"prompt": ["hello world", "the capital of france"], "max_tokens": 3})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["token_ids"] for o in out] == [tok.encode("hello world"), tok.encode("the capital of france")]
    assert all(set(o) == KEYS and o["sampling_params"]["max_tokens"] == 3 for o in out)
    assert len({o["request_id"] for o in out}) == 2
    ids = post(tiny_server, COMPLETIONS, {"prompt": [7, 8, 9, 10], "truncate_prompt_tokens": 2}).json()
    assert [o["token_ids"] for o in ids] == [[9, 10]]


def test_bad_requests_are_openai_errors(tiny_server):
    assert_openai_error(post(tiny_server, CHAT, {"messages": []}), 400, "messages")
    assert_openai_error(post(tiny_server, CHAT, {"messages": MESSAGES, "model": "other"}), 404, "model")
    assert_openai_error(post(tiny_server, COMPLETIONS, {"prompt": [99999]}), 400, "prompt")  # outside the vocabulary
    long = post(tiny_server, COMPLETIONS, {"prompt": [7] * 3000})
    assert "maximum context length" in assert_openai_error(long, 400, "prompt")["message"]
    r = post(tiny_server, CHAT, {"messages": MESSAGES, "tool_choice": "required"})  # no tools to require
    assert_openai_error(r, 400, "tools")


# Every field of the generation endpoints' inventory, on their render endpoints: a refused field is
# refused here too, the rest render (truncation is render's own).
RENDER_CASES = [(CHAT, f, v, s) for f, (v, s) in {**COMMON, **CHAT_ONLY}.items() if v is not None] + \
    [(COMPLETIONS, f, v, s) for f, (v, s) in {**COMMON, **COMPLETION_ONLY}.items() if v is not None]


@pytest.mark.parametrize("path, field, value, status", RENDER_CASES,
                         ids=[f"{p.split('/')[-2]}-{f}" for p, f, *_ in RENDER_CASES])
def test_every_field_renders_or_is_refused_as_in_generation(tiny_server, path, field, value, status):
    if field == "truncate_prompt_tokens":
        status = "implemented"
    body = {"max_tokens": 3, field: value}
    if field == "tools":
        body["tool_choice"] = "none"
    if field == "top_logprobs":
        body["logprobs"] = True
    if field == "stream_options":
        body["stream"] = True
    body.update({"messages": MESSAGES} if path == CHAT else {"prompt": "hello world"})
    r = post(tiny_server, path, body)
    if status == REFUSED:
        err = assert_openai_error(r, 400)
        assert field in err["message"] or err["param"] == field, err
    else:
        assert r.status_code == 200, (field, r.text)
