"""Tool calling (OpenAI's `tools` / `tool_choice`, vLLM's `--enable-auto-tool-choice` and
`--tool-call-parser`).

- `tool_choice: "required"` or a named function: the output is constrained (engine/sample/structured.py)
  to compact JSON (no whitespace: fewer tokens, nothing to pad with) that is a call, so it parses: for "required" a list of `{"name", "parameters"}`
  with a tool's name and its parameter schema (one call unless `parallel_tool_calls`), for a named
  function that function's parameters; the JSON becomes `tool_calls`.
- `"auto"` (needs `--enable-auto-tool-choice` and a parser): the model writes what it wants, and
  the parser finds the calls in its text in the model family's format; what is left is `content`.
- `"none"`: tools are rendered into the prompt, and the text is the answer.
The chat template receives `tools` in every mode.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.sample.structured import StructuredOutputsParams

ToolCall = dict[str, Any]  # OpenAI's: {"id", "type": "function", "function": {"name", "arguments"}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the engine and of the response."""

    mode: str  # "none", "auto", "required" or "named" (OpenAI's tool_choice values)
    names: tuple[str, ...]
    constraint: StructuredOutputsParams | None  # for required / named
    named: str | None = None
    parser: str | None = None  # for auto
    parallel: bool = True  # parallel_tool_calls: False keeps one call (the constraint allows one; auto keeps the first)


def _call(name: str, args: Any) -> ToolCall:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}


def plan(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool | None, auto_enabled: bool,
         parser: str | None) -> ToolPlan | None:
    """The plan for a request (None without tools); ValueError for tools or a choice that cannot be served."""
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    specs: dict[str, dict[str, Any]] = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError('each tool must be {"type": "function", "function": {"name": ..., "parameters": ...}}')
        specs[fn["name"]] = fn.get("parameters") or {"type": "object", "properties": {}}
    names = tuple(specs)
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in specs:
            raise ValueError(f"tool_choice names a function that is not in tools: {name!r}")
        return ToolPlan("named", names, StructuredOutputsParams(json=specs[name], disable_any_whitespace=True),
                        named=name)
    if choice == "none":
        return ToolPlan("none", names, None)
    if choice == "required":
        call = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                 "properties": {"name": {"enum": [n]}, "parameters": p}} for n, p in specs.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if parallel is False:
            schema["maxItems"] = 1
        return ToolPlan("required", names, StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise ValueError('"auto" tool choice requires the server\'s --enable-auto-tool-choice and --tool-call-parser')
        return ToolPlan("auto", names, None, parser=parser, parallel=parallel is not False)
    raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function; got {choice!r}')


def extract(p: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool_calls) of a finished output."""
    if p.mode == "none":
        return text, []
    if p.mode in ("required", "named"):
        try:
            data = json.loads(text)
        except ValueError:  # cut short by max_tokens: the text is all there is
            return text, []
        if p.mode == "named":
            return None, [_call(p.named, data)]  # type: ignore[arg-type]
        return None, [_call(c["name"], c["parameters"]) for c in data]
    content, calls = PARSERS[p.parser](text, p.names)  # type: ignore[index]
    return content, calls if p.parallel else calls[:1]


def _json_calls(items: list[Any], names: tuple[str, ...]) -> list[ToolCall] | None:
    calls = []
    for it in items:
        if not isinstance(it, dict) or it.get("name") not in names:
            return None
        calls.append(_call(it["name"], it.get("arguments", it.get("parameters", {}))))
    return calls


def _hermes(text: str, names: tuple[str, ...]) -> tuple[str | None, list[ToolCall]]:
    """Hermes and Qwen 2.5/3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""
    blocks = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)
    try:
        calls = _json_calls([json.loads(b) for b in blocks], names) if blocks else None
    except ValueError:
        calls = None
    if not calls:
        return text, []
    rest = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S).strip()
    return rest or None, calls


def _llama3_json(text: str, names: tuple[str, ...]) -> tuple[str | None, list[ToolCall]]:
    """Llama 3.x JSON calls: the whole output is `{"name": ..., "parameters": {...}}` (several
    separated by ';')."""
    body = text.strip().removeprefix("<|python_tag|>")
    if not body.startswith("{"):
        return text, []
    try:
        calls = _json_calls([json.loads(part) for part in body.split(";") if part.strip()], names)
    except ValueError:
        calls = None
    return (None, calls) if calls else (text, [])


def _mistral(text: str, names: tuple[str, ...]) -> tuple[str | None, list[ToolCall]]:
    """Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` after any content."""
    head, sep, tail = text.partition("[TOOL_CALLS]")
    if not sep:
        return text, []
    try:
        data = json.loads(tail.strip())
        calls = _json_calls(data if isinstance(data, list) else [data], names)
    except ValueError:
        calls = None
    return (head.strip() or None, calls) if calls else (text, [])


PARSERS: dict[str, Callable[[str, tuple[str, ...]], tuple[str | None, list[ToolCall]]]] = {
    "hermes": _hermes, "qwen3": _hermes, "llama3_json": _llama3_json, "mistral": _mistral,
}
