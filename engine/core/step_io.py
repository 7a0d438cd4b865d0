"""What crosses the boundary between the scheduler side and the runner side each step.

`SchedulerOutput` is the scheduler's bookkeeping of a step (which requests, how many tokens,
what was preempted); the engine core reads it when it applies the step's results.
`StepResult` is what comes back, on the host, for `Scheduler.update` to apply.
`RunPlan` is what the model runner gets: frozen, typed, and no live `Request`: each planned
request's id, the token ids to run, where they start, whether the step samples it, and what
scoring its prompt needs. Built by `SchedulerOutput.plan()`, or directly by a proposer that runs
its draft model through a runner of its own.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.request import Request, RequestId
from engine.mm.inputs import MMItem


@dataclass(frozen=True)
class PlannedRequest:
    """One request's part of a step, as the runner sees it."""
    request_id: RequestId
    token_ids: tuple[int, ...]  # the known tokens to run, from `start` (proposals not included)
    num_placeholders: int  # tokens after them that an earlier step in flight samples (async scheduling)
    spec_token_ids: tuple[int, ...]  # proposals scored after them
    start: int  # position of the first token
    samples: bool  # the step reaches the end of the sequence and samples its next token(s)
    prompt_logprobs: int | None = None  # top-k: this step scores prompt positions (`prompt_token_ids` is the prompt)
    prompt_token_ids: Sequence[int] = ()  # the request's own list: not copied every step
    mm: tuple[MMItem, ...] = ()  # images with placeholders among this step's tokens (engine/mm/inputs.py)
    lora_slot: int = -1  # the runner slot of its LoRA adapter (-1: the base model)
    in_prompt: bool = False  # all its tokens are prompt tokens (a prompt chunk, not a decode)

    def __post_init__(self) -> None:
        if self.num_placeholders < 0 or self.start < 0:
            raise ValueError(f"{self.request_id}: negative placeholders or start in a step plan")

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) + self.num_placeholders + len(self.spec_token_ids)

    @classmethod
    def of(cls, req: Any, n: int, start: int, spec: tuple[int, ...], samples: bool) -> PlannedRequest:
        """`req`'s next `n` tokens from `start` (a Request, or a proposer's view of one)."""
        known = tuple(req.all_token_ids[start:start + n - len(spec)])
        scores = getattr(req, "wants_prompt_logprobs", False)
        media = getattr(req, "mm", None)
        lora = getattr(req, "lora", None)
        return cls(req.request_id, known, n - len(spec) - len(known), spec, start, samples,
                   (req.params.prompt_logprobs or 0) if scores else None, req.prompt_token_ids if scores else (),
                   media.overlapping(start, start + n) if media is not None else (),
                   lora.slot if lora is not None else -1, start + n <= req.num_prompt_tokens)


@dataclass(frozen=True)
class RunPlan:
    """A step as the model runner gets it."""
    requests: tuple[PlannedRequest, ...]
    released: tuple[RequestId, ...] = ()  # requests whose rows the runner drops first (preempted)


@dataclass
class ScheduledRequest:
    req: Request
    num_new_tokens: int  # spec tokens included
    # Proposed tokens scored after the request's last token (the last len(spec) of num_new_tokens).
    spec_token_ids: tuple[int, ...]
    start: int  # position of the first new token (the request's computed + in-flight tokens)
    samples: bool  # the step reaches the end of the sequence and samples its next token(s)

    @classmethod
    def after(cls, req: Request, n: int, spec: tuple[int, ...] = ()) -> ScheduledRequest:
        """n new tokens after what the request has computed or in flight (async scheduling)."""
        start = req.num_scheduled_tokens
        return cls(req, n, spec, start, start + n - len(spec) == req.num_tokens + req.num_output_placeholders)

    @property
    def num_committed_tokens(self) -> int:
        """Tokens whose KV is kept whatever verification decides."""
        return self.num_new_tokens - len(self.spec_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    prompt_logprobs_allowance: int | None = None  # the cap this step's prompt log-prob tokens had

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def plan(self) -> RunPlan:
        """The runner's view of this step."""
        return RunPlan(tuple(PlannedRequest.of(s.req, s.num_new_tokens, s.start, s.spec_token_ids, s.samples)
                             for s in self.scheduled), tuple(r.request_id for r in self.preempted))


def plan_after(reqs: list[Any], counts: list[int]) -> RunPlan:
    """A plan of each of `reqs`' next `counts` tokens after what it has computed or in flight (a
    proposer's draft forward over views of the target's requests)."""
    return SchedulerOutput([ScheduledRequest.after(r, n) for r, n in zip(reqs, counts)]).plan()


@dataclass(frozen=True, eq=False)
class StepResult:
    """What a step that ran gives back to `Scheduler.update`: host values, indexed by the step's
    entries (`SchedulerOutput.scheduled`)."""
    sampled: tuple[int, ...]  # the entries that sampled, in row order
    tokens: tuple[list[int], ...]  # per sampled entry: what it emitted (1 + the proposals it kept; [] if it failed)
    logprobs: tuple[list[dict[int, float]] | None, ...]  # per sampled entry, per token
    errors: dict[int, str] = field(default_factory=dict)  # position in `sampled` -> why its sampling failed
    prompt_logprobs: dict[int, tuple[int, list]] = field(default_factory=dict)  # entry -> (first position, scores)
    first_logits: dict[int, Any] = field(default_factory=dict)  # position in `sampled` -> logits row (return_first_logits)
    failed: tuple[tuple[Request, str], ...] = ()  # requests whose forward failed on their own (not in the step)

    def __post_init__(self) -> None:
        if not len(self.sampled) == len(self.tokens) == len(self.logprobs):
            raise ValueError("a step result needs tokens and logprobs for each sampled entry")
