"""`speculative_config` (vLLM's keys): which proposer drafts tokens, and how many.

`method` picks the proposer: `ngram` (prompt lookup: `prompt_lookup_min`, `prompt_lookup_max`),
`draft_model` (`model`: a small HF checkpoint with the target's tokenizer) or `eagle3` (`model`:
an EAGLE-3 draft in `speculators`' format); `num_speculative_tokens` is k, the tokens proposed
per step. `extract_hidden_states` is not speculation (it drafts nothing) and is parsed by
`connectors.hidden_spec`; the two do not compose. An unknown key is an error naming it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from connectors.hidden_spec import METHOD as EXTRACT_METHOD
from connectors.hidden_spec import HiddenStatesSpec, load_speculative_config

MAX_SPECULATIVE_TOKENS = 16  # beyond this the verify forward is mostly wasted work


class SpecMethod(enum.Enum):
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"
    EAGLE3 = "eagle3"


_KEYS = {
    SpecMethod.NGRAM: {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive"},
    SpecMethod.DRAFT_MODEL: {"method", "num_speculative_tokens", "model", "adaptive"},
    SpecMethod.EAGLE3: {"method", "num_speculative_tokens", "model", "adaptive"},
}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpecMethod
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0
    model: str | None = None  # draft_model, eagle3
    # kvtier's own key: proposal lengths chosen by cost and measured acceptance (spec_budget.py);
    # false proposes num_speculative_tokens whenever the proposer has them, as vLLM does.
    adaptive: bool = True

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer in "
                             f"1..{MAX_SPECULATIVE_TOKENS}; got {k!r}")
        if self.method is SpecMethod.NGRAM:
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if any(isinstance(v, bool) or not isinstance(v, int) for v in (lo, hi)) or not 1 <= lo <= hi:
                raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max (integers); "
                                 f"got {lo!r}, {hi!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false; got {self.adaptive!r}")
        if self.method is not SpecMethod.NGRAM and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config method {self.method.value!r} needs \"model\": the draft's "
                             "checkpoint directory")

    @staticmethod
    def from_dict(cfg: dict[str, Any]) -> SpeculativeConfig:
        try:
            method = SpecMethod(cfg.get("method"))
        except ValueError:
            known = ", ".join([m.value for m in SpecMethod] + [EXTRACT_METHOD])
            raise ValueError(f"speculative_config method {cfg.get('method')!r} is not supported; "
                             f"kvtier supports {known}") from None
        unknown = sorted(set(cfg) - _KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config key(s) {', '.join(map(repr, unknown))} not supported for method "
                             f"{method.value!r}; it takes {', '.join(sorted(_KEYS[method]))}")
        if "num_speculative_tokens" not in cfg:
            raise ValueError("speculative_config needs num_speculative_tokens")
        lo, hi = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
        if method is SpecMethod.NGRAM:  # vLLM's defaults: 5 and 5, or one from the other
            lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
        return SpeculativeConfig(method, cfg["num_speculative_tokens"], lo or 0, hi or 0, cfg.get("model"),
                                 cfg.get("adaptive", True))


def parse_speculative_config(cfg: dict[str, Any] | str | None) -> tuple[HiddenStatesSpec | None, SpeculativeConfig | None]:
    """(hidden-state export settings, speculation settings): at most one is set."""
    cfg = load_speculative_config(cfg)
    if cfg is None:
        return None, None
    if cfg.get("method") == EXTRACT_METHOD:
        return HiddenStatesSpec.from_speculative_config(cfg), None
    return None, SpeculativeConfig.from_dict(cfg)
