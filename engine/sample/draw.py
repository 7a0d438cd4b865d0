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
