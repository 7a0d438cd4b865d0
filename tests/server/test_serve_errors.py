"""Issue 5, acceptance 2: every error is OpenAI's JSON error object with the right status.

400 for invalid parameters, over-long prompts and malformed JSON; 404 for an unknown model;
413 over --max-request-bytes; 401 without the --api-key (or $KVTIER_API_KEY); 503 with
Retry-After over --max-pending-requests; and a property test that random malformed bodies on
every POST endpoint never get a 500 or hang the server."""
from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from serving import start_server

CHAT = [{"role": "user", "content": "hello"}]
MAX_MODEL_LEN = 2048  # the tiny checkpoint's max_position_embeddings


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["code"] == status, err
    if param is not None:
        assert err["param"] == param, err
    return err


# -- 400: invalid parameters -------------------------------------------------------------------
def _cmpl(**kw):
    return "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2, **kw}


def _chat(**kw):
    return "/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 2, **kw}


def _batch(**kw):
    return "/v1/chat/completions/batch", {"model": "tiny", "messages": [CHAT], "max_tokens": 2, **kw}


INVALID = {
    "temperature=-1": (*_cmpl(temperature=-1), "temperature"),
    "temperature=3": (*_chat(temperature=3), "temperature"),
    "top_p=0": (*_cmpl(top_p=0), "top_p"),
    "top_p=1.5": (*_chat(top_p=1.5), "top_p"),
    "max_tokens=0": (*_cmpl(max_tokens=0), "max_tokens"),
    "max_tokens=-5": (*_chat(max_tokens=-5), "max_tokens"),
    "max_completion_tokens=0": (*_chat(max_completion_tokens=0), "max_completion_tokens"),
    "n=0": (*_cmpl(n=0), "n"),
    "n=17": (*_batch(n=17), "n"),
    "n=str": (*_cmpl(n="two"), "n"),
    "temperature=str": (*_chat(temperature="hot"), "temperature"),
    "max_tokens=list": (*_cmpl(max_tokens=[1]), "max_tokens"),
    "stream=dict": (*_cmpl(stream={"a": 1}), "stream"),
    "prompt=int": (*_cmpl(prompt=5), None),
    "prompt=empty": (*_cmpl(prompt=""), "prompt"),
    "prompt=token-out-of-vocab": (*_cmpl(prompt=[1, 99999]), "prompt"),
    "messages=str": (*_chat(messages="hello"), None),
    "messages=empty": (*_chat(messages=[]), "messages"),
    "role=unknown": (*_chat(messages=[{"role": "wizard", "content": "hi"}]), None),
    "content=image": (*_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
                      "messages"),
    "logprobs=6": (*_cmpl(logprobs=6), "logprobs"),
    "top_logprobs-without-logprobs": (*_chat(top_logprobs=2), None),
    "stop=empty": (*_cmpl(stop=[""]), None),
    "stream_options-without-stream": (*_cmpl(stream_options={"include_usage": True}), None),
    "echo": (*_cmpl(echo=True), None),
    "batch-stream": (*_batch(stream=True), None),
    "min_tokens>max_tokens": (*_cmpl(min_tokens=5), None),
    # integers the engine core cannot be sent (msgpack int64): these were a 500 and leaked a
    # pending-request slot
    "priority=2**70": (*_cmpl(priority=2**70), "priority"),
    "top_k=2**64": (*_cmpl(top_k=2**64), "top_k"),
    "stop_token_ids=[2**64]": (*_cmpl(stop_token_ids=[2**64]), None),
    # A request's own template needs --trust-request-chat-template (tests/server/test_hardening.py
    # has the trusted server); apply_chat_template's parameters are no template variables.
    "chat_template-untrusted": (*_chat(chat_template_kwargs={"chat_template": "{{ 1 / 0 }}"}), "chat_template_kwargs"),
    "chat_template-field-untrusted": (*_chat(chat_template="{{ 1 }}"), "chat_template"),
    "return_tensors=np": (*_chat(chat_template_kwargs={"return_tensors": "np"}), "chat_template_kwargs"),
    "tokenize=false": (*_chat(chat_template_kwargs={"tokenize": False}), "chat_template_kwargs"),
    "tokenize-both": ("/tokenize", {"prompt": "hi", "messages": CHAT}, None),
    "detokenize-out-of-vocab": ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    "detokenize-str": ("/detokenize", {"tokens": "abc"}, "tokens"),
}


@pytest.mark.parametrize("path,body,param", INVALID.values(), ids=list(INVALID))
def test_invalid_parameters_are_400(tiny_server, path, body, param):
    with tiny_server.client(timeout=30) as c:
        assert_openai_error(c.post(path, json=body), 400, param)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": [7] * MAX_MODEL_LEN}, "prompt"),  # no room for one token
    ("/v1/completions", {"prompt": [7] * (MAX_MODEL_LEN + 300), "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [7] * 2000, "max_tokens": 100}, "max_tokens"),  # 2100 > 2048
    ("/v1/completions", {"prompt": [[7] * 5, [7] * (MAX_MODEL_LEN + 1)]}, "prompt"),  # the second of two
    ("/v1/completions", {"prompt": "hello " * (MAX_MODEL_LEN + 10)}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]}, "prompt"),
    ("/v1/chat/completions/batch", {"messages": [CHAT, [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]]},
     "prompt"),
], ids=["len=max", "len>max", "prompt+max_tokens>max", "second-prompt", "text", "chat", "batch"])
def test_prompt_longer_than_the_context_is_400(tiny_server, path, body, param):
    with tiny_server.client(timeout=30) as c:
        err = assert_openai_error(c.post(path, json={"model": "tiny", **body}), 400, param)
        assert "maximum context length is 2048" in err["message"]
        # nothing was queued: the server still answers a fitting request
        ok = c.post("/v1/completions", json={"model": "tiny", "prompt": [7] * 2000, "max_tokens": 48})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("raw", [
    b"{bad json", b"", b"   ", b'{"model": "tiny", "prompt": "hi",}', b"\xff\xfe\x00garbage", b"[1, 2]", b'"text"',
    b"null", b"NaN",
    b"[" * 100_000,  # deeper than json's recursion limit: was a 500 (RecursionError)
    b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"model": "tiny", "prompt": "hi\\ud800", "max_tokens": 2}',  # lone surrogate: was a 500 (tokenizer)
    b'{"model": "tiny", "prompt": "hi", "max_tokens": 2, "stop": ["\\udfff"]}',
], ids=["syntax", "empty", "blank", "trailing-comma", "binary", "array", "string", "null", "nan", "deep-array",
        "deep-prompt", "surrogate-prompt", "surrogate-stop"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_malformed_json_is_400(tiny_server, path, raw):
    with tiny_server.client(timeout=30) as c:
        assert_openai_error(c.post(path, content=raw, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hello"}),
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/v1/chat/completions/batch", {"messages": [CHAT]}),
    ("/v1/completions", {"prompt": "hello", "stream": True}),
    ("/tokenize", {"prompt": "hello"}),
])
def test_unknown_model_is_404(tiny_server, path, body):
    limit = {} if path == "/tokenize" else {"max_tokens": 2}  # /tokenize refuses fields it does not know
    with tiny_server.client(timeout=30) as c:
        err = assert_openai_error(c.post(path, json={"model": "gpt-4o", **limit, **body}), 404, "model")
        assert "gpt-4o" in err["message"]
        # the served name works
        assert c.post(path, json={"model": "tiny", **limit, **body}).status_code == 200


def test_unknown_route_is_404_in_openai_shape(tiny_server):
    with tiny_server.client(timeout=30) as c:
        assert_openai_error(c.post("/v1/embeddings", json={"input": "x"}), 404)


# -- 413, 503: limits --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def limits_server(long_ckpt):
    srv = start_server(str(long_ckpt), "--served-model-name", "tiny", "--num-gpu-blocks", "4200",
                       "--max-pending-requests", "2", "--max-request-bytes", "4096")
    yield srv
    srv.stop()


def test_body_over_max_request_bytes_is_413(limits_server):
    with limits_server.client(timeout=30) as c:
        fits = {"model": "tiny", "prompt": "hello " * 600, "max_tokens": 2}  # 3.6 kB
        assert c.post("/v1/completions", json=fits).status_code == 200
        big = {"model": "tiny", "prompt": "hello " * 700, "max_tokens": 2}  # 4.2 kB
        assert_openai_error(c.post("/v1/completions", json=big), 413)
        assert_openai_error(c.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}), 413)
        assert_openai_error(c.post("/tokenize", content=b"{" + b" " * 10_000 + b"}"), 413)


def test_over_max_pending_requests_is_503_with_retry_after(limits_server):
    long = {"model": "tiny", "prompt": "hello", "max_tokens": 30000, "ignore_eos": True, "stream": True}
    quick = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    with limits_server.client(timeout=30) as c, limits_server.client(timeout=30) as c2:
        with c.stream("POST", "/v1/completions", json=long) as s1, c2.stream("POST", "/v1/completions",
                                                                              json=long) as s2:
            assert s1.status_code == s2.status_code == 200
            lines = [s1.iter_lines(), s2.iter_lines()]  # kept: a dropped iterator closes its stream
            assert all(next(it).startswith("data: {") for it in lines)  # both are generating
            with limits_server.client(timeout=10) as c3:
                for path, body in [("/v1/completions", quick),
                                   ("/v1/chat/completions", {"model": "tiny", "messages": CHAT, "max_tokens": 2}),
                                   ("/v1/completions", {**long, "max_tokens": 2})]:
                    r = c3.post(path, json=body)
                    assert_openai_error(r, 503)
                    assert int(r.headers["retry-after"]) >= 1
                assert c3.get("/health").status_code == 200  # overloaded is not unhealthy
        # the two streams are gone (aborted on disconnect): their slots come back
        with limits_server.client(timeout=30) as c3:
            for _ in range(50):
                r = c3.post("/v1/completions", json=quick)
                if r.status_code != 503:
                    break
                time.sleep(0.1)
            assert r.status_code == 200, r.text
            # n counts: 3 sequences never fit in 2 slots, so retrying cannot help: 400, not 503
            err = assert_openai_error(c3.post("/v1/completions", json={**quick, "n": 3}), 400)
            assert "--max-pending-requests" in err["message"]
            assert_openai_error(c3.post("/v1/completions", json={**quick, "prompt": ["a", "b", "c"]}), 400)


# -- 401: API key ------------------------------------------------------------------------------
def _check_key_required(srv, key: str) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    with srv.client(timeout=30) as c:
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                        {"Authorization": f"Basic {key}"}, {"Authorization": f"Bearer {key}x"}]:
            assert_openai_error(c.post("/v1/completions", json=body, headers=headers), 401)
            assert_openai_error(c.get("/v1/models", headers=headers), 401)
            assert_openai_error(c.get("/v1/kv/stats", headers=headers), 401)
        ok = {"Authorization": f"Bearer {key}"}
        assert c.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert c.get("/v1/models", headers=ok).json()["data"][0]["id"] == "tiny"
        assert c.get("/health").status_code == 200  # probes need no key


def test_api_key_from_environment(ckpt_dir):
    srv = start_server(str(ckpt_dir("llama")), "--served-model-name", "tiny", "--num-gpu-blocks", "64",
                       env={"KVTIER_API_KEY": "sk-env-456"})
    try:
        _check_key_required(srv, "sk-env-456")
    finally:
        srv.stop()


def test_api_key_flag_sets_the_key_and_wins_over_the_environment(monkeypatch):
    """The flag and $KVTIER_API_KEY fill the same setting (enforced end to end above); one
    server start is enough for both."""
    from server.serve import build_parser

    monkeypatch.delenv("KVTIER_API_KEY", raising=False)
    assert build_parser().parse_args([]).api_key is None  # no auth by default
    assert build_parser().parse_args(["--api-key", "sk-flag"]).api_key == "sk-flag"
    monkeypatch.setenv("KVTIER_API_KEY", "sk-env")
    assert build_parser().parse_args([]).api_key == "sk-env"
    assert build_parser().parse_args(["--api-key", "sk-flag"]).api_key == "sk-flag"


def test_no_key_needed_without_api_key(tiny_server):
    with tiny_server.client(timeout=30) as c:
        assert c.get("/v1/models", headers={"Authorization": "Bearer anything"}).status_code == 200
        assert c.get("/v1/models").status_code == 200


# -- property: random malformed bodies never get a 500 or hang ---------------------------------
_text = st.one_of(st.text(max_size=12), st.sampled_from(["", "tiny", "hello world", "\ud800", "a\udfffb", "\x00"]))
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats() | _text,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_text, kids, max_size=4),
    max_leaves=8)
# Values that never make a long generation (no None: that means "up to the context length").
_small_limit = st.integers(-2, 6) | st.sampled_from([10**9, 2**64, 1.5, "3", [], {}, True])
_num = st.integers(-3, 20) | st.floats(-3, 3) | _json
_ids = st.lists(st.integers(-3, 600) | st.sampled_from([2**63, 2**64, -(2**63) - 1]), max_size=8)
_message = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "wizard"]) | _json,
    "content": _text | st.lists(st.fixed_dictionaries({}, optional={"type": st.sampled_from(["text", "image"]) | _json,
                                                                    "text": _text | _json}), max_size=2) | _json,
})
_messages = st.lists(_message, max_size=3) | _json

_COMMON = {
    "model": st.sampled_from(["tiny", "nope"]) | _json, "max_tokens": _small_limit, "temperature": _num,
    "top_p": _num, "n": st.integers(-1, 17) | _json, "stop": _text | st.lists(_text, max_size=3) | _json,
    "seed": st.integers() | _json, "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | _json}) | _json,
    "top_k": _num, "min_p": _num, "min_tokens": _small_limit, "ignore_eos": st.booleans() | _json,
    "stop_token_ids": _ids | _json, "priority": st.integers() | _json, "cache_salt": _text | _json,
    "presence_penalty": _num, "frequency_penalty": _num, "repetition_penalty": _num,
    "skip_special_tokens": st.booleans() | _json, "return_token_ids": st.booleans() | _json, "user": _text | _json,
    "kv_transfer_params": _json,
}
_CHAT_FIELDS = {
    **_COMMON, "max_completion_tokens": _small_limit, "logprobs": st.booleans() | _json,
    "top_logprobs": st.integers(-1, 21) | _json, "add_generation_prompt": st.booleans() | _json,
    "chat_template_kwargs": _json,
}
FIELDS = {
    "/v1/completions": {**_COMMON, "prompt": _text | _ids | st.lists(_text | _ids, max_size=3) | _json,
                        "logprobs": st.integers(-1, 6) | _json, "echo": st.booleans() | _json,
                        "suffix": _text | _json, "best_of": st.integers(-1, 3) | _json},
    "/v1/chat/completions": {**_CHAT_FIELDS, "messages": _messages},
    "/v1/chat/completions/batch": {**_CHAT_FIELDS, "messages": st.lists(_messages, max_size=3) | _json},
    "/tokenize": {"model": _COMMON["model"], "prompt": _text | _json, "messages": _messages,
                  "add_special_tokens": st.booleans() | _json, "add_generation_prompt": st.booleans() | _json},
    "/detokenize": {"model": _COMMON["model"], "tokens": _ids | _json},
}


VALID = {
    "/v1/completions": {"model": "tiny", "prompt": "hello world", "max_tokens": 4},
    "/v1/chat/completions": {"model": "tiny", "messages": CHAT, "max_tokens": 4},
    "/v1/chat/completions/batch": {"model": "tiny", "messages": [CHAT, CHAT], "max_tokens": 4},
    "/tokenize": {"prompt": "hello world"},
    "/detokenize": {"tokens": [1, 2, 3]},
}


def _body(path: str) -> st.SearchStrategy[bytes]:
    fields = st.fixed_dictionaries({}, optional=FIELDS[path])
    if path.startswith("/v1"):  # always bounded: the default is "up to the context length"
        fields = fields.map(lambda d: {"max_tokens": 4, **d})
    # a valid body with one or two fields replaced: reaches the engine far more often
    mutated = st.lists(st.sampled_from(sorted(FIELDS[path])), min_size=1, max_size=2, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: FIELDS[path][k] for k in keys})).map(lambda d: {**VALID[path], **d})
    return st.one_of(
        st.binary(max_size=64),
        _json.map(lambda v: json.dumps(v).encode()),
        fields.map(lambda d: json.dumps(d).encode()),
        mutated.map(lambda d: json.dumps(d).encode()),
    )


@pytest.mark.parametrize("path", list(FIELDS))
def test_random_malformed_bodies_never_500_or_hang(tiny_server, path):
    """60 bodies per endpoint (KVTIER_FUZZ_EXAMPLES=500 for a deeper run, about 25 s each)."""
    statuses: list[int] = []

    with httpx.Client(base_url=tiny_server.url, timeout=30) as c:
        @settings(max_examples=int(os.environ.get("KVTIER_FUZZ_EXAMPLES", 60)), deadline=None, database=None,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
        @given(_body(path))
        @example(json.dumps(VALID[path]).encode())  # one body that reaches the engine, whatever is drawn
        def check(raw: bytes) -> None:
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
            statuses.append(r.status_code)
            assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:500], raw[:500])
            if r.status_code != 200:
                assert_openai_error(r, r.status_code)
            elif r.headers["content-type"].startswith("text/event-stream"):
                lines = [ln for ln in r.text.split("\n\n") if ln.strip()]
                assert lines[-1] == "data: [DONE]", r.text[-500:]
                for ln in lines[:-1]:
                    chunk = json.loads(ln.removeprefix("data: "))
                    assert chunk.get("error", {}).get("code", 400) < 500, chunk
            else:
                r.json()

        check()
        assert c.get("/health").status_code == 200
        stats = c.get("/v1/kv/stats").json()  # nothing left running or holding blocks
        assert stats["requests"]["running"] == stats["requests"]["waiting"] == 0
        assert stats["tiers"]["G1"]["usage"] == 0
    assert any(s == 200 for s in statuses) and any(s != 200 for s in statuses), statuses
