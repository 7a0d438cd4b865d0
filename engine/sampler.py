"""Turns the last-position logits of a batch into tokens.

Each row is processed with its own request's settings. Random rows draw from the request's
own torch.Generator when it has a seed, so a seeded request gives the same tokens whatever
else is in the batch. Log-probs are those of the raw model logits (vLLM's default).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __init__(self, seed: int) -> None:
        # Unseeded requests share one engine-wide stream, seeded once for reproducible runs.
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        logits = logits.float()
        want_logprobs = any(r.params.logprobs is not None for r in reqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._apply_penalties(logits, reqs)
        tokens: list[int] = []
        for i, req in enumerate(reqs):
            p = req.params
            row = logits[i]
            if p.greedy:
                tokens.append(int(row.argmax()))
                continue
            tokens.append(_sample_row(row / p.temperature, p.top_k, p.top_p, p.min_p, req.generator or self.generator))
        logprobs: list[dict[int, float] | None] = []
        for i, req in enumerate(reqs):
            n = req.params.logprobs
            if n is None:
                logprobs.append(None)
                continue
            row = raw_logprobs[i]
            entry = {tokens[i]: float(row[tokens[i]])}
            if n > 0:
                vals, ids = row.topk(n)
                entry.update(zip(ids.tolist(), vals.tolist()))
            logprobs.append(entry)
        return SamplerOutput(tokens, logprobs)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(reqs) if _has_penalty(r)]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:
            req, p, row = reqs[i], reqs[i].params, logits[i]
            if req.num_output_suppressed():
                row[list(req.stop_ids)] = float("-inf")
            if p.repetition_penalty != 1.0:
                # vLLM/HF semantics: prompt and output tokens, shrink positives and grow negatives.
                seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
                counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=vocab)[:vocab].to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        return logits


def _has_penalty(req: Request) -> bool:
    p = req.params
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0
            or req.num_output_suppressed())


def _sample_row(row: torch.Tensor, top_k: int, top_p: float, min_p: float, gen: torch.Generator) -> int:
    if top_k > 0 and top_k < row.shape[0]:
        kth = row.topk(top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (sorted_p.cumsum(0) - sorted_p) >= top_p
        probs = probs.scatter(0, idx, sorted_p.masked_fill(drop, 0.0))
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    # Exponential race (Gumbel-max equivalent): one draw per vocab entry from this row's stream.
    q = torch.empty_like(probs).exponential_(generator=gen)
    return int((probs / q).argmax())
