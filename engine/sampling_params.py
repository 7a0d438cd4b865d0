"""Per-request sampling settings, in vLLM's shape. Validated at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sample.structured import StructuredOutputsParams
from engine.sample.prompt_logprobs import MAX_PROMPT_LOGPROBS
from engine.sample.thinking import check_budget

GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (0 included) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n log-probs per generated token (plus the chosen one)
    # vLLM's: top-n log-probs at each prompt position, with the prompt token's own and its rank
    # (engine/sample/prompt_logprobs.py); such a request's prompt is computed, not read from a cache.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Which tokens may come next (engine/sample/logit_controls.py): a bias added to listed tokens' logits
    # (OpenAI's, -100..100), the only tokens allowed, words never to complete.
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # A grammar the output follows (engine/sample/structured.py); a dict of its fields is accepted.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's: tokens a reasoning model may spend thinking before the engine forces the end marker
    # (engine/sample/thinking.py); None: the engine's reasoning_config default, if any.
    thinking_token_budget: int | None = None
    # For parity tests and scoring: keep the raw logits of the first sampled position.
    return_first_logits: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported yet; only n=1")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive; got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1]; got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2]; got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2]; got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0; got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1; got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens]; got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0; got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_PROMPT_LOGPROBS}]; got {self.prompt_logprobs}")
        if self.logit_bias is not None:
            for t, b in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or isinstance(b, bool) \
                        or not isinstance(b, (int, float)) or not -100 <= b <= 100:
                    raise ValueError(f"logit_bias maps token ids to numbers in [-100, 100]; got {t!r}: {b!r}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty (no token could be generated)")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        object.__setattr__(self, "structured_outputs", StructuredOutputsParams.coerce(self.structured_outputs))
        if self.structured_outputs is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with structured outputs: the grammar ends at a stop token")
        check_budget(self.thinking_token_budget)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        if self.stop is not None and any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE, logits / temperature overflows float32 (1e-38 gave inf, then
        # NaN probabilities and token 0 every time); vLLM draws the same line.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1
