"""Async scheduling (vLLM's `--async-scheduling`): step N+1 is planned while step N runs.

Each `EngineCore.step()` runs one planned step's forward on the calling thread and, meanwhile,
hands the bookkeeping to a helper thread: apply the previous step's sampled tokens to its requests
(stop checks, finishes, prefix-cache registration, connector stores), then schedule the next step
and prepare its inputs. The next step's tokens that the running step samples are placeholders in
its input ids, written in once that step has sampled, so the forwards follow one another with
only sampling between them. The forward stays on the calling thread because torch's OpenMP pool
is the caller's: measured on the demo model, a batch-64 decode forward took 55 ms on the main
thread and 67 ms (compiled) / 80+ ms (eager) on a second thread.

The helper only ever runs inside a step() call, joined before it returns, so the engine's state
is never touched concurrently with the caller (add_request / abort_request run between steps).
The forward, running beside it, reads only the step's prepared tensors and the KV cache; blocks
of a request that finishes while a planned or running step still writes them are freed once that
step has run (`Scheduler.deferred`), since a load into a block reused meanwhile could race the
write.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from engine.runner.model_runner import StepInputs
from engine.runner.step_timer import StepTimer
from engine.sample.device_tokens import DeviceTokens
from engine.core.request import Request, RequestId
from engine.core.step_io import ScheduledRequest, SchedulerOutput, StepResult



@dataclass(frozen=True, eq=False)
class PlannedStep:
    """Scheduled and prepared; its requests count its tokens as in flight until it is applied."""
    sched: SchedulerOutput
    tables: list[tuple[list[int], ...]]  # each request's block table per KV group
    meta: object  # the connector's metadata (loads started at planning, stores after the forward)
    inputs: StepInputs
    # Its entries as planned: a rerun after a failed forward drops the failing ones from `sched`,
    # and their in-flight counts must still be returned.
    entries: tuple[ScheduledRequest, ...]

    def only_finished(self) -> bool:
        """Every request in it ended after it was planned: its forward would be thrown away."""
        return all(s.req.status.finished for s in self.sched.scheduled)


@dataclass(frozen=True, eq=False)
class ForwardTime:
    """A step's forward, timed without waiting for it (read when the step is applied)."""
    timer: StepTimer
    ok: bool  # it ran through (a failed one counts in the stats, not in the step-cost fits)
    propose_seconds: float  # the proposals' time, charged to the verify step


@dataclass(frozen=True, eq=False)
class RanStep:
    """Ran and sampled, not yet applied to its requests. A step sampled on the device (`device`,
    engine/sample/device_tokens.py) reads its host values when `result` is first asked for: on the
    bookkeeping thread, while the next step runs."""
    planned: PlannedStep
    resolve: Callable[[], StepResult]
    forward: ForwardTime | None = None  # None: its forward was skipped
    device: DeviceTokens | None = None

    @cached_property
    def result(self) -> StepResult:
        return self.resolve()

    def tokens(self) -> dict[RequestId, int]:
        """Each sampling request's new token, for the next step's placeholders."""
        return {rid: toks[-1] for rid, (_, toks) in self.emitted().items()}

    @cached_property  # read up to four times a step (placeholders, proposals, corrections, EAGLE-3)
    def _emitted(self) -> dict[RequestId, tuple[ScheduledRequest, list[int]]]:
        sched = self.planned.sched
        return {sched.scheduled[i].req.request_id: (sched.scheduled[i], toks)
                for i, toks in zip(self.result.sampled, self.result.tokens) if toks}

    def emitted(self) -> dict[RequestId, tuple[ScheduledRequest, list[int]]]:
        """Each request that sampled: its entry in this step and the tokens it emitted (1 + the
        proposals it kept), before stop checks."""
        return self._emitted

    def kept_positions(self) -> list[tuple[Request, int, int, int]]:
        """(request, first position, count, first row among the step's tokens) of the positions
        whose KV the step keeps: prompt chunks whole, a sampling entry's committed tokens and
        the proposals it kept (what EAGLE-3 observes; positions past a stop are dropped with
        the request)."""
        emitted = self.emitted()
        out, row = [], 0
        for s in self.planned.sched.scheduled:
            if not s.req.status.finished:
                got = emitted.get(s.req.request_id)
                n = s.num_new_tokens if not s.samples else s.num_committed_tokens + (len(got[1]) - 1 if got else 0)
                out.append((s.req, s.start, n, row))
            row += s.num_new_tokens
        return out

    def corrected(self, entries: tuple[ScheduledRequest, ...]) -> list[ScheduledRequest] | None:
        """The next step's `entries`, planned while this one ran, with each request that sampled
        here moved to where its emitted tokens put it and given the proposals in its
        `spec_token_ids` (at most the slots reserved); None when none of them sampled here."""
        emitted = self.emitted()
        sampling = {s.req.request_id for s in self.planned.entries if s.samples}
        if not any(s.req.request_id in sampling for s in entries):
            return None
        out = []
        for s in entries:
            req = s.req
            if req.request_id not in sampling:
                out.append(s)
            elif req.request_id not in emitted:  # it failed here: its row is thrown away
                out.append(ScheduledRequest(req, 1, (), s.start, True))
            else:
                prev, toks = emitted[req.request_id]
                spec = req.take_proposal(len(s.spec_token_ids))
                out.append(ScheduledRequest(req, 1 + len(spec), spec,
                                            prev.start + prev.num_committed_tokens + len(toks) - 1, True))
        return out


def mark_in_flight(entries: tuple[ScheduledRequest, ...], sign: int) -> None:
    """+1 when a step is planned, -1 when it is applied: its tokens, and the tokens it samples
    (as if every proposal were accepted: the next step starts after them, and moves back once
    verification has said how many were; `EngineCore._speculate`)."""
    for s in entries:
        s.req.mark_in_flight(sign, s.num_new_tokens, s.samples * (1 + len(s.spec_token_ids)))
