"""Speculative decoding's verification: which proposed tokens a request keeps (issue 15).

Standard speculative sampling (Leviathan et al., Chen et al.): the target model scores the k
proposed tokens d_1..d_k in one forward, giving k + 1 distributions p_1..p_{k+1}; the proposer
drew d_i from q_i. Token d_i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first
refusal a token is drawn from the residual max(p_i - q_i, 0), normalised, and the rest is
dropped; if all k are kept, a bonus token is drawn from p_{k+1}. The emitted tokens are then
distributed exactly as the target's own samples. A proposer without probabilities (n-gram
lookup) is a point mass, q_i(d_i) = 1. Greedy requests keep the longest prefix that equals the
target's argmax and then take the argmax.

Precision, as vLLM's sampler: the ratio test and the residual in float64, uniforms in float64,
the residual draw in float64 (engine/sample/draw.py). Each request draws from its own
generator, so a seeded request's output does not depend on its batch.

`engine.spec.decode.SpecDecoder` calls it for each request with proposals.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sample.draw import categorical


@dataclass(frozen=True)
class VerifyRequest:
    """One request's part of a verification batch.

    `target_probs` `[k + 1, vocab]`: the target's sampling distribution at each proposed position
    and the one after (after temperature, top-k/top-p: what it would sample from); ignored for
    greedy requests, which use `target_logits`. `draft_probs` `[k, vocab]` or None for a point-mass
    proposer."""

    draft_token_ids: tuple[int, ...]
    target_logits: torch.Tensor
    target_probs: torch.Tensor | None = None
    draft_probs: torch.Tensor | None = None
    greedy: bool = False

    def __post_init__(self) -> None:
        k = len(self.draft_token_ids)
        if self.target_logits.dim() != 2 or self.target_logits.shape[0] != k + 1:
            raise ValueError(f"target_logits must be [{k + 1}, vocab], got {tuple(self.target_logits.shape)}")
        vocab = self.target_logits.shape[1]
        if not self.greedy and (self.target_probs is None or self.target_probs.shape != (k + 1, vocab)):
            raise ValueError(f"a sampled request needs target_probs of shape [{k + 1}, {vocab}]")
        if self.draft_probs is not None and self.draft_probs.shape != (k, vocab):
            raise ValueError(f"draft_probs must be [{k}, {vocab}], got {tuple(self.draft_probs.shape)}")
        if any(not 0 <= t < vocab for t in self.draft_token_ids):
            raise ValueError(f"a proposed token id is outside the vocabulary of {vocab}")


def verify(req: VerifyRequest, generator: torch.Generator | None = None) -> list[int]:
    """The tokens the request emits this step: the kept proposals plus one more (1 to k + 1)."""
    drafts = req.draft_token_ids
    if req.greedy:
        return accept_greedy(drafts, req.target_logits.argmax(dim=-1).tolist())
    p = req.target_probs.double()
    q = req.draft_probs.double() if req.draft_probs is not None else None
    uniforms = torch.rand(len(drafts), dtype=torch.float64, generator=generator)
    out = []
    for i, d in enumerate(drafts):
        q_d = float(q[i, d]) if q is not None else 1.0
        if float(uniforms[i]) * q_d < float(p[i, d]):  # u < p/q without dividing by a q of 0
            out.append(d)
            continue
        if q is not None:
            residual = (p[i] - q[i]).clamp_(min=0)
        else:
            residual = p[i].clone()
            residual[d] = 0.0
        if not float(residual.sum()) > 0:  # p == q to rounding: any draw from p is exact
            residual = p[i]
        return out + [_draw(residual, generator)]
    return out + [_draw(p[len(drafts)], generator)]


def accept_greedy(drafts: tuple[int, ...] | list[int], best: list[int]) -> list[int]:
    """Greedy verification given the target's argmax at each of the k + 1 positions: the
    longest prefix of `drafts` that matches, then the target's own token."""
    out: list[int] = []
    for d, t in zip(drafts, best):
        out.append(t)
        if t != d:
            return out
    return out + [best[len(drafts)]]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A draw proportional to non-negative `weights` (float64; engine/sample/draw.py)."""
    return int(categorical(weights, generator))
