"""Reasoning models' thinking section and its token budget (vLLM's `reasoning_config` and
`thinking_token_budget`).

A thinking section runs from the start marker (`<think>`) to the end marker (`</think>`); the
prompt may open it (DeepSeek-R1's template ends with `<think>`). Once a request has spent its
budget of tokens inside thinking sections (all of them together), the engine forces the end
marker's tokens, one per position, whatever the logits say, and generation goes on with the
answer. An end marker the model has begun on its own is completed rather than restarted, so
the text never reads `</</think>`.

`ThinkingTracker` follows one request's emitted tokens (fed at sample time, so it is current
under async scheduling too) and says which token, if any, the next position must be.
Structured outputs apply to the answer only: a request's grammar is enforced while the tracker
is outside a thinking section (`answering`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

MAX_BUDGET = 2**31 - 1


def check_budget(budget: object, name: str = "thinking_token_budget") -> None:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                               or not 0 <= budget <= MAX_BUDGET):
        raise ValueError(f"{name} must be a non-negative integer; got {budget!r}")


@dataclass(frozen=True)
class ReasoningConfig:
    """vLLM's `--reasoning-config`: the markers' text and the default budget (None: none)."""

    reasoning_start_str: str = "<think>"
    reasoning_end_str: str = "</think>"
    thinking_token_budget: int | None = None

    def __post_init__(self) -> None:
        for name in ("reasoning_start_str", "reasoning_end_str"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"reasoning_config {name} must be a non-empty string")
        if self.reasoning_start_str == self.reasoning_end_str:
            raise ValueError("reasoning_config start and end strings must differ")
        check_budget(self.thinking_token_budget, "reasoning_config thinking_token_budget")

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> ReasoningConfig | None:
        if d is None:
            return None
        if not isinstance(d, dict):
            raise ValueError(f"reasoning_config must be a JSON object; got {d!r}")
        unknown = sorted(set(d) - {"reasoning_start_str", "reasoning_end_str", "thinking_token_budget"})
        if unknown:
            raise ValueError(f"reasoning_config: unknown key(s) {unknown}; it takes reasoning_start_str, "
                             "reasoning_end_str and thinking_token_budget")
        return ReasoningConfig(**d)


@dataclass(frozen=True)
class Markers:
    """The markers as token ids (tokenized as the model writes them: no special tokens added)."""

    start: tuple[int, ...]
    end: tuple[int, ...]

    @staticmethod
    def of(config: ReasoningConfig, tokenizer: Any) -> Markers:
        start = tuple(tokenizer.encode(config.reasoning_start_str, add_special_tokens=False))
        end = tuple(tokenizer.encode(config.reasoning_end_str, add_special_tokens=False))
        if not start or not end:
            raise ValueError("reasoning_config markers tokenize to nothing")
        return Markers(start, end)


class Phase(enum.Enum):
    ANSWER = "answer"  # outside any thinking section
    THINKING = "thinking"
    FORCING = "forcing"  # the budget is spent: the end marker's tokens are being forced


def _ends_with(seq: list[int], tail: tuple[int, ...]) -> bool:
    return len(seq) >= len(tail) and tuple(seq[len(seq) - len(tail):]) == tail


def _last(seq: list[int], sub: tuple[int, ...]) -> int:
    """Index just past the last occurrence of `sub` in `seq`; -1 if none."""
    n = len(sub)
    for i in range(len(seq) - n, -1, -1):
        if seq[i] == sub[0] and tuple(seq[i:i + n]) == sub:
            return i + n
    return -1


class ThinkingTracker:
    """One request's thinking state. `budget` None: count only, never force."""

    def __init__(self, markers: Markers, budget: int | None, prompt_ids: list[int]) -> None:
        self.m = markers
        self.budget = budget
        self.thinking_tokens = 0  # inside thinking sections, end markers excluded
        self.forced_tokens = 0
        self._keep = max(len(markers.start), len(markers.end))
        self._tail = list(prompt_ids[-self._keep:])  # the last tokens, enough to recognise a marker
        self._in_section = 0  # tokens since the open section began
        self._forced_at = 0  # FORCING: index in the end marker of the next forced token
        opened = _last(prompt_ids, markers.start) > _last(prompt_ids, markers.end)
        self.phase = Phase.THINKING if opened else Phase.ANSWER
        if opened:
            self._maybe_force()

    @property
    def answering(self) -> bool:
        return self.phase is Phase.ANSWER

    def forced_next(self) -> int | None:
        """The token the next position must be, or None when the model chooses."""
        return self.m.end[self._forced_at] if self.phase is Phase.FORCING else None

    def room(self) -> int | None:
        """Tokens that may still be emitted before one is forced; None: no limit in sight."""
        if self.phase is Phase.FORCING:
            return 0
        if self.phase is Phase.THINKING and self.budget is not None:
            return self.budget - self.thinking_tokens
        return None

    def accept(self, token: int) -> None:
        self._tail = (self._tail + [token])[-self._keep:]
        if self.phase is Phase.FORCING:
            self.forced_tokens += 1
            self._forced_at += 1
            if self._forced_at == len(self.m.end):
                self.phase = Phase.ANSWER
            return
        if self.phase is Phase.ANSWER:
            if _ends_with(self._tail, self.m.start):
                self.phase = Phase.THINKING
                self._in_section = 0
                self._maybe_force()
            return
        if _ends_with(self._tail, self.m.end):
            # The marker's earlier tokens in the output were counted as thinking until it completed.
            self.thinking_tokens -= min(len(self.m.end) - 1, self._in_section)
            self.phase = Phase.ANSWER
            return
        self.thinking_tokens += 1
        self._in_section += 1
        self._maybe_force()

    def clamp(self, tokens: list[int]) -> list[int]:
        """Several tokens a step emitted (speculative decoding), accepted in order and cut at the
        first position that must be forced and was not: that position gets the forced token and
        the rest are dropped, as if verification had rejected them."""
        out: list[int] = []
        for t in tokens:
            forced = self.forced_next()
            if forced is not None and t != forced:
                out.append(forced)
                self.accept(forced)
                break
            out.append(t)
            self.accept(t)
        return out

    def _maybe_force(self) -> None:
        if self.budget is None or self.thinking_tokens < self.budget:
            return
        # Complete an end marker the model has begun (its tokens so far are in the count).
        begun = next((k for k in range(min(len(self.m.end) - 1, self._in_section), 0, -1)
                      if _ends_with(self._tail, self.m.end[:k])), 0)
        self.thinking_tokens -= begun
        self.phase = Phase.FORCING
        self._forced_at = begun


def tracker_for(markers: Markers | None, default_budget: int | None, budget: int | None,
                prompt_ids: list[int]) -> ThinkingTracker | None:
    """A request's tracker: None when the engine knows no markers (then a budget is an error)."""
    if markers is None:
        if budget is not None:
            raise ValueError("thinking_token_budget needs the reasoning markers: start the engine with "
                             "reasoning_config (kvtier serve: --reasoning-parser or --reasoning-config)")
        return None
    return ThinkingTracker(markers, default_budget if budget is None else budget, prompt_ids)
