"""Speculative decoding: proposals before a step, verification after it, and the counters.

After each step every running request that got tokens asks the proposer for up to k tokens
(`Request.spec_token_ids`); the scheduler appends them to the request's next decode, so the
target scores the last token and the k proposals in one forward (the prompt-chunk attention
path: k + 1 query tokens). Verification (`rejection_sampler`) turns the k + 1 logits rows into
1..k + 1 tokens; the engine keeps the KV of the accepted ones and overwrites the rest later.

A request is only given proposals when its output can be verified exactly as sampled: no
repetition/presence/frequency penalty and no `min_tokens` suppression pending (both make each
position's distribution depend on the tokens before it in ways the sampler applies per step).
Such requests decode one token at a time, unchanged.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.spec.ngram_proposer import NgramIndex, NgramProposer
from engine.spec.rejection_sampler import VerifyRequest, accept_greedy, verify, verify_batch
from engine.core.request import Request, RequestId
from engine.runner.model_runner import ModelOutput
from engine.sample.batched import distributions
from engine.sample.sampler import Sampler, has_penalty, sampling_distribution, token_logprobs
from engine.core.step_io import ScheduledRequest
from engine.spec.budget import SpecBudget
from engine.spec.config import SpeculativeConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Proposal:
    token_ids: tuple[int, ...]
    # [len(token_ids), vocab]: the distribution each token was drawn from; None: chosen outright
    # (a point mass, as n-gram lookup and greedy drafts are).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """Proposes tokens for a batch of requests. `limits[i]` (>= 1) caps the i-th proposal's
    length; a proposal may be shorter, or empty. `tokens[i]` is the i-th request's sequence to
    continue: its `all_token_ids`, plus, under async scheduling, the tokens its last step
    sampled that are not appended yet (read it, never the request's own list)."""

    needs_lookahead: bool  # it writes KV for its proposals: the scheduler allocates k slots ahead

    def propose(self, reqs: Sequence[Request], limits: Sequence[int], tokens: Sequence[list[int]]
                ) -> list[Proposal]: ...

    def release(self, req_id: RequestId) -> None:
        """The request finished: drop what is kept for it."""


class NgramBatchProposer:
    """Prompt lookup with an incremental index per request (tokens never change once appended)."""

    needs_lookahead = False

    def __init__(self, lookup: NgramProposer) -> None:
        self.lookup = lookup
        self._index: dict[RequestId, NgramIndex] = {}

    def release(self, req_id: RequestId) -> None:
        self._index.pop(req_id, None)

    def propose(self, reqs: Sequence[Request], limits: Sequence[int], tokens: Sequence[list[int]]
                ) -> list[Proposal]:
        out = []
        for r, n, seq in zip(reqs, limits, tokens):
            index = self._index.get(r.request_id)
            if index is None:
                index = self._index[r.request_id] = NgramIndex(self.lookup)
            out.append(Proposal(tuple(index.propose(seq)[:n])))
        return out


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode_* counters: drafts (requests that were given proposals, per step),
    draft tokens, accepted tokens, and accepted tokens by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified step: 1 (the target's own) plus the accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length}


def can_speculate(req: Request, num_pending: int = 0) -> bool:
    """No penalty, nor min_tokens suppression once `num_pending` unapplied tokens are in."""
    return not has_penalty(req, num_pending)


class SpecDecoder:
    """Owns the proposer and the counters; reads and writes only requests' proposal fields."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, generator: torch.Generator) -> None:
        self.k = config.num_speculative_tokens
        self.adaptive = config.adaptive
        self.proposer = proposer
        self.generator = generator  # unseeded requests' stream (the sampler's)
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self.budget = SpecBudget(self.k)
        self.last_propose_seconds = 0.0  # the step's proposing time, charged to the verify step after it
        self._generators: dict[torch.device, torch.Generator] = {}  # verify_together's, per device

    def release(self, req_id: RequestId) -> None:
        self.proposer.release(req_id)
        self.budget.release(req_id)

    def propose(self, reqs: Sequence[Request], pending: Sequence[list[int]] | None = None) -> None:
        """Sets `spec_token_ids` (and `spec_probs`) of each running request that can take some.
        `pending[i]`: tokens the i-th request sampled that are not appended yet (async scheduling)."""
        start = time.perf_counter()
        try:
            self._propose(reqs, pending or [[] for _ in reqs])
        finally:
            self.last_propose_seconds = time.perf_counter() - start

    def _propose(self, reqs: Sequence[Request], pending: Sequence[list[int]]) -> None:
        picked, limits, tokens = [], [], []
        for r, extra in zip(reqs, pending):
            r.set_proposal([], None)
            # Room for the k proposals and the bonus token within max_tokens.
            n = min(self.k, r.max_output_tokens - len(r.output_token_ids) - len(extra) - 1)
            if r.thinking is not None and (room := r.thinking.room()) is not None:
                n = min(n, room - 1)  # proposals past a thinking budget would be cut anyway
            if n > 0 and not r.status.finished and can_speculate(r, len(extra)):
                picked.append(r)
                limits.append(n)
                tokens.append(r.all_token_ids + extra if extra else r.all_token_ids)
        # Only the proposals worth their verify cost at this batch size (engine/spec/budget.py).
        lengths = self.budget.lengths([r.request_id for r in picked], limits) if self.adaptive and picked else limits
        keep = [i for i, n in enumerate(lengths) if n > 0]
        picked, limits, tokens = [picked[i] for i in keep], [lengths[i] for i in keep], [tokens[i] for i in keep]
        # Called even with nobody to propose for: a proposer may have this step's work to do
        # (EAGLE-3 writes its KV for every position the target kept).
        for r, p, n in zip(picked, self.proposer.propose(picked, limits, tokens), limits):
            ids = list(p.token_ids[:n])
            r.set_proposal(ids, p.probs[: len(ids)] if p.probs is not None else None)

    def verify(self, req: Request, drafts: tuple[int, ...], rows: torch.Tensor, best: list[int] | None) -> list[int]:
        """The tokens `req` emits: `rows` are the target's k + 1 logits rows, `best` their argmax
        (given for greedy requests, computed for the batch in one call)."""
        if req.params.greedy:
            tokens = accept_greedy(drafts, best if best is not None else rows.argmax(-1).tolist())
        else:
            probs = req.take_proposal_probs()
            # The scheduler may have cut the proposal short (the step's token budget).
            tokens = verify(VerifyRequest(drafts, rows, sampling_distribution(rows, req),
                                          probs[: len(drafts)].float() if probs is not None else None),
                            req.generator or self.generator)
        self._record(req, len(drafts), len(tokens) - 1)
        return tokens

    @staticmethod
    def together(req: Request) -> bool:
        """Whether `req` is verified in `verify_together`: sampled from the engine's stream (a
        seeded request keeps its generator, one at a time) and without a thinking budget."""
        return not req.params.greedy and req.generator is None and req.thinking is None

    def verify_together(self, reqs: list[Request], drafts: list[tuple[int, ...]], rows: list[torch.Tensor]
                        ) -> list[list[int]]:
        """The tokens each of `reqs` (all `together`) emits, verified in one batch where the logits
        are: `rows[j]` are request j's k + 1 target logits rows."""
        dev = rows[0].device
        target = distributions(torch.cat(rows), [r for r, x in zip(reqs, rows) for _ in range(x.shape[0])])
        # Read, and taken only once verified: a failed batch leaves them to `verify`. The scheduler
        # may have cut a proposal short (the step's token budget).
        q = [r.spec_probs[: len(d)].float() if r.spec_probs is not None else None for r, d in zip(reqs, drafts)]
        gen = self._generators.get(dev)
        if gen is None:
            gen = self.generator if dev.type == "cpu" else torch.Generator(dev).manual_seed(self.generator.initial_seed())
            self._generators[dev] = gen
        tokens = verify_batch(drafts, target, q, gen)
        for r, d, out in zip(reqs, drafts, tokens):
            r.take_proposal_probs()
            self._record(r, len(d), len(out) - 1)
        return tokens

    def _record(self, req: Request, proposed: int, accepted: int) -> None:
        self.budget.observe_verify(req.request_id, proposed, accepted)
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += proposed
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_pos[i] += 1


def ngram_proposer(config: SpeculativeConfig) -> NgramBatchProposer:
    return NgramBatchProposer(NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                            config.num_speculative_tokens))


def sample_outputs(out: ModelOutput, items: list[ScheduledRequest], sampler: Sampler, spec: SpecDecoder | None
                   ) -> tuple[list[list[int]], list[list[dict[int, float]] | None], dict[int, str]]:
    """The sample stage: tokens (1 + accepted proposals) and their logprobs for each sampled
    entry (`items`: the scheduled requests of `out.sampled`), and the entries whose sampling
    failed, with why."""
    tokens: list[list[int]] = [[] for _ in items]
    logprobs: list[list[dict[int, float]] | None] = [None] * len(items)
    errors: dict[int, str] = {}
    plain = [j for j, s in enumerate(items) if not s.spec_token_ids]
    if plain:
        rows = out.logits if len(plain) == out.logits.shape[0] else out.logits[[out.row_starts[j] for j in plain]]
        samples = sampler(rows, [items[j].req for j in plain])
        for row, j in enumerate(plain):
            if row in samples.errors:
                errors[j] = samples.errors[row]
            else:
                tokens[j] = [samples.token_ids[row]]
                logprobs[j] = [samples.logprobs[row]] if items[j].req.logprobs is not None else None
    verified = [j for j, s in enumerate(items) if s.spec_token_ids]
    if verified:
        assert spec is not None, "spec tokens scheduled without speculation"
        best = out.logits.max(dim=-1).indices.tolist() if any(items[j].req.params.greedy for j in verified) else None
        together = [j for j in verified if spec.together(items[j].req)]
        if together:
            try:
                for j, t in zip(together, spec.verify_together([items[j].req for j in together],
                                                               [items[j].spec_token_ids for j in together],
                                                               [out.rows(j) for j in together])):
                    tokens[j] = t
            except (IndexError, RuntimeError, ValueError) as e:  # the rows' settings: one at a time below
                log.warning("verifying %d requests together failed (%s: %s); verifying them one by one",
                            len(together), type(e).__name__, e)
                together = []
        done = set(together)
        for j in verified:
            req, rows = items[j].req, out.rows(j)
            if j not in done:
                start = out.row_starts[j]
                try:
                    tokens[j] = spec.verify(req, items[j].spec_token_ids, rows,
                                            best[start:start + rows.shape[0]] if best else None)
                except (IndexError, RuntimeError, ValueError) as e:  # this request's settings
                    errors[j] = f"verifying proposed tokens failed: {type(e).__name__}: {e}"
                    continue
                if req.thinking is not None:  # fed here as the sampler feeds it; cut where a token is forced
                    tokens[j] = req.thinking.clamp(tokens[j])
            if req.logprobs is not None:
                raw = torch.log_softmax(rows[: len(tokens[j])], dim=-1)
                logprobs[j] = [token_logprobs(raw[p], t, req) for p, t in enumerate(tokens[j])]
    return tokens, logprobs, errors
