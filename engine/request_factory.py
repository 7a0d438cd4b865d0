"""Building validated requests: what a request's settings need from the model (its vocabulary,
stop tokens, tokenizer) is checked and prepared here, before the engine's state is touched."""
from __future__ import annotations

from typing import Any

from connectors.pd import PDRequest
from engine.logit_controls import checked_controls
from engine.request import Request, RequestId
from engine.sampling_params import SamplingParams
from engine.structured import LazyGrammarCompiler
from engine.thinking import Markers, ReasoningConfig, tracker_for
from engine.token_ids import check_token_ids


class RequestFactory:
    """Owns the per-engine helpers requests are built with: the grammar compiler (structured
    outputs) and the thinking markers (reasoning_config)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int],
                 reasoning: ReasoningConfig | None) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self._grammars = LazyGrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.reasoning = reasoning
        self._markers = Markers.of(reasoning, tokenizer) if reasoning is not None else None

    def make(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, max_model_len: int, *,
             prompt: str | None = None, priority: int = 0, cache_salt: str | None = None,
             session: str | None = None, pd: PDRequest | None = None) -> Request:
        """ValueError naming what is wrong with the request."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty: it must contain at least one token")
        if n >= max_model_len:
            raise ValueError(f"prompt has {n} tokens but max_model_len is {max_model_len} "
                             "(the prompt plus at least one generated token must fit)")
        check_token_ids(prompt_token_ids, self.vocab_size, "prompt token id")
        check_token_ids(params.stop_token_ids or (), self.vocab_size, "stop_token_ids entry")
        bad = checked_controls(params, self.tokenizer, self.vocab_size)
        grammar = self._grammars.matcher(params.structured_outputs) if params.structured_outputs else None
        default_budget = self.reasoning.thinking_token_budget if self.reasoning is not None else None
        thinking = tracker_for(self._markers, default_budget, params.thinking_token_budget, prompt_token_ids)
        return Request(RequestId(request_id), prompt_token_ids, params, prompt=prompt, priority=priority,
                       cache_salt=cache_salt, session=session, eos_token_ids=self.eos_token_ids, max_total_tokens=max_model_len,
                       bad_word_ids=bad, grammar=grammar, thinking=thinking, pd=pd)
