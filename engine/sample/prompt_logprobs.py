"""vLLM's `prompt_logprobs`: the log-probability of each prompt token given the tokens before
it, with the request's top-k alternatives and the token's rank.

The model runner keeps the hidden rows of a step's prompt positions for requests that asked
(`PromptRows`, chosen when the step is prepared) and turns them into entries after the forward
(`prompt_logprobs`), in slices so a long prompt chunk never holds a [chunk, vocab] matrix. A
request that wants them is computed from its first token: the scheduler skips prefix-cache and
offload lookups for it until its prompt's entries are complete (`Request.wants_prompt_logprobs`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.outputs import Logprob

MAX_PROMPT_LOGPROBS = 20  # vLLM's max_logprobs default
SLICE_ROWS = 256  # rows of logits computed at once: [256, vocab] float32 is 50 MB at a 49k vocabulary

# (rank of the prompt token, {token id: logprob} for it and the top-k)
PromptLogprob = tuple[int, dict[int, float]]


@dataclass(frozen=True)
class PromptRows:
    """One scheduled entry's prompt positions in a step: hidden rows and the tokens they predict."""

    index: int  # into the step's scheduled entries
    first_position: int  # position whose row is rows[0]: its entry is the (first_position + 1)-th token's
    rows: list[int]
    targets: list[int]
    top_k: int


def select(index: int, prompt: list[int], start: int, n: int, q_start: int, top_k: int) -> PromptRows | None:
    """The rows of positions start..start+n-1 that predict a prompt token (the last prompt
    position predicts the first output token: the sampler's row, not a prompt entry)."""
    end = min(start + n, len(prompt) - 1)
    if end <= start:
        return None
    return PromptRows(index, start, list(range(q_start, q_start + end - start)), prompt[start + 1:end + 1], top_k)


@torch.inference_mode()
def prompt_logprobs(hidden: torch.Tensor, picks: list[PromptRows],
                    compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, tuple[int, list[PromptLogprob]]]:
    """{scheduled index: (first position, an entry per row)}."""
    out: dict[int, tuple[int, list[PromptLogprob]]] = {}
    for pick in picks:
        entries: list[PromptLogprob] = []
        for lo in range(0, len(pick.rows), SLICE_ROWS):
            rows, targets = pick.rows[lo:lo + SLICE_ROWS], pick.targets[lo:lo + SLICE_ROWS]
            lp = torch.log_softmax(compute_logits(hidden[rows]).float(), dim=-1)
            tgt = torch.tensor(targets, device=lp.device)
            chosen = lp.gather(1, tgt[:, None])[:, 0]
            ranks = (lp > chosen[:, None]).sum(dim=1) + 1
            top = lp.topk(pick.top_k, dim=-1) if pick.top_k else None
            for i, (t, v, r) in enumerate(zip(targets, chosen.tolist(), ranks.tolist())):
                entry = {t: v}
                if top is not None:
                    entry.update(zip(top.indices[i].tolist(), top.values[i].tolist()))
                entries.append((r, entry))
        out[pick.index] = (pick.first_position, entries)
    return out


def with_ranks(entry: PromptLogprob) -> dict[int, Logprob]:
    """{token id: Logprob}: the prompt token's own rank; the top-k's are their order."""
    rank, lps = entry
    target = next(iter(lps))  # listed first
    order = {t: i + 1 for i, t in enumerate(sorted(lps, key=lambda t: -lps[t]))}
    return {t: Logprob(v, rank if t == target else order[t]) for t, v in lps.items()}
