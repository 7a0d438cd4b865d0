"""What one request may make the server do (issue 38).

Some request fields set work whose cost the client controls: a list the engine walks at every
sampled token, a constraint that compiles for seconds, a prompt that tokenizes for seconds. One
such request stalled every other client, or got the engine core killed by its heartbeat. Each
field here has a bound, checked on the API side before anything expensive runs (before the prompt
is tokenized); a request over one gets a 400 naming the field, its size and the limit.

The defaults are generous for real use and keep a request's worst case near a second of one
core on the 2-core machine this project is measured on (compile times in docs/HARDENING.md).
`kvtier serve --request-limits '{"bad_words": 4096}'` changes any of them.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from engine.sample.structured import StructuredOutputsParams, canonical_schema


@dataclass(frozen=True)
class RequestLimits:
    bad_words: int = 256  # entries (each tokenized twice, then matched at every sampled token)
    logit_bias: int = 1024  # entries
    allowed_token_ids: int = 65536  # entries
    stop_token_ids: int = 256  # entries
    tools: int = 128  # OpenAI's own limit
    choice: int = 1024  # structured outputs: choices
    choice_chars: int = 65536  # structured outputs: characters of all choices together
    schema_bytes: int = 131072  # a JSON schema (a tool_choice "required" schema of all tools included), as JSON
    schema_depth: int = 64  # nesting of objects and arrays in a JSON schema
    schema_enum: int = 1024  # enum values in a JSON schema, all enums together
    pattern_chars: int = 16384  # a structured outputs regex
    grammar_chars: int = 65536  # a structured outputs EBNF grammar
    compile_timeout_s: float = 10.0  # a request still compiling then is refused (server/core_prep.py)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 or (f.type == "int" and v != int(v)):
                raise ValueError(f"request limit {f.name} must be a positive {f.type}; got {v!r}")

    @classmethod
    def from_json(cls, text: str | None) -> RequestLimits:
        """The defaults, with the JSON object's keys overriding them; ValueError naming an unknown key."""
        if not text:
            return cls()
        try:
            given = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--request-limits is not valid JSON: {e}") from None
        if not isinstance(given, dict):
            raise ValueError("--request-limits must be a JSON object of limit names and values")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"--request-limits: unknown limit(s) {unknown}; known: {sorted(known)}")
        return cls(**given)

    @classmethod
    def describe(cls) -> str:
        """The limits and their defaults, for --help."""
        return ", ".join(f"{f.name} {f.default}" for f in dataclasses.fields(cls))


class LimitExceeded(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _over(param: str, what: str, got: int, limit_name: str, limit: int | float) -> LimitExceeded:
    return LimitExceeded(param, f"{param} has {got} {what}; this server takes at most {limit} "
                                f"(--request-limits {limit_name})")


def check_lists(req: Any, limits: RequestLimits) -> None:
    """The list-valued sampling fields of a completion or chat request."""
    for name in ("bad_words", "logit_bias", "allowed_token_ids", "stop_token_ids"):
        value = getattr(req, name, None)
        if value and len(value) > getattr(limits, name):
            raise _over(name, "entries", len(value), name, getattr(limits, name))
    tools = getattr(req, "tools", None)
    if tools and len(tools) > limits.tools:
        raise _over("tools", "tools", len(tools), "tools", limits.tools)


def schema_shape(schema: Any) -> tuple[int, int]:
    """(nesting depth of objects and arrays, enum values) of a JSON value, without recursion."""
    depth = enums = 0
    stack = [(schema, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            depth = max(depth, d)
            enum = node.get("enum")
            if isinstance(enum, list):
                enums += len(enum)
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            depth = max(depth, d)
            stack.extend((v, d + 1) for v in node)
    return depth, enums


def check_constraint(param: str, so: StructuredOutputsParams, limits: RequestLimits) -> StructuredOutputsParams:
    """A structured-output constraint's size, before anything compiles it; returns it as the
    engine keys it: a JSON schema as its canonical text (`canonical_schema`), made once here, off
    the engine's step loop (where sorting a 2,000-tool schema's text held the GIL for seconds
    under CPU load), and sent as one string rather than a tree."""
    if so.choice is not None:
        if len(so.choice) > limits.choice:
            raise _over(param, "choices", len(so.choice), "choice", limits.choice)
        chars = sum(len(c) for c in so.choice)
        if chars > limits.choice_chars:
            raise _over(param, "characters of choices", chars, "choice_chars", limits.choice_chars)
    elif so.regex is not None and len(so.regex) > limits.pattern_chars:
        raise _over(param, "characters of regex", len(so.regex), "pattern_chars", limits.pattern_chars)
    elif so.grammar is not None and len(so.grammar) > limits.grammar_chars:
        raise _over(param, "characters of grammar", len(so.grammar), "grammar_chars", limits.grammar_chars)
    elif so.json is not None:
        if isinstance(so.json, str) and len(so.json.encode()) > limits.schema_bytes:  # before parsing it
            raise _over(param, "bytes of JSON schema", len(so.json.encode()), "schema_bytes", limits.schema_bytes)
        try:
            schema = json.loads(so.json) if isinstance(so.json, str) else so.json
        except ValueError as e:
            raise ValueError(f"structured outputs json is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("structured outputs json must be a JSON schema object")
        text = canonical_schema(schema)
        size = len(text.encode())
        if size > limits.schema_bytes:
            raise _over(param, "bytes of JSON schema", size, "schema_bytes", limits.schema_bytes)
        depth, enums = schema_shape(schema)
        if depth > limits.schema_depth:
            raise _over(param, "levels of nesting in its JSON schema", depth, "schema_depth", limits.schema_depth)
        if enums > limits.schema_enum:
            raise _over(param, "enum values in its JSON schema", enums, "schema_enum", limits.schema_enum)
        return StructuredOutputsParams(json=text, disable_any_whitespace=so.disable_any_whitespace)
    return so
