"""Drawing a token from a distribution: every sampled token, draft token and residual goes here.

On CUDA, an exponential race (Gumbel-max's equivalent): argmax(p / E) with one Exp(1) draw per
vocabulary entry; Philox makes those draws nearly free and the race is one parallel pass. On the
CPU that draw dominated: `exponential_` costs ~28 ns an element there (a 64-row step over a
49,152-token vocabulary spent 86 ms drawing, more than its forward), so the CPU inverts the CDF
instead: a float64 cumulative sum, one float64 uniform per row, a binary search (~10 ms for the
same rows). Both are exact draws from the weights (to float64 rounding); they consume a
generator's stream differently, so a seeded request's tokens differ between the two devices'
algorithms but not between runs on one.
"""
from __future__ import annotations

import torch


def categorical(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices drawn with probability proportional to the non-negative, finite `weights` (`[vocab]`
    or `[n, vocab]`, not necessarily normalised): a 0-d or `[n]` int64 tensor on their device. A row
    whose weights sum to 0 gets some index; callers replace it (their degenerate case)."""
    if weights.device.type == "cuda":
        e = torch.empty_like(weights).exponential_(generator=generator)
        return (weights / e).argmax(dim=-1)
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[..., -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=cdf.device, generator=generator) * total
    # The first entry whose cumulative weight exceeds u: a zero weight never is one (u >= 0 and its
    # sum equals the entry before it), and u < total keeps the index in range but for total == 0.
    at = torch.searchsorted(cdf, u, right=True).clamp_(max=weights.shape[-1] - 1)
    return at.squeeze(-1)


TOP_P_CANDIDATES = (256, 4096)
TOP_P_MARGIN = 1e-6  # far above the float32 rounding of the full rule's prefix sums near 1


def top_p_filtered(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """`probs` (`[n, vocab]`, non-negative) with top-p applied to each row (`top_p`: a float, or
    `[n, 1]`): the smallest prefix of its tokens, most likely first, whose mass reaches top_p
    stays, the rest is 0. The first token always stays, however small top_p is (1e-46 in float32
    is 0, and ">= 0" dropped every token).

    On a GPU every row is sorted. On the CPU a row's k most likely tokens (k from
    TOP_P_CANDIDATES) are its candidates once they hold its top_p with a margin (the rule then drops
    every later token, as it does after a full sort), and only the rows left are sorted: a full sort
    of a 49,152-token row took ~4.5 ms there, its topk(256) ~0.2 ms, and at temperature 0.8 the demo
    model's top 256 held 0.9 of the mass at 85% of a text's positions."""
    cut = top_p if isinstance(top_p, torch.Tensor) else torch.full((probs.shape[0], 1), top_p, device=probs.device)
    if probs.device.type != "cpu":
        return _kept(probs, cut, *probs.sort(dim=-1, descending=True))
    out, left = probs, None  # left: the rows still to filter (None: all of them)
    for k in (*(k for k in TOP_P_CANDIDATES if k < probs.shape[-1]), None):
        sub, sub_cut = (probs, cut) if left is None else (probs[left], cut[left])
        if k is None:
            vals, idx = sub.sort(dim=-1, descending=True)
        else:
            vals, idx = sub.topk(k, dim=-1)
            enough = (vals.sum(dim=-1, keepdim=True) >= sub_cut + TOP_P_MARGIN).squeeze(1)
            if not bool(enough.all()):
                if bool(enough.any()):
                    done = enough.nonzero().squeeze(1)
                    kept = _kept(sub[done], sub_cut[done], vals[done], idx[done])
                    out = out.index_copy(0, done if left is None else left[done], kept)
                    left = (~enough).nonzero().squeeze(1) if left is None else left[~enough]
                continue
        kept = _kept(sub, sub_cut, vals, idx)
        return kept if left is None else out.index_copy(0, left, kept)
    raise AssertionError("unreachable: the last pass sorts")


def _kept(probs: torch.Tensor, cut: torch.Tensor, sorted_p: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`probs` with top-p `cut` applied, given its candidates `sorted_p` (most likely first) at `idx`."""
    drop = (sorted_p.cumsum(-1) - sorted_p) >= cut
    drop[:, 0] = False
    return torch.zeros_like(probs).scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
