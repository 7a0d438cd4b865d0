"""Per-request controls on which tokens may come next, applied to a row's logits before
penalties and temperature (vLLM's built-in logits processors, OpenAI's `logit_bias`):

- `allowed_token_ids`: every other token is masked out;
- `bad_words`: a word's last token is masked out when the output so far ends with the word's
  other tokens (each word tokenized as written and with a leading space, as vLLM does);
- `logit_bias`: added to the token's logit (OpenAI: -100 bans a token, +100 all but forces it).

Log-probs stay those of the raw logits (vLLM's default `logprobs_mode`).
"""
from __future__ import annotations

from typing import Any

import torch

from engine.sampling_params import SamplingParams
from engine.token_ids import check_token_ids

BadWords = tuple[tuple[int, ...], ...]


def has_controls(params: SamplingParams) -> bool:
    return bool(params.logit_bias or params.allowed_token_ids or params.bad_words)


def bad_word_ids(words: list[str] | None, tokenizer: Any) -> BadWords:
    """Each word's token sequences: as written and, where it tokenizes differently, after a
    space (the word in the middle of a text); no special tokens."""
    out: list[tuple[int, ...]] = []
    for word in words or ():
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def checked_controls(params: SamplingParams, tokenizer: Any, vocab_size: int) -> BadWords:
    """ValueError for a control's token id outside the vocabulary; the bad words' token ids."""
    check_token_ids(params.logit_bias or (), vocab_size, "logit_bias token id")
    check_token_ids(params.allowed_token_ids or (), vocab_size, "allowed_token_ids entry")
    bad = bad_word_ids(params.bad_words, tokenizer)
    check_token_ids((t for seq in bad for t in seq), vocab_size, "bad_words token")
    return bad


def apply_controls(row: torch.Tensor, params: SamplingParams, bad_words: BadWords, output: list[int]) -> torch.Tensor:
    """`row` (float32 logits of one position, modified in place) after the request's controls."""
    if params.allowed_token_ids:
        keep = torch.tensor(params.allowed_token_ids, dtype=torch.long)
        masked = torch.full_like(row, float("-inf"))
        masked[keep] = row[keep]
        row.copy_(masked)
    for seq in bad_words:
        if len(seq) == 1 or (len(output) >= len(seq) - 1 and tuple(output[len(output) - len(seq) + 1:]) == seq[:-1]):
            row[seq[-1]] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        row.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=row.dtype))
    if not bool(torch.isfinite(row).any()):
        raise ValueError("no token is left to generate: allowed_token_ids, bad_words and logit_bias exclude them all")
    return row
