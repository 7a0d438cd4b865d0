"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Every step has one token budget (`max_num_batched_tokens`). Running requests go first (their
decodes and the rest of their prompt chunks), then waiting ones in FCFS or priority order. With
`long_prefill_token_threshold`, no request's prompt chunk in a step is longer than that, so a long
prompt leaves budget for the prompts queued behind it.

`shortest_prefill` (shortest remaining prefill first): waiting requests are admitted in order of
the prompt tokens they have left after their G1 prefix hits; a running prompt with more tokens left
than the shortest waiting one sits out the step, and a step that finishes a prompt carries no
chunk of a longer one (the step's time is what the short prompt waits for). Decodes always run. A
prompt passed over `MAX_PASSED_OVER` steps in a row runs regardless, so a stream of short prompts
slows a long one down but cannot stop it.
When G1 runs out, the least urgent running request is preempted: its blocks are released
(they stay in the prefix cache, so a resume is usually a cache hit) and it waits again.

Two rules keep one request's expensive prompt from taking the engine (issue 38):
- **A prefix being computed is computed once.** A waiting request whose next uncached prompt block
  a running request is computing right now sits out (it is not admitted, nor does it hold up the
  queue) until that block is cached, then reads it: n sequences of one prompt, or many clients
  sending one document at once, prefill it once instead of n times.
- **Prompt log-probs get a share of the time, not the steps.** Such a request recomputes its
  whole prompt and scores every position against the vocabulary. While other requests have work,
  the prompt tokens of log-prob requests (all together) are paid from a bucket that each step
  fills with PROMPT_LOGPROBS_SHARE of the others' step time and that each bite empties by what
  it measured (`engine.core.step_cost.ShareController`): the others' steps take about that much
  longer on average. Alone, bites of PROMPT_LOGPROBS_ALONE plain steps' cost: a request that
  arrives waits for the step in flight, which must stay short (one 2048-token bite with
  log-probs took 4 s on the demo model, and every request arriving then waited that long).
  The requests that waited for such a request's prefill (its other sequences) are paid from
  the same bucket for their whole life: 15 sequences reading a 3.6k-token prompt's blocks then
  computing their tails and decoding at that context are the same request's cost.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from connectors.base import KVConnector, NullConnector
from engine.config import EngineConfig, SchedulingPolicy
from engine.kv.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestId, RequestStatus
from engine.core.step_cost import ShareController
from engine.core.step_io import ScheduledRequest, SchedulerOutput
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)

MAX_PASSED_OVER = 8  # shortest_prefill: steps a running prompt may sit out in a row
# Prompt log-prob work beside others gets this share of their step time, in bites of at most
# PROMPT_LOGPROBS_ALONE plain steps' cost, which is also its bite alone (~0.13-0.17 s on the demo
# model, 2 CPU cores). A probe decoding beside it pays the share on each of its steps plus, when it
# arrives between two of its requests, the alone bite in flight: at 0.5 the probe measured 1.8-1.9x
# its idle latency (1.5x of it the share), at 0.3 1.5-1.8x in six runs, and the request took 49-55 s
# instead of 41 s. Bites of 2 plain steps instead of 3 made the request 62 s and the probe no faster.
# Until steps are measured, fixed counts.
PROMPT_LOGPROBS_SHARE = 0.3
PROMPT_LOGPROBS_ALONE = 3.0
PROMPT_LOGPROBS_UNFITTED = 16
PROMPT_LOGPROBS_UNFITTED_ALONE = 128


def _tokens_left(req: Request) -> int:
    """Tokens a running request has still to schedule (1 for a decode)."""
    return req.num_tokens + req.num_output_placeholders - req.num_scheduled_tokens


class WaitingQueue:
    """FCFS deque, or a heap on (priority, arrival) for the priority policy."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[tuple[int, float], int, Request]] = []
        self._tie = itertools.count()

    def add(self, req: Request, front: bool = False) -> None:
        if self.policy is SchedulingPolicy.PRIORITY:
            heapq.heappush(self._heap, (req.sort_key(), next(self._tie), req))
        elif front:
            self._fifo.appendleft(req)
        else:
            self._fifo.append(req)

    def peek(self) -> Request:
        return self._heap[0][2] if self.policy is SchedulingPolicy.PRIORITY else self._fifo[0]

    def sort(self, key) -> int:
        """Reorder a non-empty FIFO queue by `key` (computed once per request; stable: arrival
        order among equals); returns the first request's key."""
        keyed = sorted(((key(r), i, r) for i, r in enumerate(self._fifo)), key=lambda t: t[:2])
        self._fifo = deque(r for _, _, r in keyed)
        return keyed[0][0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2] if self.policy is SchedulingPolicy.PRIORITY else self._fifo.popleft()

    def __iter__(self):
        return (e[2] for e in self._heap) if self.policy is SchedulingPolicy.PRIORITY else iter(self._fifo)

    def remove(self, req: Request) -> bool:
        if self.policy is SchedulingPolicy.PRIORITY:
            kept = [e for e in self._heap if e[2] is not req]
            found = len(kept) != len(self._heap)
            self._heap = kept
            heapq.heapify(self._heap)
            return found
        try:
            self._fifo.remove(req)
            return True
        except ValueError:
            return False

    def __len__(self) -> int:
        return len(self._heap) if self.policy is SchedulingPolicy.PRIORITY else len(self._fifo)


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: EngineConfig, max_num_batched_tokens: int,
                 connector: KVConnector | None = None,  # None: a NullConnector
                 num_lookahead_tokens: int = 0, num_spec_placeholders: int = 0) -> None:
        """Policy, max_num_seqs, chunked prefill and the prompt-chunk cap come from `config`;
        `max_num_batched_tokens` is the step budget the engine resolved from it."""
        self.kv = kv
        self.policy = policy = config.scheduling_policy
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.requests: dict[RequestId, Request] = {}
        self.loading: dict[RequestId, Request] = {}  # WAITING_FOR_REMOTE_KVS
        self.connector = connector if connector is not None else NullConnector()
        self.num_preemptions = 0
        # Slots allocated past a scheduled request's tokens when they are free: a draft model
        # writes the KV of its proposals there (vLLM's lookahead slots).
        self.num_lookahead_tokens = num_lookahead_tokens
        # Async scheduling with speculation: proposal slots reserved for a request whose last
        # token a launched step is still sampling (its proposals come after that).
        self.num_spec_placeholders = num_spec_placeholders
        self._passed_over: dict[RequestId, int] = {}  # shortest_prefill: steps each running prompt sat out
        self._followers: set[RequestId] = set()  # requests that waited for an expensive one's prefill
        # Prompt log-prob work per step, from how long steps ran (step_ran)
        self.share = ShareController(PROMPT_LOGPROBS_SHARE, PROMPT_LOGPROBS_ALONE, PROMPT_LOGPROBS_UNFITTED,
                                     PROMPT_LOGPROBS_UNFITTED_ALONE)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Something can be scheduled now (not only loads in flight)."""
        return bool(self.running) or len(self.waiting) > 0

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[RequestId] = set()
        srpt = self.policy is SchedulingPolicy.SHORTEST_PREFILL
        shortest = None  # shortest_prefill: prompt tokens the first waiting request has left
        if srpt and len(self.waiting):
            shortest = self.waiting.sort(self._prompt_left)
        deferred: list[Request] = []  # running prompts that sit out this step unless nothing shorter runs
        finishes_prompt = False  # a prompt completes in this step
        inflight = self._inflight_keys()
        held: list[Request] = []  # waiting requests that sit this step out (see the module docstring)
        plp = [self._prompt_logprobs_allowance(inflight)]  # prompt log-prob tokens this step may still take
        out.prompt_logprobs_allowance = plp[0]
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            left = _tokens_left(req)
            if (srpt and left > 1 and shortest is not None and shortest < left
                    and self._passed_over.get(req.request_id, 0) < MAX_PASSED_OVER):
                deferred.append(req)
                i += 1
                continue
            n = self._share(req, min(self._chunk(left), budget), plp)
            if n == 0:  # its prompt log-probs' share of this step is spent
                i += 1
                continue
            # Proposals ride on a decode, within the budget (one token of it is the decode's).
            spec = tuple(req.spec_token_ids[: budget - 1]) if n == 1 else ()
            if n == 1 and req.num_output_placeholders and self.num_spec_placeholders:
                # Its last token is still being sampled, so its proposals are not known yet: room
                # for them, filled in (or given back) once they are (EngineCore._speculate).
                most = req.num_prompt_tokens + req.max_output_tokens
                spec = (0,) * max(0, min(self.num_spec_placeholders, budget - 1, most - req.num_scheduled_tokens - 1))
            req.spec_token_ids = []
            n += len(spec)
            while not self._allocate(req, n):
                if spec:  # never preempt anyone for proposals: decode without them
                    n, spec = n - len(spec), ()
                    continue
                victim = self._pick_victim(scheduled)
                if victim is None:  # only requests in a launched step hold blocks: try next step
                    i += 1
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest.after(req, n, spec))
                scheduled.add(req.request_id)
                budget -= n
                self._spend(req, n, plp)
                finishes_prompt |= 1 < left == n
                if srpt:
                    self._passed_over.pop(req.request_id, None)  # counts steps sat out in a row
                i += 1
        # A step that had to preempt admits nobody new: memory is already short.
        while not out.preempted and len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            fresh = not self.kv.block_table(req)  # else resuming after an async load
            lookup = fresh and not req.wants_prompt_logprobs  # those need every prompt position's logits
            hits = self.kv.get_computed_blocks(req) if lookup else []
            if lookup and (owner := self._being_computed(req, len(hits), inflight)) is not None:
                if self._expensive(owner):
                    self._followers.add(req.request_id)
                held.append(self.waiting.pop())  # reads that block once it is cached
                continue
            num_cached = len(hits) * self.kv.block_size if fresh else req.num_computed_tokens
            if lookup and not req.load_failed:
                ext, is_async = self.connector.get_num_new_matched_tokens(req, num_cached)
                if ext > 0:
                    # Blocks for the whole prompt, not just the loaded part: a request that waits
                    # with its load done then needs no more blocks to be admitted, so loads that
                    # land together on a full G1 cannot deadlock the queue.
                    if not self.kv.allocate_slots(req, req.num_tokens - num_cached, hits):
                        break
                    self.waiting.pop()
                    self._count_prefix(req, num_cached)
                    req.num_computed_tokens = num_cached
                    # a connector given KV groups gets every group's table
                    self.connector.update_state_after_alloc(
                        req, self.kv.block_tables(req) if self.kv.grouped else self.kv.block_table(req), ext)
                    req.pending_external_tokens = ext
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    self.loading[req.request_id] = req
                    continue
            remaining = req.num_tokens - num_cached
            n = self._share(req, min(self._chunk(remaining), budget), plp)
            if n == 0:
                held.append(self.waiting.pop())
                continue
            if n < remaining and not self.enable_chunked_prefill:
                break
            if srpt and n < remaining and finishes_prompt:  # leave the step to the prompts it finishes
                break
            if not self._allocate(req, n, hits):
                break
            self.waiting.pop()
            if fresh:
                self._count_prefix(req, num_cached)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:  # its queue time ends here (loads from lower tiers included)
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest.after(req, n))
            scheduled.add(req.request_id)
            budget -= n
            self._spend(req, n, plp)
            finishes_prompt |= n == remaining
            if fresh and self.kv.pool.enable_caching and len(self.waiting):  # admitted now: computing from here
                self._add_inflight(inflight, req, num_cached)
        for req in reversed(held):  # back in their places, for the next step
            self.waiting.add(req, front=True)
        if deferred:
            self._run_deferred(out, deferred, budget, scheduled, finishes_prompt, plp)
        return out

    def _inflight_keys(self) -> dict[BlockKey, Request]:
        """Keys of the full prompt blocks running requests have still to compute, and who computes
        them (empty without prefix caching, or with nobody waiting to share them)."""
        if not self.kv.pool.enable_caching or not len(self.waiting):
            return {}
        inflight: dict[BlockKey, Request] = {}
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                self._add_inflight(inflight, r, r.num_computed_tokens)
        return inflight

    def _add_inflight(self, inflight: dict[BlockKey, Request], req: Request, num_computed: int) -> None:
        bs = self.kv.block_size
        inflight.update(dict.fromkeys(self.kv.prompt_keys(req)[num_computed // bs:req.num_prompt_tokens // bs], req))

    def _being_computed(self, req: Request, num_hit_blocks: int, inflight: dict[BlockKey, Request]) -> Request | None:
        """Who is computing the request's next block after its hits, if a running prompt is."""
        if not inflight:
            return None
        keys = self.kv.prompt_keys(req)
        if num_hit_blocks < min(len(keys), (req.num_tokens - 1) // self.kv.block_size):
            return inflight.get(keys[num_hit_blocks])
        return None

    def _expensive(self, req: Request) -> bool:
        """Its work is paid from the share bucket: it wants prompt log-probs, or it waited for the
        prefill of one that does (the other sequences of such a request: their prompt tails and
        decodes at its whole context are its cost too)."""
        return req.wants_prompt_logprobs or req.request_id in self._followers

    def _prompt_logprobs_allowance(self, inflight: dict[BlockKey, Request]) -> int | None:
        """Tokens expensive requests (`_expensive`) may take this step, all together: what costs
        PROMPT_LOGPROBS_SHARE of the others' step, or alone PROMPT_LOGPROBS_ALONE steps' fixed
        cost; None (the step's budget) when there are none."""
        if not any(self._expensive(r) for r in self.running) and not any(self._expensive(r) for r in self.waiting):
            return None
        others = sum(1 for r in self.running if not self._expensive(r))
        others += sum(1 for r in self.waiting if not self._expensive(r)  # those held for a shared prefix: not yet
                      and not (inflight and not inflight.keys().isdisjoint(self.kv.prompt_keys(r))))
        return self.share.allowance(others)

    def step_ran(self, out: SchedulerOutput, seconds: float) -> None:
        """A scheduled step's forward took `seconds` (the engine's measurement)."""
        expensive = sum(s.num_new_tokens for s in out.scheduled if self._expensive(s.req))
        self.share.observe(out.num_tokens, seconds, expensive, out.prompt_logprobs_allowance)
        if out.prompt_logprobs_allowance is not None and log.isEnabledFor(logging.DEBUG):  # the share, step by step
            log.debug("step: %d tokens, %d paid from the share (allowance %s), %.3f s; running %d, waiting %d, "
                      "followers %d, share credit %.3f s", out.num_tokens, expensive, out.prompt_logprobs_allowance,
                      seconds, len(self.running), len(self.waiting), len(self._followers), self.share.credit)

    def _share(self, req: Request, n: int, plp: list[int | None]) -> int:
        """`n` new tokens, cut to the allowance for an expensive request."""
        return n if plp[0] is None or not self._expensive(req) else min(n, plp[0])

    def _spend(self, req: Request, n: int, plp: list[int | None]) -> None:
        if plp[0] is not None and self._expensive(req):
            plp[0] -= n

    def _prompt_left(self, req: Request) -> int:
        """Prompt tokens a waiting request has left to compute (after its G1 prefix hits, if fresh)."""
        if self.kv.block_table(req) or req.wants_prompt_logprobs:
            return req.num_tokens - req.num_computed_tokens
        return req.num_tokens - len(self.kv.get_computed_blocks(req)) * self.kv.block_size

    def _run_deferred(self, out: SchedulerOutput, deferred: list[Request], budget: int,
                      scheduled: set[RequestId], finishes_prompt: bool, plp: list[int | None]) -> None:
        """shortest_prefill: the running prompts that sat out get what budget is left, shortest
        first, unless a prompt finishes in this step (then they wait: no preemption for them)."""
        for req in sorted(deferred, key=_tokens_left):
            if req.status is not RequestStatus.RUNNING:  # preempted later in this step
                continue
            if finishes_prompt or budget <= 0:
                self._passed_over[req.request_id] = self._passed_over.get(req.request_id, 0) + 1
                continue
            n = self._share(req, min(self._chunk(_tokens_left(req)), budget), plp)
            if n == 0 or not self._allocate(req, n):
                self._passed_over[req.request_id] = self._passed_over.get(req.request_id, 0) + 1
                continue
            out.scheduled.append(ScheduledRequest.after(req, n))
            scheduled.add(req.request_id)
            budget -= n
            self._spend(req, n, plp)
            self._passed_over.pop(req.request_id, None)

    def _chunk(self, remaining: int) -> int:
        """Tokens a request may compute this step, budget aside (a decode's one is never capped)."""
        cap = self.long_prefill_token_threshold
        return cap if 0 < cap < remaining else remaining

    def _allocate(self, req: Request, n: int, hits: list = ()) -> bool:
        """Slots for n tokens, with the lookahead when there is room for it (never past the
        most tokens the request can have: its table must fit max_model_len)."""
        most = req.num_prompt_tokens + req.max_output_tokens
        ahead = min(self.num_lookahead_tokens, most - req.num_scheduled_tokens - len(hits) * self.kv.block_size - n)
        return (ahead > 0 and self.kv.allocate_slots(req, n + ahead, hits)) or self.kv.allocate_slots(req, n, hits)

    def _count_prefix(self, req: Request, num_g1_hits: int) -> None:
        if req.num_cached_tokens < 0:  # count each prompt once, not each retry or resume
            self.kv.record_prefix_lookup(req.num_tokens, num_g1_hits)
            req.num_cached_tokens = num_g1_hits
            if num_g1_hits:
                req.cached_by_tier["G1"] = num_g1_hits

    def finish_load(self, req: Request, failed_blocks: set[int]) -> bool:
        """An async load ended. Tokens up to the request's first failed block count as
        computed; the rest are recomputed in the blocks already allocated for them (and the
        connector is not asked again: the same lookup would fail the same way). Returns
        whether everything loaded."""
        del self.loading[req.request_id]
        ext, req.pending_external_tokens = req.pending_external_tokens, 0
        bs = self.kv.block_size
        table = self.kv.block_table(req)
        first = req.num_computed_tokens // bs
        end_token = req.num_computed_tokens + ext
        end = -(-end_token // bs)  # the last block may be partly loaded: the prompt's last token is computed
        bad = next((i for i in range(first, end) if table[i] in failed_blocks), end)
        loaded = min(bad * bs, end_token) - req.num_computed_tokens
        req.num_computed_tokens += loaded
        if not req.preempted:  # a resume's reload is not a prompt-cache hit
            req.num_cached_tokens += loaded
        if loaded == ext:  # sliding groups were filled for this end only (a failed load counts nothing)
            self.kv.skip_unloaded(req, req.num_computed_tokens)
        self.kv.cache_full_blocks(req)
        if loaded < ext:
            req.load_failed = True
        split = self.connector.take_load_split(req.request_id)
        if not req.preempted:
            left = loaded  # the split is in lookup order: trim it to what landed
            for tier, planned in split.items():
                n = min(planned, left)
                left -= n
                if n:
                    req.cached_by_tier[tier] = req.cached_by_tier.get(tier, 0) + n
        req.status = RequestStatus.WAITING
        self.waiting.add(req, front=True)
        return loaded == ext

    def _pick_victim(self, scheduled: set[RequestId]) -> Request | None:
        # Never a request already given work this step, nor one in a launched step (async
        # scheduling): their blocks are about to be written.
        candidates = [r for r in self.running if r.request_id not in scheduled and not r.num_inflight_tokens]
        if not candidates:
            return None
        if self.policy is SchedulingPolicy.PRIORITY:
            return max(candidates, key=Request.sort_key)
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self._passed_over.pop(req.request_id, None)
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.preempted = True
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        self.num_preemptions += 1
        self.waiting.add(req, front=True)

    def finish(self, req: Request, status: RequestStatus, free_blocks: bool = True) -> None:
        """Mark finished and release its blocks (running or waiting). `free_blocks=False`: the
        caller frees them later (a launched step still writes them)."""
        req.status = status
        self._passed_over.pop(req.request_id, None)
        self._followers.discard(req.request_id)
        if req in self.running:
            self.running.remove(req)
        elif self.loading.pop(req.request_id, None) is None:
            self.waiting.remove(req)
        if free_blocks:
            self.kv.free(req)
        del self.requests[req.request_id]
