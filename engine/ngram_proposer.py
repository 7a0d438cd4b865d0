"""Prompt-lookup proposals (`speculative_config` method `ngram`, vLLM's keys).

The last n tokens of a sequence (n from `prompt_lookup_max` down to `prompt_lookup_min`) are
looked up earlier in the same sequence, prompt and output; the tokens that followed the most
recent earlier occurrence are the proposal. It costs no model and pays off where the output
copies its input (summaries, edits, code). `engine.spec_decode` adapts it to the batch `Proposer` interface.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NgramProposer:
    prompt_lookup_min: int
    prompt_lookup_max: int
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max; got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1; got {self.num_speculative_tokens}")

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to `num_speculative_tokens` tokens, or none when no suffix recurs."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        total = tokens.shape[0]
        for n in range(min(self.prompt_lookup_max, total - 1), self.prompt_lookup_min - 1, -1):
            suffix = tokens[total - n:]
            # Windows of n tokens followed by at least one token (so never the suffix itself).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: total - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence
                return tokens[start : start + self.num_speculative_tokens].tolist()
        return []
