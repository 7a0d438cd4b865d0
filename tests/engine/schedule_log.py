"""Helpers for tests that check an engine's schedule step by step."""
from __future__ import annotations


def record(core) -> list[dict[str, int]]:
    """From now on, each step's scheduled requests and their new tokens ({request id: tokens})."""
    steps: list[dict[str, int]] = []
    schedule = core.scheduler.schedule

    def spy():
        out = schedule()
        steps.append({s.req.request_id: s.num_new_tokens for s in out.scheduled})
        return out

    core.scheduler.schedule = spy
    return steps


def drain(core, reqs) -> None:
    """Step until nothing is left; every one of `reqs` must have finished."""
    while core.has_unfinished():
        core.step()
    assert all(r.status.finished for r in reqs)
