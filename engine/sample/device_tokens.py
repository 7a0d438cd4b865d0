"""Sampled ids that stay on the device (issue 42, Model Runner V2's idea).

With async scheduling, step N+1 is prepared while step N runs, with placeholders where N's sampled
tokens go. A step whose every sampling entry is plain greedy (no proposals, penalties, logit
controls, grammar, thinking budget, logprobs or first logits) takes the argmax of its rows on the
device and leaves it there: step N+1's placeholders are filled from it by a device-side index, so
N+1 can be launched with no host round trip. The host copy, which the scheduler needs, is started
without blocking and waited for only when the bookkeeping thread reads it, while N+1 runs. Any
other step samples on the host as before (engine/sample/sampler.py); the argmax here is the host
sampler's own rule for such rows (`Sampler._plain_greedy`), so the tokens are the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.core.request import RequestId
from engine.sample.sampler import has_penalty

if TYPE_CHECKING:
    from engine.core.step_io import ScheduledRequest


@dataclass(frozen=True, eq=False)
class DeviceTokens:
    ids: torch.Tensor  # [entries] int64 on the model's device: each sampling entry's token, in row order
    rows: dict[RequestId, int]  # each sampling request's index into `ids`
    _host: torch.Tensor  # the host copy (page-locked on CUDA), complete once `_ready` has fired
    _ready: Any  # torch.cuda.Event, or None where the copy was synchronous

    def host(self) -> list[int]:
        """The tokens as host ints; on CUDA waits for the copy (not for the steps queued after it)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


def plain_greedy(s: ScheduledRequest) -> bool:
    """Whether an entry's token is its logits' argmax and nothing else is read from them."""
    req, p = s.req, s.req.params
    return (not s.spec_token_ids and p.greedy and not has_penalty(req) and req.thinking is None
            and p.logprobs is None and not (p.return_first_logits and req.first_logits is None))


@torch.inference_mode()
def device_greedy(logits: torch.Tensor, items: list[ScheduledRequest]) -> DeviceTokens | None:
    """The step's tokens left on the device, when every entry of `items` (one logits row each) is
    plain greedy; None otherwise."""
    if not items or logits.shape[0] != len(items) or not all(plain_greedy(s) for s in items):
        return None
    ids = logits.max(dim=-1).indices  # the first maximum, as the host sampler picks it
    rows = {s.req.request_id: j for j, s in enumerate(items)}
    if not ids.is_cuda:
        return DeviceTokens(ids, rows, ids, None)
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return DeviceTokens(ids, rows, host, ready)
