"""A failing forward is pinned on the request(s) that make it fail; the rest of the batch goes on."""
from __future__ import annotations

import logging

import torch

from engine.runner.model_runner import ModelOutput, ModelRunner
from engine.core.request import Request
from engine.core.step_io import RunPlan, SchedulerOutput

log = logging.getLogger(__name__)

FORWARD_ERRORS = (RuntimeError, ValueError, IndexError, TypeError)  # what a request's forward may raise


def execute_isolating(runner: ModelRunner, sched: SchedulerOutput, tables: list[tuple[list[int], ...]]
                      ) -> tuple[ModelOutput, list[tuple[Request, str]], SchedulerOutput]:
    """Runs the forward; if it raises, finds which requests make it fail by running each alone
    (their KV writes go to their own slots, so a rerun is harmless) and runs the rest again,
    without the failed ones. Returns the output for the requests that ran, the failed ones with
    the reason, and the step as it ran (`sched` itself when nothing failed; never changed). An error that every request of a batch hits on its own is the
    engine's, not a request's: it raises."""
    try:
        plan = sched.plan()
        return runner.execute(plan, tables), [], sched
    except FORWARD_ERRORS as e:
        if len(sched.scheduled) > 1:
            log.error("a step of %d requests failed (%s: %s); finding the request(s) that cause it",
                      len(sched.scheduled), type(e).__name__, e)
        first = e
    failed: list[tuple[Request, str]] = []
    ok: list[int] = []
    for i, s in enumerate(sched.scheduled):
        try:
            runner.execute(RunPlan((plan.requests[i],)), [tables[i]])
            ok.append(i)
        except FORWARD_ERRORS as e:
            failed.append((s.req, f"the forward pass failed: {type(e).__name__}: {e}"))
    if not ok and len(failed) > 1:
        raise first
    ran = SchedulerOutput([sched.scheduled[i] for i in ok], sched.preempted, sched.prompt_logprobs_allowance)
    if not ok:
        return ModelOutput(torch.empty(0, 0), []), failed, ran
    return runner.execute(RunPlan(tuple(plan.requests[i] for i in ok)), [tables[i] for i in ok]), failed, ran
