"""Sampled rows drawn together on the logits' device (issue 42).

The host sampler (engine/sample/sampler.py) takes each sampled row to the host and filters it
there: on a GPU, a batch of 64 such rows was 64 device-to-host copies of a whole vocabulary row and
64 host softmaxes and sorts per step. Here the rows that need nothing but temperature, top-k,
top-p and min-p are filtered as one batch where the logits are, and one exponential race over
the batch picks their tokens; one copy of the ids goes to the host.

Only unseeded requests take this path. Their noise comes from a generator on the logits' device,
seeded with the engine's seed, so a run is reproducible on the same device. A seeded request keeps
its own host generator and the host path, so it draws the same tokens on any device, whatever else
is in the batch. The filter is `_filtered_probs`'s rule row for row (tests compare them).
"""
from __future__ import annotations

import torch

from engine.core.request import Request


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs `[n, vocab]` float32, degenerate `[n]` bool): each row's distribution under its own
    settings (per-row tensors), as `_filtered_probs` makes it; a degenerate row (inf/NaN logits,
    nothing left) is drawn as its argmax."""
    rows = logits.float() / temperature[:, None]
    vocab = rows.shape[1]
    use_k = (top_k > 0) & (top_k < vocab)
    if bool(use_k.any()):
        kmax = int(torch.where(use_k, top_k, 1).max())
        kth = rows.topk(kmax, dim=1).values.gather(1, (top_k.clamp(1, kmax) - 1)[:, None])
        rows = rows.masked_fill(use_k[:, None] & (rows < kth), float("-inf"))
    probs = torch.softmax(rows, dim=1)
    degenerate = ~torch.isfinite(probs).all(dim=1)
    use_p = top_p < 1.0
    if bool(use_p.any()):
        sorted_p, idx = probs.sort(dim=1, descending=True)
        drop = (sorted_p.cumsum(1) - sorted_p) >= top_p[:, None]
        drop[:, 0] = False  # the first token always stays, however small top_p is
        drop &= use_p[:, None]
        probs = probs.scatter(1, idx, sorted_p.masked_fill(drop, 0.0))
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < (min_p[:, None] * probs.max(dim=1, keepdim=True).values), 0.0)
    degenerate |= ~(probs.sum(dim=1) > 0.0)
    return probs, degenerate


@torch.inference_mode()
def sample_rows(logits: torch.Tensor, reqs: list[Request], gen: torch.Generator) -> list[int]:
    """Tokens for `reqs` (all `Sampler.batchable`), one row of `logits` each, drawn on the logits' device."""
    dev = logits.device
    params = [r.params for r in reqs]
    settings = torch.tensor([[p.temperature, p.top_k, p.top_p, p.min_p] for p in params], dtype=torch.float64)
    t, k, p, m = settings.to(dev).unbind(1)
    probs, degenerate = filtered_probs(logits, t.float(), k.long(), p.float(), m.float())
    q = torch.empty_like(probs).exponential_(generator=gen)  # Gumbel-max's equivalent, as on the host
    picked = torch.where(degenerate, logits.argmax(dim=1), torch.nan_to_num(probs / q).argmax(dim=1))
    return picked.tolist()
