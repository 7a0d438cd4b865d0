"""Proposals from an EAGLE-3 draft (`speculative_config` method `eagle3`), as vLLM's eagle
proposer makes them.

After each step the engine hands over the target's aux features of every position it kept
(`observe`: committed tokens and accepted proposals, prompt chunks included). When a request
next proposes, `propose` runs the draft layer over all of its positions since (row t: features
at t with token t+1; one forward for every proposing request), writing the draft's KV there
through the target's block tables, takes the first proposal from the last row, and drafts the
rest one row per step, feeding back the layer's output. The draft's KV at positions the target never computed in this engine (prefix
hits served by an offload tier) is whatever the draft cache holds there: proposals get worse,
outputs do not change.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.spec.draft_proposer import View, draw_draft_token, fitting_proposal
from engine.kv.kv_cache_manager import KVCacheManager
from engine.runner.model_runner import ModelRunner
from engine.models.eagle3 import Eagle3Draft
from engine.core.request import Request, RequestId
from engine.core.step_io import plan_after
from engine.spec.decode import Proposal


MAX_PENDING_ROWS = 1024  # a request that never proposes still gets its draft KV written now and then


@dataclass
class _Chain:
    """One request's proposal in the making."""

    i: int  # index into the requests asked for proposals
    view: View
    table: list
    limit: int
    hidden: torch.Tensor  # the draft's last output row (fed back)
    logits: torch.Tensor  # ... and its logits, the next proposal's distribution
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


class Eagle3Proposer:
    needs_lookahead = True

    def __init__(self, runner: ModelRunner, kv: KVCacheManager, generator: torch.Generator) -> None:
        self.runner = runner
        self.draft: Eagle3Draft = runner.model
        self.kv = kv
        self.generator = generator
        # request -> (it, first position, fc rows of the positions since) whose draft KV is not
        # written yet: the first pass runs when the request next proposes (or its rows pile up),
        # so a request the budget keeps from proposing costs no draft work.
        self._pending: dict[RequestId, tuple[Request, int, torch.Tensor]] = {}
        # One-token proposal steps replay the draft's decode graphs; the rows fed back (the last
        # outputs) go in through a static buffer of their own.
        graphs = runner.graphs
        self._feed = None if graphs is None else torch.zeros(
            graphs.sizes[-1], runner.cfg.hidden_size, dtype=runner.cfg.dtype, device=runner.kv_cache.device)
        if graphs is not None:
            graphs.capture(self._graph_forward, runner.layer_caches)

    def _graph_forward(self, ids: torch.Tensor, positions: torch.Tensor, caches: list, meta, capture: tuple
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The draft's forward in `DecodeGraphs`' form, fed from `_feed`."""
        return self.draft(ids, self._feed[:ids.shape[0]], positions, caches[0], meta), []

    def release(self, req_id: RequestId) -> None:
        self._pending.pop(req_id, None)
        self.runner.release(req_id)

    @torch.inference_mode()
    def observe(self, kept: Sequence[tuple[Request, int, int, int]], aux: torch.Tensor) -> None:
        """`kept`: (request, first position, count, first row in `aux`) of the positions whose
        target KV this step kept; `aux` `[step tokens, len(aux layers) * hidden]`."""
        kept = [k for k in kept if k[2] > 0]
        if not kept:
            return
        index = torch.cat([torch.arange(off, off + n) for _, _, n, off in kept]).to(aux.device)
        for (req, start, n, _), h in zip(kept, self.draft.fc(aux[index]).split([k[2] for k in kept])):
            prev = self._pending.get(req.request_id)
            if prev is not None and prev[1] <= start <= prev[1] + prev[2].shape[0]:  # recomputed rows replace
                h = torch.cat([prev[2][: start - prev[1]], h])
                start = prev[1]
            self._pending[req.request_id] = (req, start, h)

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], limits: Sequence[int], tokens: Sequence[list[int]]
                ) -> list[Proposal]:
        for rid in [rid for rid, (r, _, _) in self._pending.items() if r.status.finished]:
            del self._pending[rid]
        seqs = {r.request_id: seq for r, n, seq in zip(reqs, limits, tokens) if n > 0}
        # Rows piled up by a request not asked run from its own tokens once they reach the rows'
        # last position (under async scheduling its latest tokens may not be appended yet).
        run = [rid for rid, (r, start, h) in self._pending.items() if rid in seqs or (
            h.shape[0] >= MAX_PENDING_ROWS and r.num_tokens > start + h.shape[0])]
        rows = [self._pending.pop(rid) for rid in run]
        if not rows:
            return [Proposal(()) for _ in reqs]
        # First pass: row t = (fc(features at t), token t+1), for every kept position.
        tables = [self.kv.block_table(r) for r, _, _ in rows]
        views = [View(r.request_id, seqs.get(r.request_id, r.all_token_ids)[1:start + h.shape[0] + 1], start)
                 for r, start, h in rows]
        out, logits = self._run(views, [h.shape[0] for _, _, h in rows], tables, torch.cat([h for _, _, h in rows]))
        where = {r.request_id: j for j, (r, _, _) in enumerate(rows)}
        bs = self.runner.block_size
        chains: list[_Chain] = []
        for i, (r, n) in enumerate(zip(reqs, limits)):
            j = where.get(r.request_id)
            if j is not None:
                chains.append(_Chain(i, views[j], tables[j], fitting_proposal(n, len(tokens[i]), tables[j], bs),
                                     out[j], logits[j]))
        chains = [c for c in chains if c.limit > 0]
        done = list(chains)
        while chains:
            for c in chains:
                token, q = draw_draft_token(c.logits, reqs[c.i], self.generator)
                c.tokens.append(token)
                if q is not None:
                    c.probs.append(q)
            chains = [c for c in chains if len(c.tokens) < c.limit]
            if not chains:
                break
            for c in chains:  # the next row: the last proposal at the next position, fed the last output
                c.view.num_computed_tokens = c.view.num_tokens
                c.view.all_token_ids.append(c.tokens[-1])
            out, logits = self._run([c.view for c in chains], [1] * len(chains), [c.table for c in chains],
                                    torch.stack([c.hidden for c in chains]))
            for j, c in enumerate(chains):
                c.hidden, c.logits = out[j], logits[j]
        props = [Proposal(()) for _ in reqs]
        for c in done:
            props[c.i] = Proposal(tuple(c.tokens), torch.stack(c.probs) if c.probs else None)
        return props

    def _run(self, views: list[View], counts: list[int], tables: list, hidden: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward; the output and logits of each view's last row."""
        step = self.runner.prepare(plan_after(views, counts), tables)
        graphs = self.runner.graphs
        if graphs is not None and graphs.fits(step.meta, step.input_ids.shape[0]):
            self._feed[:hidden.shape[0]].copy_(hidden)
            out, _ = graphs.run(self._graph_forward, self.runner.layer_caches, step.input_ids, step.positions,
                                step.meta)
        else:
            out = self.draft(step.input_ids, hidden, step.positions, self.runner.layer_caches[0], step.meta)
        last = out[step.sample_rows]
        return last, self.draft.compute_logits(last)
