"""Turns the last-position logits of a batch into tokens.

Each row is processed with its own request's settings. Random rows draw from the request's
own torch.Generator when it has a seed, so a seeded request gives the same tokens whatever
else is in the batch. Log-probs are those of the raw model logits (vLLM's default).

A row whose settings make sampling fail (an exception) is reported in `SamplerOutput.errors`
and the other rows still get their tokens: one request must not take the batch down.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.sample.batched import Drawn, draw
from engine.sample.draw import categorical, top_p_filtered
from engine.sample.logit_controls import apply_controls, has_controls
from engine.core.request import Request
from engine.sample.structured import MaskPrefetch

log = logging.getLogger(__name__)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # -1 for a row in `errors`
    logprobs: list[dict[int, float] | None]
    errors: dict[int, str] = field(default_factory=dict)  # row -> why it could not be sampled


class Sampler:
    def __init__(self, seed: int, batch_on_device: bool = True) -> None:
        """`batch_on_device`: draw unseeded sampled rows together where the logits are
        (engine/sample/batched.py); False: each on the host path, one at a time (tests compare the
        two). On the CPU too, together is the faster way: 256 rows over an 8-token vocabulary took
        33 ms one at a time and 1.5 ms together, and over the demo model's 49,152 tokens it was no
        slower (docs/CPU.md)."""
        # Unseeded requests share one engine-wide stream, seeded once for reproducible runs.
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.masks = MaskPrefetch()
        self.batch_on_device = batch_on_device
        self._device_generators: dict[torch.device, torch.Generator] = {}

    def prefetch(self, reqs: list[Request]) -> None:
        """A step that will sample `reqs` is about to run its forward: their grammars' masks are
        filled meanwhile."""
        self.masks.start([g for r in reqs if (g := r.active_grammar()) is not None])

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        self.masks.wait()  # a grammar's state must not change under its mask's fill
        logits = logits.float()
        want_logprobs = any(r.params.logprobs is not None for r in reqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        out = SamplerOutput([], [])
        greedy = self._plain_greedy(logits, reqs)
        drawn = self._batched(logits, reqs, greedy)
        for i, req in enumerate(reqs):
            try:
                forced = req.thinking.forced_next() if req.thinking is not None else None
                if forced is not None:  # a spent thinking budget: the end marker, whatever the logits
                    token = forced
                else:
                    token = greedy[i] if greedy[i] >= 0 else drawn[i] if i in drawn else self._sample(logits[i], req)
                    if (grammar := req.active_grammar()) is not None:
                        grammar.accept(token)
                if req.thinking is not None:
                    req.thinking.accept(token)
                out.token_ids.append(token)
                out.logprobs.append(None if raw_logprobs is None else token_logprobs(raw_logprobs[i], token, req))
            except (IndexError, RuntimeError, ValueError, OverflowError) as e:  # this row's settings
                log.error("request %s: sampling failed: %s: %s", req.request_id, type(e).__name__, e)
                out.errors[i] = f"sampling failed: {type(e).__name__}: {e}"
                out.token_ids.append(-1)
                out.logprobs.append(None)
        return out

    @staticmethod
    def _plain_greedy(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """The argmax of every greedy row without penalties, -1 for the others: one batched call
        instead of one per row (64 single-threaded row argmaxes were ~8 ms of a 177 ms batch-64
        decode step here). `max(-1).indices` keeps argmax's first-maximum rule and ran 0.9 ms on
        [64, 49152] float32 against argmax(-1)'s 2.5 ms."""
        rows = [i for i, r in enumerate(reqs) if r.params.greedy and not has_penalty(r)]
        tokens = [-1] * len(reqs)
        if rows:
            picked = (logits if len(rows) == len(reqs) else logits[rows]).max(dim=-1).indices
            for i, t in zip(rows, picked.tolist()):
                tokens[i] = t
        return tokens

    @staticmethod
    def batchable(req: Request) -> bool:
        """Whether a row can be processed in the device batch: no thinking budget, and greedy or
        unseeded (a seeded row keeps its host generator)."""
        p = req.params
        return req.thinking is None and (p.greedy or req.generator is None)

    def draws_on_device(self, logits: torch.Tensor) -> bool:
        """Whether batchable rows of `logits` are drawn together where they are."""
        return self.batch_on_device

    def draw(self, logits: torch.Tensor, reqs: list[Request]) -> Drawn | None:
        """Tokens of `reqs` (all `batchable`), one row of `logits` each, drawn together on the
        logits' device (engine/sample/batched.py) without waiting for it; None where that failed
        (logged: the rows are then sampled one by one, and a row whose settings fail is reported there)."""
        gen = self._device_generators.get(logits.device)
        if gen is None:
            gen = self._device_generators[logits.device] = torch.Generator(logits.device).manual_seed(self.seed)
        try:
            return draw(logits, reqs, gen)
        except (IndexError, RuntimeError, ValueError) as e:  # a row's settings: the host path names it
            log.warning("batched sampling of %d rows failed (%s: %s); sampling them one by one", len(reqs),
                        type(e).__name__, e)
            return None

    def _batched(self, logits: torch.Tensor, reqs: list[Request], greedy: list[int]) -> dict[int, int]:
        """Tokens of the batchable rows not picked by `_plain_greedy` (`greedy[i] >= 0`), processed
        together (row -> token); {} where that path is off or fails. A row whose controls leave no
        token is left out: the host path reports it."""
        if not self.draws_on_device(logits):
            return {}
        rows = [i for i, r in enumerate(reqs) if greedy[i] < 0 and self.batchable(r)]
        if not rows:
            return {}
        drawn = self.draw(logits if len(rows) == len(reqs) else logits[rows], [reqs[i] for i in rows])
        if drawn is None:
            return {}
        return {i: t for i, t in zip(rows, drawn.host()) if t >= 0}

    def _sample(self, row: torch.Tensor, req: Request) -> int:
        p = req.params
        # Rows that are not plain greedy are sampled on the host: requests' generators are CPU
        # generators, so a seeded request draws the same tokens on any device.
        row = row.cpu()
        if has_penalty(req):
            row = _apply_penalties(row.clone(), req)
        if p.greedy:
            return int(row.argmax())
        return _sample_row(row / p.temperature, p.top_k, p.top_p, p.min_p, req.generator or self.generator)


def token_logprobs(row: torch.Tensor, token: int, req: Request) -> dict[int, float] | None:
    n = req.params.logprobs
    if n is None:
        return None
    entry = {token: float(row[token])}
    if n > 0:
        vals, ids = row.topk(min(n, row.shape[0]))
        entry.update(zip(ids.tolist(), vals.tolist()))
    return entry


def has_penalty(req: Request, num_pending: int = 0) -> bool:
    """Whether the row is processed beyond temperature and top-k/p (penalties, min_tokens
    suppression, engine/sample/logit_controls.py's controls). `num_pending`: tokens sampled but not
    appended yet (async scheduling)."""
    p = req.params
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0 or p.frequency_penalty != 0
            or req.num_output_suppressed(num_pending) or has_controls(p) or req.grammar is not None)


def _apply_penalties(row: torch.Tensor, req: Request) -> torch.Tensor:
    p, vocab = req.params, row.shape[0]
    if (grammar := req.active_grammar()) is not None:
        grammar.mask(row)
    if has_controls(p):
        apply_controls(row, p, req.bad_word_ids, req.output_token_ids)
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
    return row


def sampling_distribution(rows: torch.Tensor, req: Request) -> torch.Tensor:
    """What a sampled (not greedy, no penalties) request draws from at each of `rows` (logits,
    `[m, vocab]`): temperature, top-k, top-p and min-p applied, float64 `[m, vocab]` on the host.
    A degenerate row (inf/NaN logits, nothing left) is a point mass on its argmax, the token the
    sampler returns for it."""
    p = req.params
    out = []
    for row in rows.cpu().float():
        probs = _filtered_probs(row / p.temperature, p.top_k, p.top_p, p.min_p)
        if probs is None:
            probs = torch.zeros_like(row)
            probs[int(row.argmax())] = 1.0
        probs = probs.double()
        out.append(probs / probs.sum())  # top-p / min-p leave it unnormalised
    return torch.stack(out)


def _sample_row(row: torch.Tensor, top_k: int, top_p: float, min_p: float, gen: torch.Generator) -> int:
    probs = _filtered_probs(row, top_k, top_p, min_p)
    if probs is None:
        return int(row.argmax())  # the most likely token
    return int(categorical(probs, gen))  # from this row's stream (engine/sample/draw.py)


def _filtered_probs(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor | None:
    """The distribution a row is sampled from; None in a degenerate case."""
    if top_k > 0 and top_k < row.shape[0]:
        kth = row.topk(top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if not bool(torch.isfinite(probs.sum())):  # inf or NaN logits (a huge 1/temperature, a broken model)
        return None
    if top_p < 1.0:
        probs = top_p_filtered(probs[None], top_p)[0]
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    if not float(probs.sum()) > 0.0:
        return None
    return probs
