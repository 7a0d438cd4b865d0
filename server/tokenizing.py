"""Tokenization and chat templating for the API process, off its event loop.

A 7 MB prompt, a request with thousands of prompts or a slow template took the event loop for
seconds, and with it every other route. Here that work runs on a small thread pool (its size
bounds how many requests tokenize at once; the rest wait their turn without blocking the loop).
A chat template that came with the request (only with --trust-request-chat-template) renders
under a deadline: a trace function stops its Python frames once the time is up, so a template
with nested loops fails that request instead of holding a thread for minutes.

Prompt text costs time to tokenize (about 2 MB/s here), so two multi-megabyte prompts took both
threads for seconds while short requests waited behind them (issue 38). Two defences:
- `min_tokens`: a lower bound on a text's tokens from its length alone (no token is longer than
  the vocabulary's longest string, and normalization composes at most COMPOSE characters into
  one), so a prompt that cannot fit max_model_len is refused before it is tokenized;
- a request with more than LARGE_CHARS of text tokenizes on a lane of its own (one thread), so
  large requests queue behind each other, never in front of the small ones.
"""
from __future__ import annotations

import asyncio
import inspect
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engine.llm import as_token_ids

T = TypeVar("T")
_CHECK_EVERY = 256  # trace events between clock reads: the clock costs more than the check
LARGE_CHARS = 1 << 18  # characters of text above which a request tokenizes on the large lane
COMPOSE = 4  # most characters normalization (NFC, Hangul jamo) composes into one


class Tokenizing:
    def __init__(self, tokenizer: Any, threads: int, template_timeout_s: float) -> None:
        self.tok = tokenizer
        self.template_timeout_s = template_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtier-tokenize")
        self._large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-tokenize-large")
        self.max_token_chars = max(1, max(map(len, tokenizer.get_vocab()), default=1))
        # apply_chat_template's own parameters: in chat_template_kwargs they would change what it
        # returns (tokenize=False, return_tensors, truncation, ...) rather than feed the template.
        self.reserved_kwargs = frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) - {
            "conversation", "kwargs", "chat_template"}

    def min_tokens(self, chars: int) -> int:
        """At least this many tokens are in any text of `chars` characters."""
        return chars // (self.max_token_chars * COMPOSE)

    async def _run(self, fn: Callable[[], T], chars: int) -> T:
        pool = self._large if chars > LARGE_CHARS else self._pool
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    async def encode(self, prompts: list[str | list[int]], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each prompt (a list of ids is taken as it is)."""
        def work() -> list[list[int]]:
            return [list(p) if isinstance(p, list) else list(self.tok.encode(p, add_special_tokens=add_special_tokens))
                    for p in prompts]
        return await self._run(work, sum(len(p) for p in prompts if isinstance(p, str)))

    async def chat(self, convs: list[list[dict[str, Any]]], add_generation_prompt: bool, kwargs: dict[str, Any],
                   template: str | None, continue_final_message: bool = False, chars: int = 0) -> list[list[int]]:
        """Token ids of each conversation. Raises ValueError/TypeError/jinja errors for bad input,
        TimeoutError when a request-supplied `template` renders for longer than the bound.
        `kwargs` must not hold `reserved_kwargs` (the caller refuses those by name). `chars`: the
        conversations' text, which picks the lane."""
        def render(conv: list[dict[str, Any]]) -> list[int]:
            out = self.tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                                               chat_template=template,
                                               continue_final_message=continue_final_message, **kwargs)
            ids = as_token_ids(out)
            if not all(type(t) is int for t in ids):
                raise TypeError("chat_template_kwargs must not change the tokenizer's output format")
            return ids

        def work() -> list[list[int]]:
            if template is None:  # the operator's template: trusted, no tracing overhead
                return [render(c) for c in convs]
            return _with_deadline(lambda: [render(c) for c in convs], self.template_timeout_s)
        return await self._run(work, chars)

    async def chat_with(self, convs: list[list[dict[str, Any]]], add_generation_prompt: bool, kwargs: dict[str, Any],
                        template: str | None, continue_final_message: bool, chars: int,
                        process: Callable[[str, int], T]) -> list[T]:
        """`chat`'s rendering as text, each conversation's then given to `process(text, index)`
        (the checkpoint's processor, for prompts with images), off the event loop."""
        def render(i: int, conv: list[dict[str, Any]]) -> T:
            text = self.tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                chat_template=template,
                                                continue_final_message=continue_final_message, **kwargs)
            if not isinstance(text, str):
                raise TypeError("chat_template_kwargs must not change the tokenizer's output format")
            return process(text, i)

        def work() -> list[T]:
            if template is None:
                return [render(i, c) for i, c in enumerate(convs)]
            return _with_deadline(lambda: [render(i, c) for i, c in enumerate(convs)], self.template_timeout_s)
        return await self._run(work, chars)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._large.shutdown(wait=False, cancel_futures=True)


def _with_deadline(fn: Callable[[], T], timeout_s: float) -> T:
    """fn() in this thread, raising TimeoutError from inside its Python frames past the deadline."""
    deadline = time.monotonic() + timeout_s
    events = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal events
        events += 1
        if events % _CHECK_EVERY == 0 and time.monotonic() > deadline:
            raise TimeoutError(f"the chat template did not render within {timeout_s:g}s")
        return tracer

    sys.settrace(tracer)
    try:
        return fn()
    finally:
        sys.settrace(None)
