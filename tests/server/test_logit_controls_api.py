"""Issue 17: `logit_bias` (OpenAI), `allowed_token_ids` and `bad_words` (vLLM) through `kvtier
serve`. Oracle: the same server's unconstrained greedy tokens (the engine's controls themselves
are checked against transformers in tests/engine/test_logit_controls.py)."""
from __future__ import annotations

import pytest

from test_serve_errors import CHAT, assert_openai_error

PROMPT = "hello world what is the capital of france"


def _tokens(c, path, **kw):
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **kw}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": PROMPT})
    r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_logit_bias_bans_and_allowed_token_ids_restrict(tiny_server, path):
    with tiny_server.client(timeout=60) as c:
        free = _tokens(c, path)
        banned = sorted(set(free))
        got = _tokens(c, path, logit_bias={str(t): -100 for t in banned})
        assert not set(got) & set(banned)
        allowed = [10, 11, 12]
        assert set(_tokens(c, path, allowed_token_ids=allowed)) <= set(allowed)
        # sampled too: 6 seeded tries at temperature 1 never draw a banned token
        for seed in range(6):
            body = {"max_tokens": 8, "temperature": 1.0, "seed": seed, "ignore_eos": True, "return_token_ids": True,
                    "logit_bias": {str(t): -100 for t in banned}}
            body.update({"messages": CHAT} if "chat" in path else {"prompt": PROMPT})
            r = c.post(path, json=body)
            assert r.status_code == 200 and not set(r.json()["choices"][0]["token_ids"]) & set(banned)


def test_bad_words_are_never_completed(tiny_server):
    with tiny_server.client(timeout=60) as c:
        free = _tokens(c, "/v1/completions")
        detok = c.post("/detokenize", json={"tokens": free[:2]}).json()["prompt"]
        got = _tokens(c, "/v1/completions", bad_words=[detok])
        assert all(got[i:i + 2] != free[:2] for i in range(len(got) - 1)) and got != free


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"100000": -100}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, None),
    ({"logit_bias": {"5": 101}}, None),
    ({"allowed_token_ids": [600]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, None),
    ({"bad_words": [""]}, None),
])
def test_bad_controls_are_400_and_the_engine_lives(tiny_server, body, param):
    with tiny_server.client(timeout=30) as c:
        assert_openai_error(c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body}), 400, param)
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
