"""Tokenization and chat templating for the API process, off its event loop.

A 7 MB prompt, a request with thousands of prompts or a slow template took the event loop for
seconds, and with it every other route. Here that work runs on a small thread pool (its size
bounds how many requests tokenize at once; the rest wait their turn without blocking the loop).
A chat template that came with the request (only with --trust-request-chat-template) renders
under a deadline: a trace function stops its Python frames once the time is up, so a template
with nested loops fails that request instead of holding a thread for minutes.
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


class Tokenizing:
    def __init__(self, tokenizer: Any, threads: int, template_timeout_s: float) -> None:
        self.tok = tokenizer
        self.template_timeout_s = template_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvtier-tokenize")
        # apply_chat_template's own parameters: in chat_template_kwargs they would change what it
        # returns (tokenize=False, return_tensors, truncation, ...) rather than feed the template.
        self.reserved_kwargs = frozenset(inspect.signature(tokenizer.apply_chat_template).parameters) - {
            "conversation", "kwargs", "chat_template"}

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def encode(self, prompts: list[str | list[int]], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each prompt (a list of ids is taken as it is)."""
        def work() -> list[list[int]]:
            return [list(p) if isinstance(p, list) else list(self.tok.encode(p, add_special_tokens=add_special_tokens))
                    for p in prompts]
        return await self._run(work)

    async def chat(self, convs: list[list[dict[str, Any]]], add_generation_prompt: bool, kwargs: dict[str, Any],
                   template: str | None, continue_final_message: bool = False) -> list[list[int]]:
        """Token ids of each conversation. Raises ValueError/TypeError/jinja errors for bad input,
        TimeoutError when a request-supplied `template` renders for longer than the bound.
        `kwargs` must not hold `reserved_kwargs` (the caller refuses those by name)."""
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
        return await self._run(work)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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
