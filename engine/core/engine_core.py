"""The engine core loop: step() = schedule -> run -> sample -> update.

It owns the scheduler (bookkeeping), the model runner (tensors) and the sampler, and is the
one place where a request's lifecycle advances. The offline `LLM` API and, later, the
server's engine-core process both drive it.
"""
from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from connectors.base import NullConnector
from connectors.pd import parse as parse_pd
from engine.config import EngineConfig
from engine.core.async_pipeline import ForwardTime, PlannedStep, RanStep, mark_in_flight
from engine.core.build import build
from engine.core.isolation import FORWARD_ERRORS, execute_isolating
from engine.core.request import Request
from engine.core.request_factory import Prepared
from engine.core.stats import EngineInfo, EngineStats
from engine.core.step_io import SchedulerOutput, StepResult
from engine.lora.adapter import LoRARequest
from engine.lora.registry import AdapterRef
from engine.mm.inputs import MMInputs
from engine.runner.model_runner import ModelOutput
from engine.sample.device_tokens import DeviceTokens, sample_on_device
from engine.sample.stop import detokenize
from engine.sampling_params import SamplingParams
from engine.spec.decode import sample_outputs
from kvstore.threads import one_torch_thread

log = logging.getLogger(__name__)


class EngineCore:
    IDLE_WAIT_S = 0.05  # longest idle sleep while transfers are in flight (a finish wakes it sooner)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        p = build(config)  # G1 sizing, KV layout, model, compile, connector, proposer (engine/core/build.py)
        self.model_config, self.tokenizer, self.eos_token_ids, self.requests = (
            p.model_config, p.tokenizer, p.eos_token_ids, p.requests)
        self.hidden_spec = config.hidden_states
        self.max_model_len, self.max_num_batched_tokens = p.max_model_len, p.max_num_batched_tokens
        self.pool, self.kv, self.runner, self.threads = p.pool, p.kv, p.runner, p.threads
        self.events, self.publisher, self.connector = p.events, p.publisher, p.connector
        self.sampler, self.spec, self.scheduler = p.sampler, p.spec, p.scheduler
        self.loras = p.loras
        for i, (name, path) in enumerate(config.lora_modules):  # --lora-modules: served from the start
            self.add_lora(LoRARequest(name, i + 1, path))
        # Async scheduling: the bookkeeping thread, the step planned to run next and the one that
        # ran but is not applied yet.
        self._helper = ThreadPoolExecutor(1, "kvtier-bookkeeping", initializer=one_torch_thread
                                          ) if config.async_scheduling else None
        self._planned: PlannedStep | None = None
        self._ran: RanStep | None = None
        self.busy_seconds = 0.0  # steps that ran a forward, and the forwards in them (EngineStats)
        self.forward_seconds = 0.0
        self.device_filled_steps = 0  # async steps whose inputs took the last step's tokens on the device

    def _publish_events(self) -> None:
        if self.publisher is not None and self.events is not None:
            self.publisher.publish(self.events.drain())

    def publish_pending_events(self) -> None:
        """Tier writes finish after their step: the server calls this while idle, so subscribers hear of them."""
        self._publish_events()

    def flush_offload(self) -> None:
        """Wait for queued offload stores and writes, then release the G1 blocks they held."""
        self.connector.flush()
        self._poll_loads()

    def shutdown(self) -> None:
        """Flush pending offload writes and stop transfer and step threads."""
        if self._helper is not None:
            self.drain()
            self._helper.shutdown()
            self._helper = None
        self.sampler.masks.close()
        self.runner.close()
        self.connector.close()
        self.connector = NullConnector()
        self.scheduler.set_connector(self.connector)
        if self.publisher is not None:
            self._publish_events()
            self.publisher.close()
            self.publisher = None

    # -- requests --------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                     prompt: str | None = None, priority: int = 0, cache_salt: str | None = None,
                     session: str | None = None, kv_transfer_params: dict[str, Any] | None = None,
                     prepared: Prepared | None = None, mm: MMInputs | None = None,
                     lora: AdapterRef | None = None) -> Request:
        """Validates and builds a request without touching engine state. `session`: the client's
        conversation hint (OpenAI's `prompt_cache_key`, else `user`), which eviction policies see.
        `kv_transfer_params`: prefill/decode disaggregation (connectors/pd.py), which the
        connector must support. `prepared`: `self.requests.prepare(params)`, done off the step loop
        (None: done here). `lora`: its adapter (`add_lora`)."""
        if lora is not None and (self.loras is None or self.loras.get(lora.name) != lora):
            raise ValueError(f"LoRA adapter {lora.name!r} is not loaded" if self.loras is not None else
                             "a LoRA adapter was requested but LoRA is off (enable_lora)")
        if mm is not None:
            if not self.model_config.multimodal:
                raise ValueError(f"{self.model_config.architecture} takes no images")
            mm.check_items(prompt_token_ids, self.model_config.image_spec)
            mm.check_fits(self.max_num_batched_tokens)
        pd = parse_pd(kv_transfer_params)
        if pd is not None:
            self.connector.check_pd(pd)
        return self.requests.make(request_id, prompt_token_ids, params, self.max_model_len, prompt=prompt,
                                  priority=priority, cache_salt=cache_salt, session=session, pd=pd, prepared=prepared,
                                  mm=mm, lora=lora)

    # -- LoRA adapters --------------------------------------------------------------------
    def add_lora(self, req: LoRARequest) -> AdapterRef:
        """Loads (or finds) an adapter; ValueError naming what is wrong. Requests then name it
        through `make_request(lora=...)`."""
        if self.loras is None:
            raise ValueError("LoRA adapters need enable_lora")
        return self.loras.add(req, self._lora_in_use)

    def remove_lora(self, name: str) -> None:
        if self.loras is None:
            raise ValueError("LoRA adapters need enable_lora")
        self.loras.remove(name, self._lora_in_use)

    def _lora_in_use(self, name: str) -> bool:
        return any(r.lora is not None and r.lora.name == name for r in self.scheduler.requests.values())

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)
        if req.lora is not None and self.loras is not None:
            self.loras.count_request(req.lora.name)

    def abort_request(self, request_id: str) -> bool:
        found = self.scheduler.abort(request_id)
        self._release_finished()
        return found

    def check_health(self) -> None:
        """Raises when the engine cannot go on even while idle: a tensor-parallel rank that exited
        (engine/parallel/ranks.RankFailed)."""
        self.runner.check_peers()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._planned is not None or self._ran is not None

    # -- the loop --------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One iteration. Returns the requests that got a new token this step (finished ones
        included, with a finished status). With async scheduling they are those of the step that
        ran in the previous call, applied while this call's forward runs."""
        if self.threads is not None:
            self.threads.tick()
        updated = self._step_async() if self._helper is not None else self._step_sync()
        if self.threads is not None and not self.has_unfinished():
            self.threads.rest()  # idle from here: what others use meanwhile is not contention
        return updated

    def _step_sync(self) -> list[Request]:
        start = time.perf_counter()
        updated = self._poll_loads()
        sched, tables, meta = self._plan()
        if not sched.scheduled:
            self._idle()
            return updated
        self.sampler.prefetch([s.req for s in sched.scheduled if s.samples])
        forward_start = time.perf_counter()
        out, failed, sched = execute_isolating(self.runner, sched, tables)
        self.runner.synchronize()
        self._timed(sched, time.perf_counter() - forward_start, not failed, self._propose_seconds())
        updated += self._apply(sched, meta, self._sample(sched, out, failed))
        self.busy_seconds += time.perf_counter() - start
        return updated

    def _timed(self, sched: SchedulerOutput, forward: float, ok: bool, propose: float) -> None:
        """A forward's time: the stats, and (when it ran through) the scheduler's and speculation's
        step-cost fits; a proposal costs its verify tokens and the proposer's time (`propose`)."""
        self.forward_seconds += forward
        if ok:
            self.scheduler.step_ran(sched, forward)
        if ok and self.spec is not None and all(s.num_committed_tokens == 1 for s in sched.scheduled):
            self.spec.budget.observe_step(sched.num_tokens, forward + propose)

    def _propose_seconds(self) -> float:
        return self.spec.last_propose_seconds if self.spec is not None else 0.0

    def _plan(self) -> tuple[SchedulerOutput, list[tuple[list[int], ...]], object]:
        """Schedule -> block tables -> connector metadata, with this step's loads started."""
        sched = self.scheduler.schedule()
        tables = [self.kv.block_tables(s.req) for s in sched.scheduled]
        # Connectors see committed tokens whose ids are known: a block that proposals would complete
        # is stored once verification has kept them, one that a token still being sampled completes
        # (async scheduling) a step later. With KV groups, a connector gets each group's table.
        meta = self.connector.build_connector_meta(
            [(s.req, min(s.req.num_tokens, s.start + s.num_committed_tokens) - s.req.num_computed_tokens,
              self.kv.held_tables(s.req) if self.kv.grouped and self.connector.supports_kv_groups else t[0])
             for s, t in zip(sched.scheduled, tables)])
        self.connector.start_load_kv(meta)
        return sched, tables, meta

    def _idle(self) -> None:
        """Nothing to schedule and nothing running."""
        if self.scheduler.loading or self.connector.busy():
            # Only transfers in flight: sleep until one finishes. Polling here would take a core
            # from the copies (2 cores: a G2 load ran at ~60% speed while we spun).
            self.connector.wait_for_progress(self.IDLE_WAIT_S)
        elif self.scheduler.has_unfinished():
            raise RuntimeError("scheduler made no progress with requests pending")

    def _sample(self, sched: SchedulerOutput, out: ModelOutput, failed: list[tuple[Request, str]]) -> StepResult:
        """The sample stage: a step's output as host values for the scheduler's update."""
        items = [sched.scheduled[i] for i in out.sampled]
        tokens, logprobs, errors = sample_outputs(out, items, self.sampler, self.spec)
        first = {j: out.rows(j)[0].float().cpu() for j, s in enumerate(items)  # the caller keeps it, not the pool
                 if s.req.params.return_first_logits and s.req.first_logits is None}
        return StepResult(tuple(out.sampled), tuple(tokens), tuple(logprobs), errors, out.prompt_logprobs, first,
                          tuple(failed))

    def _apply(self, sched: SchedulerOutput, meta: object, result: StepResult) -> list[Request]:
        """Update the requests of a step that ran (the scheduler's), then the worker side:
        finished requests' rows, the next proposals, KV events."""
        if not result.failed:  # never offload a step's blocks when a failed request's may hold unwritten KV
            self.connector.wait_for_save(meta)
        before = [s.req.num_computed_tokens for s in sched.scheduled]
        updated = self.scheduler.update(sched, result)
        self._release_finished()
        if self.spec is not None and self._helper is None:  # async scheduling: _speculate, between forwards
            if self.runner.last_aux is not None:  # EAGLE-3 reads the target's features of the kept positions
                offsets = [0] + list(itertools.accumulate(s.num_new_tokens for s in sched.scheduled))
                self.spec.proposer.observe([(s.req, b, s.req.num_computed_tokens - b, off) for s, b, off
                                            in zip(sched.scheduled, before, offsets)], self.runner.last_aux)
            self.spec.propose([sched.scheduled[i].req for i in result.sampled])
        self._publish_events()
        return updated

    def _release_finished(self) -> None:
        """The worker side of finished requests: proposer state and input-batch rows (the latter
        once their blocks are freed: a launched step may still write them)."""
        ended, freed = self.scheduler.take_finished()
        if self.spec is not None:
            for rid in ended:
                self.spec.release(rid)
        for rid in freed:
            self.runner.release(rid)

    # -- async scheduling (engine/core/async_pipeline.py) ----------------------------------------
    def _step_async(self) -> list[Request]:
        """Run the planned step while the helper applies the last one and plans the next."""
        start = time.perf_counter()
        updated: list[Request] = []
        if self._planned is None:  # nothing to overlap with: bookkeeping first, here
            if self._ran is not None and self.spec is not None:
                self._speculate(self._ran, None)
            updated, self._planned = self._bookkeep(self._ran)
            self._ran = None
            if self._planned is None:
                if not updated:
                    self._idle()
                return updated
        cur, ran = self._planned, self._ran
        if ran is not None and self.spec is not None:
            cur = self._planned = self._speculate(ran, cur)
        self._fill_placeholders(cur, ran)
        skip = cur.only_finished()  # before the helper starts finishing requests
        pending = self._helper.submit(self._bookkeep, ran)
        out, failed, forward = None, [], None
        if skip:
            out = ModelOutput(torch.empty(0, 0), [], [])
        else:
            self.sampler.prefetch([s.req for s in cur.sched.scheduled if s.samples])
            # Not waited for: the helper reads its time when it applies the step (engine/runner/step_timer.py).
            timer = self.runner.timer()
            try:
                out = self.runner.run(cur.inputs)
            except FORWARD_ERRORS:
                pass  # rerun below through execute_isolating, which finds the request(s) to blame
            forward = ForwardTime(timer.stop(), out is not None, self._propose_seconds())
        more, self._planned = pending.result()
        updated += more
        if out is None:
            out, failed, ran_sched = execute_isolating(self.runner, cur.sched, cur.tables)
            cur = replace(cur, sched=ran_sched)  # without the failed requests; `entries` keeps them all
        self._ran = self._sampled(cur, out, failed, forward)
        self.busy_seconds += time.perf_counter() - start
        return updated

    def _sampled(self, cur: PlannedStep, out: ModelOutput, failed: list[tuple[Request, str]],
                 forward: ForwardTime | None) -> RanStep:
        """The sample stage of an async step: on the device when no entry needs the host
        (engine/sample/device_tokens.py; the host reads the tokens when the helper applies the
        step), else on the host now."""
        tokens = None if failed else sample_on_device(out.logits, [cur.sched.scheduled[i] for i in out.sampled],
                                                      self.sampler)
        if tokens is None:
            result = self._sample(cur.sched, out, failed)
            return RanStep(cur, lambda: result, forward)
        return RanStep(cur, partial(_device_result, out, tokens), forward, tokens)

    def _fill_placeholders(self, cur: PlannedStep, ran: RanStep | None) -> None:
        """The tokens `ran` samples, into `cur`'s inputs: from the device when it left them there."""
        if ran is not None and ran.device is not None and \
                cur.inputs.fill_placeholders_on_device(ran.device.ids, ran.device.rows):
            self.device_filled_steps += 1
            return
        cur.inputs.fill_placeholders(ran.tokens() if ran is not None else {})

    def _bookkeep(self, ran: RanStep | None) -> tuple[list[Request], PlannedStep | None]:
        """Apply `ran` to its requests, then plan the next step."""
        updated: list[Request] = []
        if ran is not None:
            if ran.forward is not None:
                self._timed(ran.planned.sched, ran.forward.timer.seconds(), ran.forward.ok, ran.forward.propose_seconds)
            mark_in_flight(ran.planned.entries, -1)
            updated = self._apply(ran.planned.sched, ran.planned.meta, ran.result)
            self.scheduler.release_applied(ran.planned.entries)
            self._release_finished()
        updated = self._poll_loads() + updated
        sched, tables, meta = self._plan()
        if not sched.scheduled:
            return updated, None
        inputs = self.runner.prepare(sched.plan(), tables)
        step = PlannedStep(sched, tables, meta, inputs, tuple(sched.scheduled))
        mark_in_flight(step.entries, +1)
        return updated, step

    def _speculate(self, ran: RanStep, cur: PlannedStep | None) -> PlannedStep | None:
        """Async scheduling with speculation, on the calling thread between two forwards: the
        proposals that follow what `ran` sampled (not applied yet: the helper applies it during
        the next forward), written into `cur`, which was planned with slots reserved for them
        at the furthest start `ran` could leave its requests at. Requests not in `cur` keep
        theirs in `spec_token_ids` for when they are scheduled."""
        if self.runner.last_aux is not None:  # EAGLE-3: the features of what `ran` kept
            self.spec.proposer.observe(ran.kept_positions(), self.runner.last_aux)
        emitted = ran.emitted()
        self.spec.propose([s.req for s, _ in emitted.values()], [toks for _, toks in emitted.values()])
        entries = ran.corrected(cur.entries) if cur is not None else None
        if entries is None:
            return cur
        mark_in_flight(cur.entries, -1)
        sched = SchedulerOutput(entries)  # its preempted were released when it was prepared
        step = PlannedStep(sched, cur.tables, cur.meta, self.runner.prepare(sched.plan(), cur.tables), tuple(entries))
        mark_in_flight(step.entries, +1)
        return step

    def drain(self) -> list[Request]:
        """Steps until no planned or ran step is left (async scheduling); returns what they updated."""
        updated: list[Request] = []
        while self._ran is not None or self._planned is not None:
            updated += self._step_async()
        return updated

    def _poll_loads(self) -> list[Request]:
        """Hands finished async loads back to the scheduler; returns requests that ended."""
        loaded = self.connector.get_finished().loaded
        ended = self.scheduler.land_loads(loaded, self.connector.get_block_ids_with_load_errors())
        self._release_finished()
        return ended

    def detokenize(self, req: Request) -> str:
        return detokenize(self.tokenizer, req)

    def stats(self) -> EngineStats:
        return EngineStats(
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.pool.usage(),
            num_gpu_blocks=self.pool.num_blocks,
            num_evictions=self.pool.num_evictions,
            num_cached_blocks=self.pool.num_cached_blocks(),
            prompt_tokens=self.scheduler.prompt_tokens,
            generation_tokens=self.scheduler.generation_tokens,
            tiers=self.connector.stats(),
            busy_seconds=self.busy_seconds,
            forward_seconds=self.forward_seconds,
            spec_decode=self.spec.stats.as_dict() if self.spec is not None else None,
            kv_groups=self.kv.group_usage(),
            num_free_blocks=self.pool.num_free_blocks(),
            encoder_cache=self.runner.encoder.stats() if self.runner.encoder is not None else None,
            lora=self._lora_stats() if self.loras is not None else None,
            cpu_thread_changes=self.threads.changes if self.threads is not None else 0,
        )

    def _lora_stats(self) -> dict[str, Any]:
        """vLLM's lora_requests_info: the adapters of running and of waiting requests, and the limit;
        with the requests admitted under each adapter."""
        running = {r.lora.name for r in self.scheduler.running if r.lora is not None}
        waiting = {r.lora.name for r in self.scheduler.requests.values() if r.lora is not None} - running
        return {"max_lora": self.loras.max_loras, "running": sorted(running), "waiting": sorted(waiting),
                "requests": dict(self.loras.requests)}

    def info(self) -> EngineInfo:
        return EngineInfo(self.max_model_len, self.model_config.vocab_size, self.pool.num_blocks,
                          tuple(sorted(self.eos_token_ids)), self.config.block_size)

    def warm_grammars(self) -> None:
        """Structured outputs' compiler built now, not on the first constrained request."""
        self.requests.warm_grammars()

    def prepare_request(self, params: SamplingParams) -> Prepared:
        """A request's slow part (bad words, a grammar), run off the step loop: `make_request(prepared=)`."""
        return self.requests.prepare(params)

    def flush_outputs(self) -> None:
        """Waits until what finished requests' responses name exists (hidden-state files)."""
        self.connector.wait_for_outputs()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        live = {r.request_id for r in self.scheduler.running}
        if len(live) != len(self.scheduler.running):
            raise RuntimeError("a request is running twice")
        if self.kv.num_requests() > len(self.scheduler.requests) + len(self.scheduler.deferred):
            raise RuntimeError("block tables outlive their requests")
        if self.runner.graphs is not None:
            self.runner.graphs.check_integrity()
        for batch in self.runner.batches:
            batch.check_integrity()
            if not batch.request_ids() <= set(self.scheduler.requests) | set(self.scheduler.deferred):
                raise RuntimeError("input-batch rows outlive their requests")


def _device_result(out: ModelOutput, tokens: DeviceTokens) -> StepResult:
    """A step sampled on the device, as host values (waits for the tokens' copy)."""
    host = tokens.host()
    return StepResult(tuple(out.sampled), tuple([t] if t >= 0 else [] for t in host), (None,) * len(host),
                      tokens.failed(host), prompt_logprobs=out.prompt_logprobs)
