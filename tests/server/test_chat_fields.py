"""Issue 17: chat request fields that shape the prompt or the response — continue_final_message,
reasoning_effort (a template variable, as in vLLM), system_fingerprint, completion_tokens_details.
Oracle: the tokenizer's own apply_chat_template on the same messages."""
from __future__ import annotations

import pytest

from checkpoints import build_tokenizer
from serving import start_server
from test_serve_errors import assert_openai_error

CONV = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the capital of"}]
# The test vocabulary is words: the template says "yes" for high effort, "no" otherwise.
EFFORT_TEMPLATE = "{{ bos_token }}{% if reasoning_effort == 'high' %}yes{% else %}no{% endif %} {{ messages[0]['content'] }}"


@pytest.fixture(scope="module")
def trusting_server(ckpt_dir):
    srv = start_server(str(ckpt_dir("llama")), "--num-gpu-blocks", "64", "--trust-request-chat-template")
    yield srv
    srv.stop()


def test_continue_final_message_leaves_the_assistant_turn_open(tiny_server):
    want = build_tokenizer().apply_chat_template(CONV, continue_final_message=True, tokenize=True,
                                                 return_dict=False)
    closed = build_tokenizer().apply_chat_template(CONV, add_generation_prompt=False, tokenize=True,
                                                   return_dict=False)
    assert want != closed
    with tiny_server.client() as c:
        r = c.post("/tokenize", json={"messages": CONV, "continue_final_message": True})
        assert r.status_code == 200 and r.json()["tokens"] == list(want), r.text
        r = c.post("/v1/chat/completions", json={"messages": CONV, "continue_final_message": True,
                                                 "add_generation_prompt": False, "max_tokens": 2,
                                                 "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["prompt_token_ids"] == list(want), r.text


@pytest.mark.parametrize("body, needle", [
    ({"messages": CONV, "continue_final_message": True, "add_generation_prompt": True}, "add_generation_prompt"),
    ({"messages": CONV[:1], "continue_final_message": True}, "assistant"),
])
def test_continue_final_message_misuse_is_a_400(tiny_server, body, needle):
    with tiny_server.client() as c:
        err = assert_openai_error(c.post("/v1/chat/completions", json={**body, "max_tokens": 2}), 400)
    assert needle in err["message"], err


def test_reasoning_effort_reaches_the_template(trusting_server):
    with trusting_server.client() as c:
        for effort, word in (("low", "no"), ("high", "yes")):
            r = c.post("/v1/chat/completions", json={"messages": CONV[:1], "reasoning_effort": effort, "max_tokens": 1,
                                                     "chat_template": EFFORT_TEMPLATE, "return_token_ids": True})
            assert r.status_code == 200, r.text
            text = build_tokenizer().decode(r.json()["choices"][0]["prompt_token_ids"], skip_special_tokens=True)
            assert text == f"{word} hello"
        err = assert_openai_error(c.post("/v1/chat/completions", json={"messages": CONV[:1], "max_tokens": 1,
                                                                       "reasoning_effort": "extreme"}), 400)
        assert "reasoning_effort" in (err["param"] or "") + err["message"]


def test_fingerprint_and_token_details_are_reported(tiny_server):
    with tiny_server.client() as c:
        a = c.post("/v1/chat/completions", json={"messages": CONV[:1], "max_tokens": 2}).json()
        b = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).json()
        chunks = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "stream": True}).text
    assert a["system_fingerprint"] == b["system_fingerprint"] and a["system_fingerprint"].startswith("fp_")
    assert a["system_fingerprint"] in chunks
    assert a["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
