"""Sampled ids that stay on the device (issue 42, Model Runner V2's idea).

With async scheduling, step N+1 is prepared while step N runs, with placeholders where N's sampled
tokens go. A step whose sampling entries read nothing from their logits but the token (no
proposals, grammar, thinking budget, logprobs or first logits) draws its tokens on the device and
leaves them there: step N+1's placeholders are filled from them by a device-side index, so N+1 can
be launched with no host round trip. The host copy, which the scheduler needs, is started without
blocking and waited for only when the bookkeeping thread reads it, while N+1 runs.

Plain greedy steps take their rows' argmax (`Sampler._plain_greedy`'s rule) on any device. Steps
with sampled, penalised or controlled rows go through the sampler's device batch
(engine/sample/batched.py, the same draws the synchronous engine makes there) where the sampler
draws on the device: on CUDA, or where a test turns it on. Any other step samples on the host as
before (engine/sample/sampler.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.core.request import RequestId
from engine.sample.logit_controls import NOTHING_LEFT
from engine.sample.sampler import Sampler, has_penalty

if TYPE_CHECKING:
    from engine.core.step_io import ScheduledRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class DeviceTokens:
    ids: torch.Tensor  # [entries] int64 on the model's device: each sampling entry's token, in row order
    rows: dict[RequestId, int]  # each sampling request's index into `ids`
    _host: torch.Tensor  # the host copy (page-locked on CUDA), -1 for a failed row; complete once `_ready` has fired
    _ready: Any  # torch.cuda.Event, or None where the copy was synchronous

    def host(self) -> list[int]:
        """The tokens as host ints, -1 where a row's logit controls left no token; on CUDA waits
        for the copy (not for the steps queued after it)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()

    def failed(self, host: list[int]) -> dict[int, str]:
        """Row -> why it has no token, from `host()`'s values (no per-row tensor reads on the step's
        path; empty unless a row failed), logged as the host sampler logs it."""
        errors: dict[int, str] = {}
        if min(host, default=0) >= 0:
            return errors
        for rid, j in self.rows.items():
            if host[j] < 0:
                log.error("request %s: sampling failed: ValueError: %s", rid, NOTHING_LEFT)
                errors[j] = f"sampling failed: ValueError: {NOTHING_LEFT}"
        return errors


def stays_on_device(s: ScheduledRequest) -> bool:
    """Whether nothing but its token is read from an entry's logits, and nothing on the host
    decides that token (a grammar's mask, a thinking budget, a proposal's verification)."""
    req, p = s.req, s.req.params
    return (not s.spec_token_ids and req.thinking is None and req.grammar is None and p.logprobs is None
            and not (p.return_first_logits and req.first_logits is None))


@torch.inference_mode()
def sample_on_device(logits: torch.Tensor, items: list[ScheduledRequest], sampler: Sampler) -> DeviceTokens | None:
    """The step's tokens left on the device, when every entry of `items` (one logits row each)
    `stays_on_device` and is plain greedy or drawn in the sampler's device batch; None otherwise
    (and where that batch failed: the host path then samples the step)."""
    if not items or logits.shape[0] != len(items) or not all(stays_on_device(s) for s in items):
        return None
    reqs = [s.req for s in items]
    if all(r.params.greedy and not has_penalty(r) for r in reqs):
        ids = logits.max(dim=-1).indices  # the first maximum, as the host sampler picks it
        shown = ids
    elif sampler.draws_on_device(logits) and all(sampler.batchable(r) for r in reqs):
        drawn = sampler.draw(logits, reqs)
        if drawn is None:
            return None
        ids = drawn.ids
        shown = ids if drawn.ok is None else torch.where(drawn.ok, ids, -1)
    else:
        return None
    rows = {r.request_id: j for j, r in enumerate(reqs)}
    if not ids.is_cuda:
        return DeviceTokens(ids, rows, shown, None)
    host = torch.empty(shown.shape, dtype=shown.dtype, pin_memory=True)
    host.copy_(shown, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return DeviceTokens(ids, rows, host, ready)
