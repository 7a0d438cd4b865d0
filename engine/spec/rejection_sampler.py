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

`verify_batch` verifies many requests at once, where their logits are: one gather for the
ratio tests and one draw for every request's last token (the per-request loop's Python and row
copies were most of a verify step at 256 requests). It consumes its generator differently from
`verify`, so it serves the requests that draw from the engine's stream; a seeded request keeps
`verify` and its own generator. `engine.spec.decode.SpecDecoder` chooses between them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.runner.h2d import to_device
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


def verify_batch(drafts: list[tuple[int, ...]], target: torch.Tensor, draft_probs: list[torch.Tensor | None],
                 generator: torch.Generator | None = None) -> list[list[int]]:
    """The tokens each request emits, as `verify` would distribute them: request j proposed
    `drafts[j]` (k_j tokens, k_j >= 1) from `draft_probs[j]` (`[k_j, vocab]`, or None: a point
    mass); `target` (`[sum(k_j + 1), vocab]` float64, rows normalised, on any device) holds each
    request's k_j + 1 target distributions in turn. `generator` is on the target's device."""
    if len(drafts) != len(draft_probs) or any(not d for d in drafts):
        raise ValueError("verify_batch needs one non-empty proposal and one draft_probs entry per request")
    dev, vocab = target.device, target.shape[1]
    ks = [len(d) for d in drafts]
    starts, q_starts = [0], [0]  # each request's first target row, its first draft row
    for k in ks:
        starts.append(starts[-1] + k + 1)
        q_starts.append(q_starts[-1] + k)
    if target.shape[0] != starts[-1]:
        raise ValueError(f"target has {target.shape[0]} rows; the proposals need {starts[-1]}")
    flat = [t for d in drafts for t in d]
    if any(not 0 <= t < vocab for t in flat):
        raise ValueError(f"a proposed token id is outside the vocabulary of {vocab}")
    # A point-mass proposal is q = one-hot(d): q(d) = 1, and max(p - q, 0) is p with p(d) zeroed.
    q = torch.cat([qj.to(dev, torch.float64) if qj is not None else
                   torch.nn.functional.one_hot(to_device(list(d), dev), vocab).double()
                   for d, qj in zip(drafts, draft_probs)])
    if q.shape != (len(flat), vocab):
        raise ValueError(f"draft_probs must be [k, {vocab}] per request, together {len(flat)} rows; got {tuple(q.shape)}")
    rows = to_device([s + i for s, k in zip(starts, ks) for i in range(k)], dev)
    tok = to_device(flat, dev)
    p_d, q_d = target[rows, tok], q[torch.arange(len(flat), device=dev), tok]
    uniforms = torch.rand(len(flat), dtype=torch.float64, device=dev, generator=generator)
    accept = (uniforms * q_d < p_d).tolist()  # u < p/q without dividing by a q of 0
    kept, at = [], 0
    for k in ks:  # each request keeps its proposals up to the first refusal
        n = 0
        while n < k and accept[at + n]:
            n += 1
        kept.append(n)
        at += k
    # Its last token: from the residual at its first refusal, or from the bonus row.
    last = to_device([s + n for s, n in zip(starts, kept)], dev)
    refused = [i for i, (k, n) in enumerate(zip(ks, kept)) if n < k]
    weights = target[last]
    if refused:
        q_rows = to_device([q_starts[i] + kept[i] for i in refused], dev)
        at_refused = to_device(refused, dev)
        weights[at_refused] = (weights[at_refused] - q[q_rows]).clamp_(min=0)
        empty = ~(weights.sum(dim=1) > 0)  # p == q to rounding: any draw from p is exact
        weights = torch.where(empty[:, None], target[last], weights)
    drawn = categorical(weights, generator).tolist()
    return [list(d[:n]) + [t] for d, n, t in zip(drafts, kept, drawn)]
