"""The hostile request classes of issue 38's attack, for benchmarks/hostile.py and soak.py's
`hostile` fault: (name, path, body) each, built for any model (text prompts, no token ids).
Stdlib only."""
from __future__ import annotations

from typing import Any

CHAT = [{"role": "user", "content": "Say hello."}]


def nested_schema(depth: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


def long_prompt(words: int) -> str:
    return " ".join(f"word{i % 997} and" for i in range(words // 2))


def classes(prompt_logprobs_words: int = 1500) -> list[tuple[str, str, dict[str, Any]]]:
    """The attack's sizes (the issue's acceptance 1)."""
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
        for i in range(2000)]
    big = ("hello world , this is a test . " * 250_000)[:7_000_000]
    return [
        ("bad_words_50k", "/v1/completions", {"prompt": "Say hello.", "max_tokens": 8,
                                              "bad_words": [f"w{i}" for i in range(50_000)]}),
        ("choice_60k", "/v1/completions", {"prompt": "Pick one:", "max_tokens": 8,
                                           "structured_outputs": {"choice": [f"option {i}" for i in range(60_000)]}}),
        ("enum_20k", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "response_format": {
            "type": "json_schema", "json_schema": {"name": "e", "schema": {
                "type": "object", "properties": {"c": {"enum": [f"v{i}" for i in range(20_000)]}}}}}}),
        ("schema_depth_240", "/v1/completions", {"prompt": "JSON:", "max_tokens": 8, "guided_json": nested_schema(240)}),
        ("tools_2000_required", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "tools": tools,
                                                          "tool_choice": "required"}),
        ("prompt_7mb", "/v1/completions", {"prompt": big, "max_tokens": 8}),
        ("prompt_logprobs_n16", "/v1/completions", {"prompt": long_prompt(prompt_logprobs_words), "max_tokens": 2,
                                                    "n": 16, "prompt_logprobs": 20, "temperature": 0}),
    ]
