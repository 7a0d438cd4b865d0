"""Request fields the server does not implement: refused by name, never silently dropped.

OpenAI clients send fields a server may not know. A field that would change the answer and is
not implemented is a 400 naming it; a field on `HARMLESS` is accepted and ignored (documented in
the README). A field set to null, or to the value that means "off", is the same as leaving it out.
"""
from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from server.errors import APIError

_LONE_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

# Accepted and ignored: they label, route or bill a request, and cannot change its tokens.
HARMLESS: frozenset[str] = frozenset({
    "metadata", "store", "service_tier", "safety_identifier",
    "parallel_tool_calls",  # means something only with tools (chat); elsewhere it cannot change the answer
})

_TOOLS = "tool calling is for /v1/chat/completions (tools, tool_choice); functions/function_call are not supported"
# Fields a user of OpenAI or vLLM is likely to send, with why each is refused.
WHY: dict[str, str] = {
    "guided_json_object": "guided_json_object is not supported: use response_format {\"type\": \"json_object\"}",
    "guided_decoding_backend": "the grammar backend is xgrammar; guided_decoding_backend cannot choose another",
    "guided_whitespace_pattern": "guided_whitespace_pattern is not supported",
    "tools": _TOOLS, "tool_choice": _TOOLS, "functions": _TOOLS, "function_call": _TOOLS,
    "chat_template": "a request-supplied chat_template needs the server's --trust-request-chat-template",
}
# The value of a field that means "off": sending it changes nothing.
_OFF: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "functions": ([],), "tool_choice": ("none",),
    # SGLang's, at their defaults: vllm-router adds both to the /v1/completions/render call it makes
    # for kv_aware routing (stop strings are trimmed here, hidden states not returned: the same).
    "no_stop_trim": (False,), "return_hidden_states": (False,),
}


def unsupported(data: dict[str, Any], known: set[str], allowed: frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """(field, why) for the first field of `data` that is neither known, harmless, in `allowed`
    nor off; None when every field is fine. Names are checked in sorted order: one stable answer."""
    for name in sorted(data):
        value = data[name]
        if name in known or name in HARMLESS or name in allowed or value is None or value in _OFF.get(name, ()):
            continue
        return name, WHY.get(name, "this field is not supported, and ignoring it could change the answer")
    return None


def decode_body(body: bytes | bytearray, model: type[BaseModel], trust_chat_template: bool) -> Any:
    """A request body as `model`; an APIError (400) saying what is wrong with it: malformed JSON,
    an unsupported field (by name), an invalid value. `trust_chat_template`: a request's own
    chat_template is taken (--trust-request-chat-template), else refused by name."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if _LONE_SURROGATE_ESCAPE.search(body):  # only \uXXXX escapes can make one; they break every encoder
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise APIError(400, "malformed JSON body: a string holds an unpaired UTF-16 surrogate") from None
    known = set(model.model_fields)
    if not trust_chat_template:
        known.discard("chat_template")  # then refused by name, with the flag that allows it
    bad = unsupported(data, known)
    if bad is not None:
        raise APIError(400, f"unsupported field {bad[0]!r}: {bad[1]}", param=bad[0])
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"{loc + ': ' if loc else ''}{err['msg']}", param=loc or None) from None
