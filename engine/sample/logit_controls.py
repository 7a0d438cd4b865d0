"""Per-request controls on which tokens may come next, applied to a row's logits before
penalties and temperature (vLLM's built-in logits processors, OpenAI's `logit_bias`):

- `allowed_token_ids`: every other token is masked out;
- `bad_words`: a word's last token is masked out when the output so far ends with the word's
  other tokens (each word tokenized as written and with a leading space, as vLLM does);
- `logit_bias`: added to the token's logit (OpenAI: -100 bans a token, +100 all but forces it).

Log-probs stay those of the raw logits (vLLM's default `logprobs_mode`).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from engine.sampling_params import SamplingParams
from engine.core.token_ids import check_token_ids


class BadWords:
    """A request's bad words as token sequences, indexed so a sampled row costs one lookup per
    distinct word length, not one comparison per word (a list of 50k words made every step of the
    request, and building it, that much slower).

    `singles`: tokens banned everywhere; `by_prefix[n]`: for words of n + 1 tokens, the tokens
    banned after each n-token prefix."""

    def __init__(self, sequences: Iterable[tuple[int, ...]] = ()) -> None:
        self.sequences = tuple(dict.fromkeys(s for s in sequences if s))  # ordered, deduplicated: linear
        singles = sorted({s[0] for s in self.sequences if len(s) == 1})
        self.singles = torch.tensor(singles, dtype=torch.long) if singles else None
        self.by_prefix: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for s in self.sequences:
            if len(s) > 1:
                self.by_prefix.setdefault(len(s) - 1, {}).setdefault(s[:-1], []).append(s[-1])

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self.sequences)

    def __contains__(self, seq: object) -> bool:
        return seq in self.sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def banned_after(self, output: list[int]) -> list[int]:
        """Tokens that would complete a multi-token word after `output`."""
        out: list[int] = []
        for n, table in self.by_prefix.items():
            if len(output) >= n:
                out += table.get(tuple(output[len(output) - n:]), ())
        return out


NO_BAD_WORDS = BadWords()
NOTHING_LEFT = "no token is left to generate: allowed_token_ids, bad_words and logit_bias exclude them all"


def has_controls(params: SamplingParams) -> bool:
    return bool(params.logit_bias or params.allowed_token_ids or params.bad_words)


BAD_WORDS_CHUNK = 1024  # texts per native encode: each call holds the GIL briefly, so the step loop keeps it


def bad_word_ids(words: list[str] | None, tokenizer: Any) -> BadWords:
    """Each word's token sequences: as written and, where it tokenizes differently, after a
    space (the word in the middle of a text); no special tokens.

    A fast tokenizer encodes them in chunks through its Rust backend (which releases the GIL):
    word by word, 50,000 words took 1.6 s of Python on the engine core's preparation thread and
    slowed the step loop beside it through the GIL."""
    texts = [text for word in words or () for text in (word.lstrip(), " " + word.lstrip())]
    backend = getattr(tokenizer, "backend_tokenizer", None)  # absent on slow (Python) tokenizers
    if backend is None:
        return BadWords(tuple(tokenizer.encode(t, add_special_tokens=False)) for t in texts)
    ids: list[tuple[int, ...]] = []
    for i in range(0, len(texts), BAD_WORDS_CHUNK):
        ids += (tuple(e.ids) for e in backend.encode_batch(texts[i:i + BAD_WORDS_CHUNK], add_special_tokens=False))
    return BadWords(ids)


def check_controls(params: SamplingParams, vocab_size: int) -> None:
    """ValueError for a logit_bias or allowed_token_ids id outside the vocabulary (cheap)."""
    check_token_ids(params.logit_bias or (), vocab_size, "logit_bias token id")
    check_token_ids(params.allowed_token_ids or (), vocab_size, "allowed_token_ids entry")


def checked_bad_words(params: SamplingParams, tokenizer: Any, vocab_size: int) -> BadWords:
    """The bad words' token ids (linear in their number); ValueError for one outside the vocabulary."""
    if not params.bad_words:
        return NO_BAD_WORDS
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
    if bad_words.singles is not None:
        row[bad_words.singles] = float("-inf")
    if bad_words.by_prefix and (after := bad_words.banned_after(output)):
        row[after] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        row.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=row.dtype))
    if not bool(torch.isfinite(row).any()):
        raise ValueError(NOTHING_LEFT)
    return row
