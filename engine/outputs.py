"""What the offline API returns, in vLLM's shape."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's log-probability and its rank in the distribution (1 = the likeliest)."""
    logprob: float
    rank: int


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    # With reasoning_config (engine/sample/thinking.py): tokens spent inside thinking sections (end
    # markers excluded), and the end-marker tokens a spent thinking_token_budget forced.
    thinking_tokens: int | None = None
    thinking_forced_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    # prompt_logprobs (vLLM's shape): None for the first token, then {token id: Logprob} for the
    # prompt token and the top-k; None when not asked for.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # Prompt tokens this request did not compute, by the tier that supplied them ("G1", ...).
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # set when finish_reason is "error"
