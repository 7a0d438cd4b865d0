"""Issue 17, acceptance 2: every request field of OpenAI's chat and completions schemas and of
vLLM's extensions is implemented (and named by another test), refused with a
400 naming it, or on the documented harmless list (`server/fields.py`'s HARMLESS). A field added
to either API shows up here as unclassified, which fails."""
from __future__ import annotations

from pathlib import Path

import pytest

from server.fields import HARMLESS
from test_serve_errors import CHAT, assert_openai_error

TESTS = Path(__file__).resolve().parents[1]
IMPLEMENTED, REFUSED, HARMLESS_ = "implemented", "refused", "harmless"

# field -> (a value that would change the answer, or a plain valid one; its status)
COMMON = {
    "model": (None, IMPLEMENTED),
    "frequency_penalty": (0.5, IMPLEMENTED),
    "presence_penalty": (0.5, IMPLEMENTED),
    "logit_bias": ({"7": -100}, IMPLEMENTED),
    "max_tokens": (3, IMPLEMENTED),
    "n": (2, IMPLEMENTED),
    "seed": (3, IMPLEMENTED),
    "stop": (["x"], IMPLEMENTED),
    "stream": (False, IMPLEMENTED),
    "stream_options": (None, IMPLEMENTED),
    "temperature": (0.5, IMPLEMENTED),
    "top_p": (0.9, IMPLEMENTED),
    "user": ("u", IMPLEMENTED),
    # vLLM's extensions
    "top_k": (5, IMPLEMENTED),
    "min_p": (0.1, IMPLEMENTED),
    "repetition_penalty": (1.2, IMPLEMENTED),
    "min_tokens": (1, IMPLEMENTED),
    "ignore_eos": (True, IMPLEMENTED),
    "stop_token_ids": ([7], IMPLEMENTED),
    "skip_special_tokens": (False, IMPLEMENTED),
    "priority": (1, IMPLEMENTED),
    "cache_salt": ("s", IMPLEMENTED),
    "return_token_ids": (True, IMPLEMENTED),
    "request_id": ("rid-1", IMPLEMENTED),
    "allowed_token_ids": ([7, 8], IMPLEMENTED),
    "bad_words": (["hello"], IMPLEMENTED),
    "response_format": ({"type": "json_object"}, IMPLEMENTED),
    "structured_outputs": ({"regex": "[a-z]+"}, IMPLEMENTED),
    "guided_json": ({"type": "object"}, IMPLEMENTED),
    "guided_regex": ("[a-z]+", IMPLEMENTED),
    "guided_choice": (["yes", "no"], IMPLEMENTED),
    "guided_grammar": ('root ::= "yes"', IMPLEMENTED),
    "guided_decoding_backend": ("outlines", REFUSED),
    "guided_whitespace_pattern": (" ", REFUSED),
    "guided_json_object": (True, REFUSED),
    "kv_transfer_params": ({"do_remote_prefill": True}, REFUSED),
    "prompt_logprobs": (1, IMPLEMENTED),
    "use_beam_search": (True, REFUSED),
    "length_penalty": (0.5, REFUSED),
    "include_stop_str_in_output": (True, REFUSED),
    "spaces_between_special_tokens": (False, REFUSED),
    "truncate_prompt_tokens": (4, REFUSED),
    "add_special_tokens": (True, REFUSED),
    "logits_processors": (["x"], REFUSED),
    "return_tokens_as_token_ids": (True, REFUSED),
    "vllm_xargs": ({"k": 1}, REFUSED),
    "thinking_token_budget": (None, IMPLEMENTED),  # needs a model with think markers (test_reasoning.py)
    "metadata": ({"k": "v"}, HARMLESS_),
    "store": (False, HARMLESS_),
    "service_tier": ("auto", HARMLESS_),
    "prompt_cache_key": ("k", IMPLEMENTED),
    "safety_identifier": ("s", HARMLESS_),
}
CHAT_ONLY = {
    "messages": (None, IMPLEMENTED),
    "max_completion_tokens": (3, IMPLEMENTED),
    "logprobs": (True, IMPLEMENTED),
    "top_logprobs": (2, IMPLEMENTED),
    "tools": ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], IMPLEMENTED),
    "tool_choice": ("none", IMPLEMENTED),
    "functions": ([{"name": "f", "parameters": {"type": "object"}}], REFUSED),
    "function_call": ("auto", REFUSED),
    "parallel_tool_calls": (True, IMPLEMENTED),
    "audio": ({"voice": "alloy", "format": "mp3"}, REFUSED),
    "modalities": (["text", "audio"], REFUSED),
    "prediction": ({"type": "content", "content": "x"}, REFUSED),
    "reasoning_effort": ("low", IMPLEMENTED),
    "verbosity": ("low", REFUSED),
    "web_search_options": ({}, REFUSED),
    "chat_template": ("{{ 'x' }}", REFUSED),  # accepted only with --trust-request-chat-template
    "chat_template_kwargs": ({"enable_thinking": False}, IMPLEMENTED),
    "add_generation_prompt": (True, IMPLEMENTED),
    "continue_final_message": (None, IMPLEMENTED),  # needs a final assistant message (test_chat_fields.py)
    "include_reasoning": (False, IMPLEMENTED),
    "documents": ([{"title": "t", "text": "x"}], REFUSED),
    "mm_processor_kwargs": ({"k": 1}, REFUSED),
    "echo": (True, REFUSED),
}
COMPLETION_ONLY = {
    "prompt": (None, IMPLEMENTED),
    "logprobs": (2, IMPLEMENTED),
    "echo": (True, REFUSED),
    "suffix": ("x", REFUSED),
    "best_of": (3, REFUSED),
    "parallel_tool_calls": (True, HARMLESS_),
}
CASES = [("/v1/chat/completions", f, *v) for f, v in {**COMMON, **CHAT_ONLY}.items()] + \
        [("/v1/completions", f, *v) for f, v in {**COMMON, **COMPLETION_ONLY}.items()]
# JSON constraints: tested on the demo model (tests/server/test_structured_outputs.py)
NEEDS_JSON_TOKENS = {"response_format", "guided_json"}
OTHER_TESTS = "\n".join(f.read_text() for f in TESTS.rglob("test_*.py") if f.name != Path(__file__).name)


def test_the_harmless_list_is_the_documented_one():
    listed = {f for _, f, _, status in CASES if status == HARMLESS_}
    assert listed == set(HARMLESS)
    readme = (TESTS.parent / "docs" / "serving.md").read_text()
    assert all(f"`{f}`" in readme for f in HARMLESS)


@pytest.mark.parametrize("path, field, value, status", CASES, ids=[f"{p.split('/')[-1]}-{f}" for p, f, *_ in CASES])
def test_every_field_is_implemented_refused_or_harmless(tiny_server, path, field, value, status):
    if status == IMPLEMENTED:
        assert f'"{field}"' in OTHER_TESTS or f"{field}=" in OTHER_TESTS, f"{field}: no other test names it"
    if value is None:  # the request's own subject (model, messages, prompt): every request has it
        return
    body = {"max_tokens": 3, field: value}
    if field == "tools":  # alone, tools mean tool_choice "auto", which needs --enable-auto-tool-choice
        body["tool_choice"] = "none"
    if field == "top_logprobs":  # it counts logprobs' alternatives
        body["logprobs"] = True
    body.update({"messages": CHAT} if "chat" in path else {"prompt": "hello world"})
    with tiny_server.client(timeout=60) as c:
        r = c.post(path, json=body)
        if status == REFUSED:
            err = assert_openai_error(r, 400)
            assert field in err["message"] or err["param"] == field, err
        elif field in NEEDS_JSON_TOKENS:  # the tiny checkpoint's word vocabulary has no "{": a clear 400
            err = assert_openai_error(r, 400, field)
            assert "vocabulary" in err["message"], err
        else:
            assert r.status_code == 200, (field, r.text)
