"""The engine-core process: owns an `LLM`'s `EngineCore` and steps it, talking to the API
process over two ZMQ PUSH/PULL sockets.

Messages: `server.channel` (typed dataclasses, msgpack lists on the wire).

The core never decodes text (the API process detokenizes) except to check stop strings,
which the engine does itself.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq

from engine.core.request import FINISH_REASONS, Request
from engine.core.request_factory import Prepared, needs_preparation
from engine.lora.adapter import LoRARequest
from engine.lora.registry import AdapterRef
from engine.sampling_params import SamplingParams
from server import channel as ch
from server.media_wire import from_wire
from server.core_prep import PrepQueue
from server.logs import LogSettings
from server.process_exit import exit_now

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.core.engine_core import EngineCore

log = logging.getLogger(__name__)

IDLE_POLL_MS = 100  # how long an idle core blocks on its socket before checking its parent
PREP_POLL_MS = 5  # how long it blocks while requests are being prepared and none runs
HEARTBEAT_INTERVAL_S = 0.25


def params_to_wire(p: SamplingParams) -> dict[str, Any]:
    wire = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "return_first_logits"}
    if p.structured_outputs is not None:
        wire["structured_outputs"] = p.structured_outputs.to_wire()
    return wire


def _phases(r: Request) -> dict[str, float | None]:
    """A finished request's time in the queue (arrival to first scheduled) and in prefill (first
    scheduled to first token), as durations: the API process's clock is not this one."""
    sched, first = r.first_scheduled_time, r.first_token_time
    return {"queue_s": None if sched is None else sched - r.arrival_time,
            "prefill_s": None if sched is None or first is None else first - sched}


def stats_snapshot(llm: LLM) -> dict[str, Any]:
    s = llm.get_stats()
    return {**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)}, "bubble_fraction": s.bubble_fraction}


class CoreLoop:
    """Steps the engine and streams per-request deltas. Bookkeeping only; `run_core` owns the sockets."""

    def __init__(self, llm: LLM, push: zmq.Socket, prep: PrepQueue) -> None:
        self.llm, self.engine, self.push, self.prep = llm, llm.engine, push, prep
        self.sent: dict[str, int] = {}  # request id -> output tokens already sent
        self.draining_until: float | None = None

    def handle(self, msg: ch.ToCore) -> bool:
        """Applies one message; False when the core should stop taking new work."""
        if isinstance(msg, ch.AddRequest):
            try:
                params = SamplingParams(**msg.params)
                if needs_preparation(params):  # slow work: off the step loop, then `admit_prepared`
                    refused = self.prep.submit(msg.request_id, msg, params)
                    if refused is not None:
                        self.push.send(ch.encode(ch.AddError(msg.request_id, refused)))
                    return True
                self._add(msg, params, None)
            except (ValueError, TypeError) as e:
                self.push.send(ch.encode(ch.AddError(msg.request_id, str(e))))
        elif isinstance(msg, ch.Abort):
            for rid in msg.request_ids:
                self.sent.pop(rid, None)  # the API side has stopped listening
                if self.prep.abort(rid) or self.engine.abort_request(rid):
                    log.info("request %s aborted", rid)
        elif isinstance(msg, ch.StatsQuery):
            self.push.send(self._stats_reply(msg.nonce))
        elif isinstance(msg, ch.LoRAUpdate):
            self.push.send(ch.encode(self._lora_update(msg)))
        elif isinstance(msg, ch.Shutdown):
            self.draining_until = time.monotonic() + float(msg.grace_s)
            log.info("shutdown: draining %d request(s) for up to %.1fs", len(self.sent), float(msg.grace_s))
        return True

    def _stats_reply(self, nonce: int) -> bytes:
        """The encoded snapshot, or an error reply naming why there is none. Stats come from
        connector and tier plugins too; one that raises or reports a value the channel cannot carry
        (a numpy float) fails this query with a log line, not the core and every request in it."""
        try:
            return ch.encode(ch.StatsReply(nonce, stats_snapshot(self.llm)))
        except Exception as e:  # noqa: BLE001 -- plugin code: any failure here is this query's alone
            log.exception("stats snapshot not sent")
            return ch.encode(ch.StatsReply(nonce, {}, error=f"{type(e).__name__}: {e}"))

    def _add(self, a: ch.AddRequest, params: SamplingParams, prepared: Prepared | None) -> None:
        req = self.engine.make_request(a.request_id, a.prompt_token_ids, params, priority=a.priority,
                                       cache_salt=a.cache_salt, session=a.session,
                                       kv_transfer_params=a.kv_transfer_params, prepared=prepared,
                                       mm=from_wire(a.media) if a.media else None, lora=self._lora(a.lora))
        self.engine.add_request(req)
        self.sent[req.request_id] = 0

    def _lora(self, name: str | None) -> AdapterRef | None:
        if name is None:
            return None
        ref = self.engine.loras.get(name) if self.engine.loras is not None else None
        if ref is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        return ref

    def _lora_update(self, u: ch.LoRAUpdate) -> ch.LoRAReply:
        """vLLM's semantics: loading a loaded name is refused unless `load_inplace`; unloading an
        unknown one is `unknown` (a 404). Every served adapter keeps its slot, so a load past
        --max-loras is refused rather than evicting one that requests name."""
        loras = self.engine.loras
        if loras is None:
            return ch.LoRAReply(u.nonce, "LoRA adapters need --enable-lora")
        known = loras.get(u.name) is not None
        try:
            if u.path is None:
                if not known:
                    return ch.LoRAReply(u.nonce, f"The lora adapter '{u.name}' cannot be found.", unknown=True)
                self.engine.remove_lora(u.name)
                log.info("LoRA adapter %r unloaded", u.name)
            elif known and not u.load_inplace:
                return ch.LoRAReply(u.nonce, f"The lora adapter '{u.name}' has already been loaded. "
                                             "Pass load_inplace to re-read it.")
            elif not known and len(loras.adapters()) >= loras.max_loras:
                return ch.LoRAReply(u.nonce, f"--max-loras {loras.max_loras} adapters are loaded "
                                             f"({', '.join(sorted(loras.adapters()))}); unload one first, or "
                                             "raise --max-loras")
            else:
                self.engine.add_lora(LoRARequest(u.name, 1, u.path))
        except ValueError as e:
            return ch.LoRAReply(u.nonce, str(e))
        return ch.LoRAReply(u.nonce)

    def admit_prepared(self) -> None:
        """Schedules the requests whose preparation ended; refuses those it failed or timed out."""
        for a, params, result in self.prep.ready():
            rid = a.request_id
            try:
                if isinstance(result, str):
                    raise ValueError(result)
                self._add(a, params, result)
            except (ValueError, TypeError) as e:
                self.push.send(ch.encode(ch.AddError(rid, str(e))))
                continue
            self.push.send(ch.encode(ch.Accepted(rid)))

    def step(self) -> None:
        updated = self.engine.step()
        if not updated:
            return
        deltas = [self._delta(r) for r in updated if r.request_id in self.sent]
        if any(d.kv_transfer_params for d in deltas):
            self.engine.flush_outputs()  # the file a response names exists when it is sent
        self.push.send(ch.encode(ch.Outputs(deltas)))

    def _delta(self, r: Request) -> ch.Delta:
        start = self.sent[r.request_id]
        tokens = r.output_token_ids[start:]
        logprobs = r.logprobs[start:] if r.logprobs is not None else None
        prompt = r.prompt_logprobs if start == 0 else None  # complete once a token was sampled
        self.sent[r.request_id] = len(r.output_token_ids)
        if not r.status.finished:
            return ch.Delta(r.request_id, tokens, logprobs, prompt)
        del self.sent[r.request_id]
        thinking = r.thinking
        return ch.Delta(r.request_id, tokens, logprobs, prompt, finish_reason=FINISH_REASONS.get(r.status),
                        stop_reason=r.stop_reason, error=r.error, num_cached_tokens=max(r.num_cached_tokens, 0),
                        cached_by_tier=dict(r.cached_by_tier), kv_transfer_params=r.kv_transfer_params,
                        thinking_tokens=None if thinking is None else thinking.thinking_tokens,
                        thinking_forced_tokens=None if thinking is None else thinking.forced_tokens, **_phases(r))

    def abort_all(self) -> None:
        ids = list(self.sent)
        for rid in ids:
            self.engine.abort_request(rid)
        while self.engine.has_unfinished():  # aborted loads end once their copy lands
            self.step()
        if ids:
            log.warning("shutdown: aborted %d request(s) still running after the grace period", len(ids))
            self.push.send(ch.encode(ch.Outputs([ch.Delta(rid, [], finish_reason="abort")
                                                 for rid in ids if rid in self.sent])))
            self.sent.clear()


def _warm_grammars(engine: EngineCore) -> None:
    """Structured outputs' compiler built before serving (xgrammar's import, once torch and
    transformers are in, and the tokenizer's tables: 0.3 s and 0.23 s for the demo model on a
    2-core AMD EPYC). Built by the first constrained request instead, both held the GIL in
    stretches of up to a third of a second beside the step loop. Not on a thread beside the model
    load: xgrammar's import of transformers raced the loader's and failed."""
    start = time.perf_counter()
    try:
        engine.warm_grammars()
    except (ImportError, RuntimeError, ValueError, TypeError) as e:  # the first constrained request will fail, saying so
        log.warning("structured outputs: xgrammar's compiler could not be built for this tokenizer: %s: %s",
                    type(e).__name__, e)
        return
    log.info("structured outputs: xgrammar's compiler built in %.2f s", time.perf_counter() - start)


def run_core(llm_kwargs: dict[str, Any], to_core: str, from_core: str, logs: LogSettings,
             prep_timeout_s: float) -> int:
    """Entry point of the engine-core process (spawned by the API process). `prep_timeout_s`:
    how long a request's preparation (a grammar's compile) may take (server/core_prep.py)."""
    logs.configure("core")
    # The API process decides when to stop: it catches SIGINT/SIGTERM and sends "shutdown".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(to_core)
    push.connect(from_core)
    push.setsockopt(zmq.LINGER, 5000)
    try:
        from engine import LLM

        llm = LLM(**llm_kwargs)
        _warm_grammars(llm.engine)
    except (ValueError, FileNotFoundError, OSError) as e:
        push.send(ch.encode(ch.StartupError(f"{type(e).__name__}: {e}")))
        push.close(linger=5000)
        pull.close(linger=0)  # term() waits for every socket
        ctx.term()
        return 2
    eng = llm.engine
    push.send(ch.encode(ch.Ready(eng.info())))
    prep = PrepQueue(eng.prepare_request, prep_timeout_s)
    loop = CoreLoop(llm, push, prep)
    beat = Heartbeat(ctx, from_core)
    status = 1
    try:
        while True:
            beat.tick()
            busy = eng.has_unfinished()
            if pull.poll(0 if busy else PREP_POLL_MS if len(prep) else IDLE_POLL_MS):
                while True:
                    try:
                        loop.handle(ch.decode_to_core(pull.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
            if len(prep):
                loop.admit_prepared()
            if loop.draining_until is not None and (not eng.has_unfinished() or time.monotonic() > loop.draining_until):
                loop.abort_all()
                status = 0
                break
            if eng.has_unfinished():
                loop.step()
            else:
                eng.publish_pending_events()
                eng.check_health()  # a tensor-parallel rank that exited fails the core now, not at the next request
            if not eng.has_unfinished() and os.getppid() != parent:  # the API process died without telling us
                log.error("API process is gone; exiting")
                status = 0
                break
    except Exception as e:  # noqa: BLE001 - an error no request could be blamed for: report it, then die
        log.exception("engine core failed")
        push.send(ch.encode(ch.Fatal(f"{type(e).__name__}: {e}")))
    finally:
        beat.stop()
        prep.close()
        llm.close()  # flushes pending G3 writes
        if status == 0:
            log.info("engine core stopped")
            push.send(ch.encode(ch.Stopped()))
        push.close()
        pull.close(linger=0)
        ctx.term()
    return status


class Heartbeat:
    """A thread that tells the API process every HEARTBEAT_INTERVAL_S that this process lives and
    how long ago the step loop last went round. ZMQ sockets are not thread-safe, so it sends on
    a socket of its own (the API's PULL socket fair-queues both)."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.last_tick = time.monotonic()
        self._stop = threading.Event()
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, name="kvtier-heartbeat", daemon=True)
        self._thread.start()

    def tick(self) -> None:
        self.last_tick = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self._sock.send(ch.encode(ch.Heartbeat(time.monotonic() - self.last_tick)), zmq.NOBLOCK)
            except zmq.Again:  # the API side is not reading: it will notice the silence itself
                continue

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()


def core_main(llm_kwargs: dict[str, Any], to_core: str, from_core: str, logs: LogSettings,
              prep_timeout_s: float, cpus: tuple[int, ...] = ()) -> None:
    """multiprocessing target: the exit code tells the API process how the core ended. `cpus`:
    the CPUs this core runs on (a data-parallel core's share; empty: the parent's)."""
    if cpus:  # before torch starts its threads: they and any tensor-parallel ranks inherit the mask
        os.sched_setaffinity(0, cpus)
    # run_core has closed the engine (G3 writes flushed) and its sockets by the time it returns.
    exit_now(run_core(llm_kwargs, to_core, from_core, logs, prep_timeout_s))
