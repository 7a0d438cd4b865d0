"""Building validated requests: what a request's settings need from the model (its vocabulary,
stop tokens, tokenizer) is checked and prepared here, before the engine's state is touched.

Two stages, so that a server can keep the slow one off its step loop (server/core_prep.py):
`prepare` does what a client's input can make slow (tokenizing bad words, compiling a grammar:
seconds for a large constraint) and is safe to call from another thread; `make` does the rest,
which is cheap. Offline, `make` prepares on the caller's thread."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from connectors.pd import PDRequest
from engine.sample.logit_controls import NO_BAD_WORDS, BadWords, check_controls, checked_bad_words
from engine.core.request import Request, RequestId
from engine.lora.registry import AdapterRef
from engine.mm.inputs import MMInputs
from engine.sampling_params import SamplingParams
from engine.sample.structured import LazyGrammarCompiler
from engine.sample.thinking import Markers, ReasoningConfig, tracker_for
from engine.core.token_ids import check_token_ids


def needs_preparation(params: SamplingParams) -> bool:
    """Whether `prepare` has slow work for these settings (a server runs it off the step loop and
    answers the client once it is done)."""
    return bool(params.bad_words or params.structured_outputs)


@dataclass(frozen=True)
class Prepared:
    """What `prepare` made of a request's settings."""

    bad_words: BadWords = NO_BAD_WORDS
    grammar: Any = None  # the compiled grammar of params.structured_outputs (engine/sample/structured.py)


class RequestFactory:
    """Owns the per-engine helpers requests are built with: the grammar compiler (structured
    outputs) and the thinking markers (reasoning_config)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 reasoning: ReasoningConfig | None) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._grammars = LazyGrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.reasoning = reasoning
        self._markers = Markers.of(reasoning, tokenizer) if reasoning is not None else None

    def warm_grammars(self) -> None:
        """Builds the grammar compiler now (the tokenizer's vocabulary in xgrammar's tables, and the
        imports that takes): a server does it before serving, so a first constrained request's
        preparation holds no GIL stretches beside the step loop."""
        self._grammars.get()

    def prepare(self, params: SamplingParams) -> Prepared:
        """The slow, input-sized part of building a request; ValueError naming what is wrong.
        Thread-safe."""
        if not needs_preparation(params):
            return Prepared()
        bad = checked_bad_words(params, self.tokenizer, self.vocab_size)
        so = params.structured_outputs
        return Prepared(bad, self._grammars.get().checked(so) if so is not None else None)

    def make(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, *,
             prompt: str | None = None, priority: int = 0, cache_salt: str | None = None,
             session: str | None = None, pd: PDRequest | None = None, prepared: Prepared | None = None,
             mm: MMInputs | None = None, lora: AdapterRef | None = None) -> Request:
        """ValueError naming what is wrong with the request. `prepared`: `prepare(params)` done
        already (elsewhere); None prepares here."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: it must contain at least one token")
        if n >= max_model_len:
            raise ValueError(f"prompt has {n} tokens but max_model_len is {max_model_len} "
                             "(the prompt plus at least one generated token must fit)")
        check_token_ids(prompt_token_ids, self.vocab_size, "prompt token id")
        check_token_ids(params.stop_token_ids or (), self.vocab_size, "stop_token_ids entry")
        check_controls(params, self.vocab_size)
        if prepared is None:
            prepared = self.prepare(params)
        grammar = self._grammars.get().state(prepared.grammar) if prepared.grammar is not None else None
        default_budget = self.reasoning.thinking_token_budget if self.reasoning is not None else None
        thinking = tracker_for(self._markers, default_budget, params.thinking_token_budget, prompt_token_ids)
        return Request(RequestId(request_id), prompt_token_ids, params, prompt=prompt, priority=priority,
                       cache_salt=cache_salt, session=session, eos_token_ids=self.eos_token_ids, max_total_tokens=max_model_len,
                       bad_word_ids=prepared.bad_words, grammar=grammar, thinking=thinking, pd=pd, mm=mm,
                       lora=lora)
