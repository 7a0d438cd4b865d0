"""Which requests' tokens are paid from the share of step time (scheduler side, no tensors).

A request that wants prompt log-probs is expensive, and so are the requests that waited for its
prefill (the other sequences of such a request: their prompt tails and decodes at its whole
context are its cost too). Together they may take, each step, the tokens the share bucket
covers (`ShareController`, engine/core/step_cost.py, where the share is explained).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from engine.core.request import Request, RequestId
from engine.core.step_cost import (PROMPT_LOGPROBS_ALONE, PROMPT_LOGPROBS_SHARE, PROMPT_LOGPROBS_UNFITTED,
                                   PROMPT_LOGPROBS_UNFITTED_ALONE, ShareController)
from engine.core.step_io import SchedulerOutput

log = logging.getLogger(__name__)


class ExpensiveWork:
    """Owns the followers and the allowance left in the step being scheduled."""

    def __init__(self) -> None:
        self.share = ShareController(PROMPT_LOGPROBS_SHARE, PROMPT_LOGPROBS_ALONE, PROMPT_LOGPROBS_UNFITTED,
                                     PROMPT_LOGPROBS_UNFITTED_ALONE)
        self.followers: set[RequestId] = set()  # requests that waited for an expensive one's prefill
        # Requests that asked for prompt log-probs: with none (and no followers) a step skips the
        # scan of every running and waiting request (20k waiting requests made it O(n^2)).
        self.asking: set[RequestId] = set()
        self.left: int | None = None  # tokens expensive requests may still take this step (None: no cap)

    def __call__(self, req: Request) -> bool:
        return req.wants_prompt_logprobs or req.request_id in self.followers

    def begin_step(self, running: Iterable[Request], waiting: Iterable[Request],
                   held: Callable[[Request], bool]) -> int | None:
        """The tokens expensive requests may take in the step being scheduled, all together: what
        costs the share of the others' step, or alone its bite; None (the step's budget) when
        there are none. `held`: a waiting request that sits out for a shared prefix (not yet an other)."""
        if not self.asking and not self.followers:
            self.left = None
            return None
        running, waiting = list(running), list(waiting)
        if not any(self(r) for r in running) and not any(self(r) for r in waiting):
            self.left = None
        else:
            others = sum(1 for r in running if not self(r)) + sum(1 for r in waiting if not self(r) and not held(r))
            self.left = self.share.allowance(others)
        return self.left

    def cut(self, req: Request, n: int) -> int:
        """`n` new tokens, cut to what is left for an expensive request."""
        return n if self.left is None or not self(req) else min(n, self.left)

    def spend(self, req: Request, n: int) -> None:
        if self.left is not None and self(req):
            self.left -= n

    def follow(self, req: Request, owner: Request) -> None:
        """`req` waits for `owner`'s prefill: if `owner` is expensive, so is `req`, for its life."""
        if self(owner):
            self.followers.add(req.request_id)

    def add(self, req: Request) -> None:
        """A new request: one that asks for prompt log-probs may be expensive."""
        if req.prompt_logprobs is not None:
            self.asking.add(req.request_id)

    def drop(self, request_id: RequestId) -> None:
        self.followers.discard(request_id)
        self.asking.discard(request_id)

    def step_ran(self, out: SchedulerOutput, seconds: float, num_running: int, num_waiting: int) -> None:
        """A scheduled step's forward took `seconds` (the engine's measurement)."""
        expensive = sum(s.num_new_tokens for s in out.scheduled if self(s.req))
        self.share.observe(out.num_tokens, seconds, expensive, out.prompt_logprobs_allowance)
        if out.prompt_logprobs_allowance is not None and log.isEnabledFor(logging.DEBUG):  # the share, step by step
            log.debug("step: %d tokens, %d paid from the share (allowance %s), %.3f s; running %d, waiting %d, "
                      "followers %d, share credit %.3f s", out.num_tokens, expensive, out.prompt_logprobs_allowance,
                      seconds, num_running, num_waiting, len(self.followers), self.share.credit)
