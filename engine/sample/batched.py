"""Sampled and penalised rows drawn together on the logits' device (issue 42).

The host sampler (engine/sample/sampler.py) takes each such row to the host and processes it
there: on a GPU, a batch of 64 was 64 device-to-host copies of a whole vocabulary row and 64 host
softmaxes and sorts per step. Here the rows shaped by temperature, top-k, top-p, min-p,
repetition/presence/frequency penalties and min_tokens are processed as one batch where the
logits are: the penalties from index tensors built once per step, the filter batched, greedy rows
by argmax and sampled rows by one exponential race; one copy of the ids goes to the host. Grammar
masks, logit controls and thinking budgets stay on the host path.

Sampled rows take this path only when unseeded (greedy rows draw nothing, so any greedy row may). Their noise comes from a generator on the logits' device,
seeded with the engine's seed, so a run is reproducible on the same device. A seeded request keeps
its own host generator and the host path, so it draws the same tokens on any device, whatever else
is in the batch. The filter is `_filtered_probs`'s rule and the penalties `_apply_penalties`'s,
row for row (tests compare them).
"""
from __future__ import annotations

import torch

from engine.core.request import Request


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs `[n, vocab]` float32, degenerate `[n]` bool, fallback `[n]`): each row's distribution
    under its own settings (per-row host tensors: float32 temperature, top_p, min_p, int64 top_k),
    as `_filtered_probs` makes it; a degenerate row (inf/NaN logits, nothing left) is drawn as
    `fallback`, the argmax of its tempered logits. Which filters run is decided from the host
    tensors, so nothing here waits for the device."""
    dev, vocab = logits.device, logits.shape[1]
    use_k, use_p, use_min = (top_k > 0) & (top_k < vocab), top_p < 1.0, min_p > 0
    rows = logits.float() / temperature.to(dev)[:, None]
    fallback = rows.argmax(dim=1)
    if bool(use_k.any()):
        kmax = int(torch.where(use_k, top_k, 1).max())
        at = (top_k.clamp(1, kmax) - 1).to(dev)[:, None]
        kth = rows.topk(kmax, dim=1).values.gather(1, at)
        rows = rows.masked_fill(use_k.to(dev)[:, None] & (rows < kth), float("-inf"))
    probs = torch.softmax(rows, dim=1)
    degenerate = ~torch.isfinite(probs).all(dim=1)
    if bool(use_p.any()):
        sorted_p, idx = probs.sort(dim=1, descending=True)
        drop = (sorted_p.cumsum(1) - sorted_p) >= top_p.to(dev)[:, None]
        drop[:, 0] = False  # the first token always stays, however small top_p is
        drop &= use_p.to(dev)[:, None]
        probs = probs.scatter(1, idx, sorted_p.masked_fill(drop, 0.0))
    if bool(use_min.any()):
        probs = probs.masked_fill(probs < (min_p.to(dev)[:, None] * probs.max(dim=1, keepdim=True).values), 0.0)
    degenerate |= ~(probs.sum(dim=1) > 0.0)
    return probs, degenerate, fallback


def penalised(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """`logits` (float32 `[n, vocab]`, not modified) with each row's min_tokens suppression,
    repetition, presence and frequency penalties applied, in `_apply_penalties`'s order and
    arithmetic; `logits` itself when no row has any. Each kind is one indexed operation over the batch."""
    dev, vocab = logits.device, logits.shape[1]
    stops = [(i, t) for i, r in enumerate(reqs) if r.num_output_suppressed() for t in r.stop_ids if t < vocab]
    seen = [(i, t) for i, r in enumerate(reqs) if r.params.repetition_penalty != 1.0 for t in sorted(set(r.all_token_ids))]
    counted = [i for i, r in enumerate(reqs)
               if (r.params.presence_penalty or r.params.frequency_penalty) and r.output_token_ids]
    if not (stops or seen or counted):
        return logits
    out = logits.clone()

    def index(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(pairs, dtype=torch.long).to(dev).unbind(1)

    if stops:
        out.index_put_(index(stops), torch.tensor(float("-inf"), device=dev))
    if seen:
        rows, cols = index(seen)
        # float32 factors: the host divides by the penalty as a scalar, which torch rounds to float32
        rp = torch.tensor([reqs[i].params.repetition_penalty for i, _ in seen], dtype=out.dtype).to(dev)
        vals = out[rows, cols]
        out[rows, cols] = torch.where(vals > 0, vals / rp, vals * rp)
    if counted:
        pairs = [(j, t) for j, i in enumerate(counted) for t in reqs[i].output_token_ids]
        rows, cols = index(pairs)
        counts = torch.zeros(len(counted), vocab, dtype=out.dtype, device=dev)
        counts.index_put_((rows, cols), torch.ones((), dtype=out.dtype, device=dev), accumulate=True)
        freq, pres = torch.tensor([[reqs[i].params.frequency_penalty, reqs[i].params.presence_penalty]
                                   for i in counted], dtype=out.dtype).to(dev).unbind(1)
        at = torch.tensor(counted, dtype=torch.long).to(dev)
        out[at] -= freq[:, None] * counts + pres[:, None] * (counts > 0).to(out.dtype)
    return out


@torch.inference_mode()
def sample_rows(logits: torch.Tensor, reqs: list[Request], gen: torch.Generator) -> list[int]:
    """Tokens for `reqs` (all `Sampler.batchable`), one row of `logits` each, drawn on the logits' device."""
    dev = logits.device
    logits = penalised(logits.float(), reqs)
    greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
    out = torch.empty(len(reqs), dtype=torch.long, device=dev)
    if greedy:  # the first maximum, as the host's argmax picks it
        out[greedy] = (logits if len(greedy) == len(reqs) else logits[greedy]).max(dim=1).indices
    if sampled:
        settings = torch.tensor([[reqs[i].params.temperature, reqs[i].params.top_k, reqs[i].params.top_p,
                                  reqs[i].params.min_p] for i in sampled], dtype=torch.float64)
        t, k, p, m = settings.unbind(1)  # host tensors: filtered_probs decides from them without waiting
        rows = logits if len(sampled) == len(reqs) else logits[sampled]
        probs, degenerate, fallback = filtered_probs(rows, t.float(), k.long(), p.float(), m.float())
        q = torch.empty_like(probs).exponential_(generator=gen)  # Gumbel-max's equivalent, as on the host
        out[sampled] = torch.where(degenerate, fallback, torch.nan_to_num(probs / q).argmax(dim=1))
    return out.tolist()
