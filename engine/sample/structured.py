"""Structured outputs (vLLM's `structured_outputs`, OpenAI's `response_format`) through xgrammar,
the grammar engine vLLM and SGLang default to; it runs on CPU.

A request's constraint (a JSON schema, any JSON object, a regex, a choice of strings, or an EBNF
grammar) is compiled once per distinct constraint (the compiler caches) into a grammar over the
tokenizer's vocabulary. Each sampled position of the request gets the grammar's allowed-token mask
before penalties and temperature, and the sampled token is fed to the request's matcher; once the
grammar is complete only the stop tokens are allowed, so the request ends there.

Why xgrammar over llguidance: vLLM and SGLang ship it as the default, its CPU wheel has no other
native dependency here (llguidance would do the same job; neither has been measured against the
other on this machine yet).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cached_property
from dataclasses import dataclass, fields
from typing import Any

import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_WHITESPACE = 16  # characters of whitespace a JSON schema's grammar allows between two tokens
# xgrammar caches compiled grammars by content; unbounded, a client sending distinct constraints
# would grow the process without end. A simple JSON schema's grammar is about 3 MB here.
CACHE_LIMIT_BYTES = 256 * 2**20
CHECKED_KEYS = 1024  # constraints known to have a token that can start them (LRU)
GRAMMAR_EMPTY = "the grammar allows no token of this model's vocabulary here"


def canonical_schema(schema: dict) -> str:
    """One text per JSON schema however it was spelled: sorted keys, no spaces."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's shape: exactly one of the constraints. `json`: a JSON schema (a dict or its text)."""

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False  # vLLM's: JSON without whitespace between tokens

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs need exactly one of {list(KINDS)}; got {given or 'none'}")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError("structured outputs choice must be a list of non-empty strings")
        # A schema's text is not parsed here: a server's checked schema arrives as text, and parsing
        # half a megabyte again held the GIL on the step loop. Bad JSON fails its compile, named.
        if self.json is not None and not (isinstance(self.json, dict) or (isinstance(self.json, str)
                                                                          and self.json.lstrip().startswith("{"))):
            raise ValueError("structured outputs json must be a JSON schema object")

    @staticmethod
    def coerce(value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams | None:
        """From the wire (a dict of its fields) or as is."""
        if value is None or isinstance(value, StructuredOutputsParams):
            return value
        if not isinstance(value, dict) or set(value) - {*KINDS, "disable_any_whitespace"}:
            raise ValueError(f"structured_outputs takes the keys {[*KINDS, 'disable_any_whitespace']}; got {value!r}")
        return StructuredOutputsParams(**value)

    def to_wire(self) -> dict[str, Any]:
        # Shallow: asdict() copies recursively, and a schema nested hundreds deep ran out of stack.
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) not in (None, False)}

    def kind(self) -> str:
        """Which constraint it is, as `key` names it (cheap)."""
        kind = next(k for k in KINDS if getattr(self, k) not in (None, False))
        return "compact_json" if kind == "json" and self.disable_any_whitespace else kind

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): what the compiled grammar depends on. Made once per object: a
        2,000-tool schema's canonical text is half a megabyte of sorted JSON, 17 ms of Python
        holding the GIL (seconds under CPU load)."""
        return self._key

    @cached_property
    def _key(self) -> tuple[str, str]:
        kind = next(k for k in KINDS if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        if kind == "json":  # a schema's text: as given (the server sends it canonical), or a dict's, sorted
            value = value if isinstance(value, str) else canonical_schema(value)
            kind = "compact_json" if self.disable_any_whitespace else kind
        elif kind == "choice":
            value = json.dumps(value)
        return kind, "" if kind == "json_object" else str(value)


class GrammarCompiler:
    """Compiles constraints for one tokenizer (thread-safe; compiled grammars are cached)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        c = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES)
        self._lock = threading.Lock()
        self._startable: OrderedDict[tuple[str, str], None] = OrderedDict()
        # kind -> how its canonical text (StructuredOutputsParams.key) compiles
        self._build = {
            # whitespace between JSON tokens bounded, so a sampled output cannot pad forever
            "json": lambda t: c.compile_json_schema(t, strict_mode=True, max_whitespace_cnt=MAX_WHITESPACE),
            "compact_json": lambda t: c.compile_json_schema(t, strict_mode=True, any_whitespace=False),
            "json_object": lambda _: c.compile_builtin_json_grammar(),
            "regex": c.compile_regex,
            "choice": lambda t: c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in json.loads(t))),
            "grammar": c.compile_grammar,
        }

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar; ValueError naming what is wrong with the constraint."""
        kind, text = params.key()
        try:
            with self._lock:
                return self._build[kind](text)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports bad input as these
            raise ValueError(f"structured outputs {kind} could not be compiled: {e}") from None

    def checked(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar; ValueError when the constraint does not compile, or when no token
        of the vocabulary can start it (a JSON grammar over a vocabulary without "{"). The slow
        part (compiling) is cached by content: call it off the step loop the first time."""
        compiled = self.compile(params)
        key = params.key()
        with self._lock:
            if key in self._startable:
                self._startable.move_to_end(key)
                return compiled
        state = GrammarState(self._xgr, compiled, self.vocab_size)
        if not bool(torch.isfinite(state.mask(torch.zeros(self.vocab_size))).any()):
            raise ValueError(f"structured outputs {key[0]}: no token of this model's vocabulary can start it")
        with self._lock:
            self._startable[key] = None
            while len(self._startable) > CHECKED_KEYS:
                self._startable.popitem(last=False)
        return compiled

    def state(self, compiled: Any) -> GrammarState:
        """A fresh matcher over a grammar `checked` returned (cheap)."""
        return GrammarState(self._xgr, compiled, self.vocab_size)

    def matcher(self, params: StructuredOutputsParams) -> GrammarState:
        """`state(checked(params))`: compiles (or finds it cached) on the calling thread."""
        return self.state(self.checked(params))


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, xgr: Any, compiled: Any, vocab_size: int) -> None:
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._accepted = 0  # tokens accepted so far: the state the bitmask was filled for
        self._filled_at = -1

    def prefill(self) -> None:
        """Computes the next token's mask now (on the mask thread, while the forward runs). A
        finished grammar has none (async scheduling plans a step past a request's stop)."""
        if self._matcher.is_terminated():
            return
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        self._filled_at = self._accepted

    def bitmask(self) -> torch.Tensor:
        """The next token's mask, int32 `[1, ceil(vocab / 32)]` (bit j of word w: token 32w + j is
        allowed), filled now unless the mask thread did. The next fill overwrites it: copy it first."""
        if self._filled_at != self._accepted:
            self.prefill()
        return self._bitmask

    def mask(self, row: torch.Tensor) -> torch.Tensor:
        """`row` (float32 logits `[vocab]`) with the tokens the grammar forbids next at -inf, in place."""
        self._xgr.apply_token_bitmask_inplace(row.view(1, -1), self.bitmask())
        if not bool(torch.isfinite(row).any()):
            raise ValueError(GRAMMAR_EMPTY)
        return row

    def accept(self, token: int) -> None:
        if not self._matcher.accept_token(token):
            raise ValueError(f"token {token} does not follow the grammar")
        self._accepted += 1


def _prefill_all(grammars: list[GrammarState]) -> None:
    for g in grammars:
        g.prefill()


class MaskPrefetch:
    """Fills the masks of a step's constrained rows on a thread of its own while the forward
    runs (xgrammar's fill is C++; a grammar state changes only when the sampler accepts a token,
    after the forward). `wait()` before sampling."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def start(self, grammars: list[GrammarState]) -> None:
        self.wait()
        if not grammars:
            return
        if self._pool is None:
            from kvstore.threads import one_torch_thread

            self._pool = ThreadPoolExecutor(1, "kvtier-grammar-masks", initializer=one_torch_thread)
        self._pending = self._pool.submit(_prefill_all, grammars)

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


class LazyGrammarCompiler:
    """A GrammarCompiler built on first use: most engines never see a grammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def get(self) -> GrammarCompiler:
        with self._lock:  # the preparation thread and the offline caller may both get here first
            if self._compiler is None:
                self._compiler = GrammarCompiler(*self._args)
            return self._compiler
