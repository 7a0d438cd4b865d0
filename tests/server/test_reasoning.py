"""Issue 17, acceptance 3 through `kvtier serve`: a reasoning model (a test checkpoint whose
tokenizer has `<think>`/`</think>` and whose template opens the thinking section) served with
`--reasoning-parser deepseek_r1` and a default budget in `--reasoning-config`. A request whose
logit_bias forbids the end marker keeps thinking: the thinking section has exactly the budget's
tokens, the forced end marker follows, then the answer; `reasoning_content` holds the thinking
text, in responses and (reassembled) in stream deltas, and the token counts are reported.
The parsers themselves are checked on texts split into random deltas (oracle: the whole-text
split)."""
from __future__ import annotations

import json
import random

import pytest

from checkpoints import END_THINK_ID, EOS_ID, build_checkpoint, build_tokenizer
from serving import run_cli, start_server
from server.reasoning import PARSERS

DEFAULT_BUDGET = 6
BIAS = {str(END_THINK_ID): -100, str(EOS_ID): -100}
ASK = [{"role": "user", "content": "what is the capital of france"}]


@pytest.fixture(scope="module")
def think_server(tmp_path_factory):
    path = build_checkpoint("qwen3", tmp_path_factory.mktemp("think") / "qwen3", think=True)
    srv = start_server(str(path), "--num-gpu-blocks", "128", "--reasoning-parser", "deepseek_r1",
                       "--reasoning-config", json.dumps({"thinking_token_budget": DEFAULT_BUDGET}))
    yield srv
    assert srv.stop() == 0


def _chat(srv, **kw):
    body = {"messages": ASK, "max_tokens": 16, "temperature": 0, "logit_bias": BIAS, "return_token_ids": True, **kw}
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("budget", [None, 0, 9])
def test_thinking_stops_at_the_budget_and_the_answer_follows(think_server, budget):
    tok = build_tokenizer(think=True)
    body = _chat(think_server, **({} if budget is None else {"thinking_token_budget": budget}))
    n = DEFAULT_BUDGET if budget is None else budget
    choice = body["choices"][0]
    ids = choice["token_ids"]
    assert END_THINK_ID not in ids[:n] and ids[n] == END_THINK_ID and len(ids) == 16
    msg = choice["message"]
    assert msg["reasoning_content"] == msg["reasoning"]
    assert msg["reasoning_content"].strip() == tok.decode(ids[:n]).strip()
    assert msg["content"].strip() == tok.decode(ids[n + 1:]).strip() and "think" not in msg["content"]
    assert choice["thinking_forced_tokens"] == 1
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == n
    assert body["system_fingerprint"].startswith("fp_")


def test_stream_deltas_reassemble_to_the_response(think_server):
    import openai

    whole = _chat(think_server, thinking_token_budget=4)["choices"][0]["message"]
    with openai.OpenAI(base_url=think_server.v1, api_key="none", timeout=120, max_retries=0) as oa:
        stream = oa.chat.completions.create(model=think_server.model, messages=ASK, max_tokens=16, temperature=0,
                                            logit_bias=BIAS, stream=True, extra_body={"thinking_token_budget": 4})
        reasoning, content = "", ""
        for chunk in stream:
            for ch in chunk.choices:
                reasoning += getattr(ch.delta, "reasoning_content", None) or ""
                content += ch.delta.content or ""
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])


def test_include_reasoning_false_drops_it(think_server):
    msg = _chat(think_server, include_reasoning=False)["choices"][0]["message"]
    assert "reasoning_content" not in msg and msg["content"]


def test_completions_count_thinking_but_do_not_split(think_server):
    with think_server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "hello <think>", "max_tokens": 8, "temperature": 0,
                                             "logit_bias": BIAS, "thinking_token_budget": 2})
    body = r.json()
    assert r.status_code == 200 and "</think>" in body["choices"][0]["text"], body
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2


def test_a_budget_without_markers_is_a_400(tiny_server):
    with tiny_server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 3, "thinking_token_budget": 4})
    assert r.status_code == 400 and "reasoning" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("args, needle", [
    (["--reasoning-parser", "nope"], "--reasoning-parser"),
    (["--reasoning-config", '{"budget": 3}'], "budget"),
    (["--reasoning-parser", "qwen3", "--reasoning-config", '{"reasoning_end_str": "[/THINK]"}'], "differ"),
])
def test_bad_reasoning_flags_exit_2(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


@pytest.mark.parametrize("name", sorted(PARSERS))
@pytest.mark.parametrize("text, opened", [("<think> a b </think> c d", False), ("a b c", False),
                                          ("x <think> y", False), ("a </think> b", True),
                                          (" <think> a </think>b", True), ("a </thi", True), ("", True)])
def test_stream_splits_equal_the_whole_text_split(name, text, opened):
    parser = PARSERS[name]
    whole = parser.split(text, opened)
    rng = random.Random(text)
    for _ in range(30):
        stream, reasoning, content, i = parser.stream(opened), "", "", 0
        while i < len(text):
            j = i + rng.randint(1, 4)
            r, c = stream.feed(text[i:j])
            reasoning, content, i = reasoning + r, content + c, j
        r, c = stream.finish()
        assert ((reasoning + r) if stream.saw_reasoning else None, (content + c) or None) == whole


def test_parsers_follow_vllms_conventions():
    r1, qwen3 = PARSERS["deepseek_r1"], PARSERS["qwen3"]
    assert r1.split("thinking </think> answer", False) == ("thinking ", " answer")
    assert r1.split("still thinking", False) == ("still thinking", None)
    assert qwen3.split("plain answer", False) == (None, "plain answer")
    assert qwen3.split("<think>t</think>a", False) == ("t", "a")
    assert qwen3.split("t</think>a", True) == ("t", "a")
