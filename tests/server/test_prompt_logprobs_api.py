"""Issue 17: `prompt_logprobs` through `kvtier serve`, in vLLM's format (None for the first token,
then {token id: {logprob, rank, decoded_token}}): per choice for completions (also in the first
stream chunk), beside the choices for chat. Oracle: transformers' log-softmax over the prompt."""
from __future__ import annotations

import json

import pytest
import torch

from checkpoints import build_tokenizer, load_hf

CONV = [{"role": "user", "content": "what is the capital of france"}]


@pytest.fixture(scope="module")
def oracle(ckpt_dir):
    hf = load_hf(ckpt_dir("llama"))

    def rows(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
    return rows


def _check(entries, ids, rows, top):
    tok = build_tokenizer()
    assert entries[0] is None and len(entries) == len(ids)
    for i, entry in enumerate(entries[1:]):
        row, token = rows[i], ids[i + 1]
        got = entry[str(token)]
        assert got["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        assert got["rank"] == int((row > row[token]).sum()) + 1 and got["decoded_token"] == tok.decode([token])
        assert {int(t) for t in entry} == set(row.topk(top).indices.tolist()) | {token}


def test_completions_prompt_logprobs(tiny_server, oracle):
    ids = build_tokenizer().encode("hello world what is the sun", add_special_tokens=False)
    with tiny_server.client() as c:
        body = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2}).json()
        _check(body["choices"][0]["prompt_logprobs"], ids, oracle(ids), 2)
        text = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2,
                                               "stream": True}).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    firsts = [ch["choices"][0].get("prompt_logprobs") for ch in chunks]
    assert firsts[0] == body["choices"][0]["prompt_logprobs"] and not any(firsts[1:])


def test_chat_prompt_logprobs_beside_the_choices(tiny_server, oracle):
    with tiny_server.client() as c:
        body = c.post("/v1/chat/completions", json={"messages": CONV, "max_tokens": 2, "prompt_logprobs": 0,
                                                    "return_token_ids": True, "n": 2}).json()
    ids = body["choices"][0]["prompt_token_ids"]
    _check(body["prompt_logprobs"], ids, oracle(ids), 0)
    assert "prompt_logprobs" not in body["choices"][0]
