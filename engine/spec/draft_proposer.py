"""Proposals from a small draft model (`speculative_config` method `draft_model`).

The draft is a second checkpoint with the target's vocabulary, run by its own `ModelRunner`:
its own weights, its own paged KV tensor and its own input batch. Its cache is indexed by the
target's block tables (same block size, same block ids), so it needs no allocator of its own;
the scheduler allocates k lookahead slots past each request's tokens, where the draft writes
the KV of its proposals before the target has verified them.

Per request the proposer remembers which tokens its cache holds KV for. At the next proposal
it recomputes from the first token that differs (a rejected proposal, or everything after a
preemption gave the request a new block table) and then drafts one token per forward. Blocks
that came from a prefix hit or an offload tier hold the target's KV but not the draft's, so a
new request's draft starts from its first token: a prompt costs one draft prefill.

Greedy requests get the draft's argmax (a point mass); sampled requests draw from the draft's
own distribution under the request's temperature / top-k / top-p / min-p, float32, and that
distribution goes to verification with the tokens.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.model_config import ModelConfig, load_model_config
from engine.kv.kv_cache_manager import KVCacheManager
from engine.runner.model_runner import ModelRunner
from engine.core.request import Request, RequestId
from engine.sample.draw import categorical
from engine.sample.sampler import sampling_distribution
from engine.core.step_io import plan_after
from engine.spec.decode import Proposal

log = logging.getLogger(__name__)


def draft_model_config(draft_dir: Path, dtype: str, device: str, target: ModelConfig) -> ModelConfig:
    """The draft's config, checked against the target's: its proposals index the same vocabulary."""
    if not draft_dir.is_dir():
        raise ValueError(f"speculative_config model {str(draft_dir)!r} is not a directory")
    mc = load_model_config(draft_dir, dtype, device)
    if mc.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({mc.vocab_size} tokens) differs from the target's "
                         f"({target.vocab_size}): a draft must share the target's tokenizer")
    if mc.dtype != target.dtype:
        raise ValueError(f"the draft model's dtype {mc.dtype} differs from the target's {target.dtype}")
    return replace(mc, cache_dtype=target.cache_dtype)  # its KV in --kv-cache-dtype too


@dataclass
class View:
    """What `ModelRunner.execute` reads of a request, for the draft's own progress."""

    request_id: RequestId
    all_token_ids: list[int]
    num_computed_tokens: int
    num_output_placeholders = 0  # the draft runs synchronously: nothing is ever in flight
    wants_prompt_logprobs = False  # the target's request asks for them, not the draft's view
    num_prompt_tokens = 0  # its steps run as decodes: the draft's KV bits never reach an output

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_computed_tokens


class DraftModelProposer:
    needs_lookahead = True  # the scheduler allocates k slots past each request's tokens

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, generator: torch.Generator) -> None:
        self.runner = runner
        self.kv = kv
        self.generator = generator
        # request -> (the block table its cached tokens were written through, those tokens)
        self._cached: dict[RequestId, tuple[list, list[int]]] = {}

    def release(self, req_id: RequestId) -> None:
        self._cached.pop(req_id, None)
        self.runner.release(req_id)

    def _start(self, req: Request, table: list, seq: list[int]) -> int:
        """The first token of `seq` whose draft KV is missing or stale (at most the last token)."""
        prev = self._cached.get(req.request_id)
        if prev is None or prev[0] is not table:
            return 0
        cached, n = prev[1], 0
        limit = min(len(cached), len(seq) - 1)
        while n < limit and cached[n] == seq[n]:
            n += 1
        return n

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], limits: Sequence[int], tokens: Sequence[list[int]]
                ) -> list[Proposal]:
        bs = self.runner.block_size
        tables = [self.kv.block_table(r) for r in reqs]
        limits = [fitting_proposal(n, len(seq), t, bs) for n, seq, t in zip(limits, tokens, tables)]
        live = [i for i, n in enumerate(limits) if n > 0]
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        views = {i: View(reqs[i].request_id, list(tokens[i]), self._start(reqs[i], tables[i], tokens[i]))
                 for i in live}
        while live:
            plan = plan_after([views[i] for i in live], [views[i].num_tokens - views[i].num_computed_tokens for i in live])
            out = self.runner.execute(plan, [tables[i] for i in live])
            # Greedy rows' argmaxes in one call and one copy to the host, not one of each per row.
            best = out.logits.max(dim=-1).indices.tolist() if any(reqs[i].params.greedy for i in live) else None
            for row, i in enumerate(live):
                token, q = draw_draft_token(out.logits[row], reqs[i], self.generator, best[row] if best else None)
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
                v = views[i]
                v.num_computed_tokens = v.num_tokens
                v.all_token_ids.append(token)
            live = [i for i in live if len(drafts[i]) < limits[i]]
        for i, r in enumerate(reqs):
            if i in views:  # KV is written for every token but the last draft
                self._cached[r.request_id] = (tables[i], views[i].all_token_ids[:-1])
        return [Proposal(tuple(d), torch.stack(p) if p else None) for d, p in zip(drafts, probs)]


def fitting_proposal(limit: int, num_tokens: int, table: list, block_size: int) -> int:
    """The longest proposal (at most `limit`) after `num_tokens` tokens whose KV, all but its last
    token, fits in the slots the request holds (its lookahead slots may have been refused for
    want of blocks)."""
    return min(limit, len(table) * block_size - num_tokens + 1)


def draw_draft_token(logits: torch.Tensor, req: Request, generator: torch.Generator, best: int | None = None
                     ) -> tuple[int, torch.Tensor | None]:
    """A draft's token for `req` from its logits row: the argmax for a greedy request (a point
    mass; `best`, when the caller took it already), else a draw from the request's own sampling
    distribution, returned with it (float32)."""
    if req.params.greedy:
        return (best if best is not None else int(logits.argmax())), None
    q = sampling_distribution(logits[None], req)[0]
    return int(categorical(q, req.generator or generator)), q.float()
