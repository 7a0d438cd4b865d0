"""The API process's handle on the engine-core process: spawns it, sends requests and aborts,
and routes its per-request deltas to asyncio queues. Nothing here waits on the model: every
call is a socket send or a queue read."""
from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import multiprocessing as mp
import shutil
import tempfile
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from engine.sampling_params import SamplingParams
from engine.core.stats import EngineInfo
from server import channel as ch
from server.core import core_main, params_to_wire
from server.limits import RequestLimits
from server.logs import LogSettings

log = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.25
DEFAULT_HEARTBEAT_TIMEOUT_S = 120.0  # longer than any one step should take (a 2k-token chunk of a 7B model on CPU)


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; requests fail fast instead of hanging."""


class StatsError(RuntimeError):
    """The engine core is up but could not send its stats (a value its message cannot carry)."""


class StartupError(RuntimeError):
    """The engine core rejected its configuration or died while loading."""


class CoreState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"
    STOPPED = "stopped"


class EngineClient:
    def __init__(self, llm_kwargs: dict[str, Any], logs: LogSettings = LogSettings(),
                 heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
                 prep_timeout_s: float = RequestLimits.compile_timeout_s, cpus: tuple[int, ...] = ()) -> None:
        """`cpus`: the CPUs the core process is bound to (empty: this process's)."""
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat timeout must be > 0 seconds; got {heartbeat_timeout_s}")
        self.llm_kwargs, self.logs, self.heartbeat_timeout_s = llm_kwargs, logs, heartbeat_timeout_s
        self.prep_timeout_s = prep_timeout_s  # a request's preparation in the core (server/core_prep.py)
        self.cpus = cpus
        self.state = CoreState.STARTING
        self.died = False  # the core ended without being asked to (or hung): serve exits 1
        self.death: str | None = None  # why the core died: /health says it
        self.dead = asyncio.Event()  # set with `died`
        self._last_beat = 0.0  # loop time of the last heartbeat
        self._loop_age = 0.0  # seconds since the core's step loop last went round, as it last said
        self.info: EngineInfo | None = None
        self._queues: dict[str, asyncio.Queue[ch.Delta | BaseException]] = {}
        self._acks: dict[str, asyncio.Future[None]] = {}  # requests whose preparation the API waits for
        self._replies: dict[int, asyncio.Future[Any]] = {}  # nonce -> a StatsQuery's or LoRAUpdate's answer
        self._nonce = itertools.count()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._ipc_dir = Path(tempfile.mkdtemp(prefix="kvtier-ipc-"))  # sockets live here, not on ports
        self._ctx = zmq.asyncio.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._to_core.setsockopt(zmq.LINGER, 0)
        # No high-water mark: a send then only fails when no core is connected, and _send never blocks.
        self._to_core.setsockopt(zmq.SNDHWM, 0)
        self._to_core.bind(f"ipc://{self._ipc_dir}/to_core")
        self._from_core.bind(f"ipc://{self._ipc_dir}/from_core")
        self.proc: mp.process.BaseProcess | None = None

    @property
    def num_pending(self) -> int:
        return len(self._queues)

    async def start(self, timeout_s: float = 600.0) -> EngineInfo:
        """Spawns the core and waits for it to load the model. Raises StartupError."""
        ctx = mp.get_context("spawn")  # never fork a process that may hold torch threads
        self.proc = ctx.Process(target=core_main, name="kvtier-engine-core", daemon=True,
                                args=(self.llm_kwargs, f"ipc://{self._ipc_dir}/to_core",
                                      f"ipc://{self._ipc_dir}/from_core", self.logs, self.prep_timeout_s,
                                      self.cpus))
        self.proc.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if await self._from_core.poll(200):
                msg = ch.decode_from_core(await self._from_core.recv())
                if isinstance(msg, ch.Ready):
                    self.info = msg.info
                    break
                if isinstance(msg, ch.StartupError):
                    await loop.run_in_executor(None, self.proc.join, 10)
                    if self.proc.is_alive():
                        self.proc.kill()
                    raise StartupError(msg.message)
            if not self.proc.is_alive():
                raise StartupError(f"engine core exited with code {self.proc.exitcode} while loading")
            if loop.time() > deadline:
                self.proc.kill()
                raise StartupError(f"engine core did not load within {timeout_s:.0f}s")
        self.state = CoreState.READY
        self._last_beat = loop.time()
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._watchdog())]
        return self.info

    # -- requests ------------------------------------------------------------------------
    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                  priority: int = 0, cache_salt: str | None = None, session: str | None = None,
                  kv_transfer_params: dict[str, Any] | None = None,
                  ack: bool = False, media: list[ch.MediaItem] | None = None,
                  lora: str | None = None) -> asyncio.Queue[ch.Delta | BaseException]:
        """Queues a request; its deltas (`server.channel.Delta`) arrive on the returned queue,
        the last one with a finish_reason, or an exception if the core dies. `ack`: the core
        prepares it first (engine.core.request_factory.needs_preparation); `accepted` waits for that."""
        self._check_alive()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in flight")
        try:  # packed before the queue exists: a value msgpack cannot carry must not leak a pending slot
            msg = ch.encode(ch.AddRequest(request_id, prompt_token_ids, params_to_wire(params), priority, cache_salt,
                                          session, kv_transfer_params, media, lora))
        except (OverflowError, UnicodeEncodeError, TypeError, ValueError) as e:
            raise ValueError(f"request {request_id!r} cannot be sent to the engine: {e}") from None
        self._send(msg)
        q: asyncio.Queue[ch.Delta | BaseException] = asyncio.Queue()
        self._queues[request_id] = q
        if ack:
            self._acks[request_id] = asyncio.get_running_loop().create_future()
        return q

    async def accepted(self, request_ids: list[str]) -> None:
        """Until the core has prepared and scheduled each of these requests (added with `ack`).
        Raises ValueError with the core's reason when it refused one, EngineDeadError if it died."""
        try:
            for rid in request_ids:
                fut = self._acks.get(rid)
                if fut is not None:
                    await fut
        finally:
            for rid in request_ids:
                self._acks.pop(rid, None)

    def _send(self, msg: bytes) -> None:
        """Never blocks: with no high-water mark, the only refusal is a core that is not there."""
        sent = self._to_core.send(msg, zmq.NOBLOCK)  # zmq.asyncio: a finished future, never a wait
        err = sent.exception() if sent.done() else None
        if isinstance(err, zmq.Again):
            raise EngineDeadError("the engine core is not connected")
        if err is not None:
            raise err

    async def abort(self, request_ids: list[str]) -> None:
        for r in request_ids:
            if (fut := self._acks.pop(r, None)) is not None:
                fut.cancel()
        live = [r for r in request_ids if self._queues.pop(r, None) is not None]
        if live and self.state in (CoreState.READY, CoreState.DRAINING):
            self._send_quietly(ch.encode(ch.Abort(live)))

    async def abort_all(self) -> int:
        """Ends every request in flight now (the shutdown grace period is over): each gets a last
        delta with finish_reason "abort", so its response still ends properly, and the core stops it."""
        ids = list(self._queues)
        for rid in ids:
            self._queues.pop(rid).put_nowait(ch.Delta(rid, [], finish_reason="abort"))
        if ids and self.state in (CoreState.READY, CoreState.DRAINING):
            self._send_quietly(ch.encode(ch.Abort(ids)))
        return len(ids)

    def _send_quietly(self, msg: bytes) -> None:
        """For aborts: a core that is gone has nothing left to abort."""
        try:
            self._send(msg)
        except EngineDeadError:
            log.debug("abort not sent: the engine core is not connected")

    async def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        return await self._ask(lambda nonce: ch.StatsQuery(nonce), timeout_s)

    async def update_lora(self, name: str, path: str | None, load_inplace: bool = False,
                          timeout_s: float = 120.0) -> ch.LoRAReply:
        """Loads adapter `name` from `path`, or with no path unloads it (server/channel.py LoRAUpdate)."""
        return await self._ask(lambda nonce: ch.LoRAUpdate(nonce, name, path, load_inplace), timeout_s)

    async def _ask(self, make: Any, timeout_s: float) -> Any:
        """Sends `make(nonce)` and waits for the reply carrying that nonce."""
        self._check_alive()
        nonce = next(self._nonce)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[nonce] = fut
        try:
            self._send(ch.encode(make(nonce)))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._replies.pop(nonce, None)

    def _check_alive(self) -> None:
        if self.state is not CoreState.READY:
            raise EngineDeadError(f"engine core is {self.state.value}")

    # -- background tasks ------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            msg = ch.decode_from_core(await self._from_core.recv())
            if isinstance(msg, ch.Outputs):
                for d in msg.deltas:
                    q = self._queues.get(d.id)
                    if q is None:
                        continue  # aborted here already
                    if d.finished:
                        del self._queues[d.id]
                    q.put_nowait(d)
            elif isinstance(msg, (ch.StatsReply, ch.LoRAReply)):
                fut = self._replies.get(msg.nonce)
                if fut is not None and not fut.done():
                    if isinstance(msg, ch.LoRAReply):
                        fut.set_result(msg)
                    elif msg.error is not None:
                        fut.set_exception(StatsError(msg.error))
                    else:
                        fut.set_result(msg.stats)
            elif isinstance(msg, ch.AddError):
                q = self._queues.pop(msg.request_id, None)
                if q is not None:
                    q.put_nowait(ValueError(msg.message))
                self._settle(msg.request_id, ValueError(msg.message))
            elif isinstance(msg, ch.Accepted):
                self._settle(msg.request_id, None)
            elif isinstance(msg, ch.Heartbeat):
                self._last_beat, self._loop_age = asyncio.get_running_loop().time(), float(msg.loop_age_s)
            elif isinstance(msg, ch.Fatal):
                self._die(f"engine core failed: {msg.message}")
            elif isinstance(msg, ch.Stopped):
                if self.state is not CoreState.DRAINING:  # nobody asked it to stop
                    self._die("engine core stopped unasked")
                self._stopped.set()
                return

    async def _watchdog(self) -> None:
        """Every WATCHDOG_INTERVAL_S: is the process alive, and does it still beat and step?"""
        assert self.proc is not None
        loop = asyncio.get_running_loop()
        while self.proc.is_alive() and self.state in (CoreState.READY, CoreState.DRAINING):
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            silent = loop.time() - self._last_beat
            stuck = max(silent, self._loop_age)
            if stuck > self.heartbeat_timeout_s and self.state is CoreState.READY:
                what = "sent no heartbeat" if silent > self.heartbeat_timeout_s else "has not finished a step"
                self._die(f"engine core {what} for {stuck:.1f}s (heartbeat timeout {self.heartbeat_timeout_s:g}s); "
                          "killing it")
                self.proc.kill()
                return
        if not self.proc.is_alive() and self.state in (CoreState.READY, CoreState.DRAINING) \
                and not self._stopped.is_set():  # while draining too: a crash then is still a death
            self._die(f"engine core died (exit code {self.proc.exitcode})")
        if self.state is CoreState.DEAD:
            return
        self._fail_all(EngineDeadError(f"engine core exited with code {self.proc.exitcode}"))

    def _die(self, why: str) -> None:
        """The core is gone for good: fail everything in flight; /health says so from now on."""
        if self.state is CoreState.DEAD:
            return
        log.error("%s; failing %d request(s); /health now reports unhealthy", why, len(self._queues))
        self.state = CoreState.DEAD
        self.died, self.death = True, why
        self._fail_all(EngineDeadError(why))
        self.dead.set()

    def fail(self, why: str) -> None:
        """Ends this core from outside (a data-parallel sibling died): fails what is in flight, kills it."""
        self._die(why)
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()

    def has_request(self, request_id: str) -> bool:
        """Whether this core has the request in flight (a data-parallel client asks each)."""
        return request_id in self._queues or request_id in self._acks

    def _settle(self, request_id: str | None, err: BaseException | None) -> None:
        fut = self._acks.get(request_id) if request_id is not None else None
        if fut is None or fut.done():
            return
        if err is None:
            fut.set_result(None)
        else:
            fut.set_exception(err)

    def _fail_all(self, err: BaseException) -> None:
        for q in self._queues.values():
            q.put_nowait(err)
        self._queues.clear()
        for rid in list(self._acks):
            self._settle(rid, err)
        for fut in self._replies.values():
            if not fut.done():
                fut.set_exception(err)

    # -- shutdown --------------------------------------------------------------------------
    async def shutdown(self, grace_s: float) -> None:
        """Lets running requests finish for up to grace_s, aborts the rest, and waits for the
        core to flush its offload writes and exit."""
        if self.proc is not None and self.proc.is_alive() and self.state is CoreState.READY:
            self.state = CoreState.DRAINING
            self._send_quietly(ch.encode(ch.Shutdown(grace_s)))
            try:
                await asyncio.wait_for(self._stopped.wait(), grace_s + 120)
            except asyncio.TimeoutError:
                log.error("engine core did not stop in time; killing it")
            await asyncio.get_running_loop().run_in_executor(None, self.proc.join, 30)
            if self.proc.is_alive():
                self.proc.kill()
        elif self.proc is not None and self.proc.is_alive():  # still starting (or dead to us): nothing to drain
            self.proc.kill()
            await asyncio.get_running_loop().run_in_executor(None, self.proc.join, 10)
        self.state = CoreState.STOPPED
        for t in self._tasks:
            t.cancel()
        self._fail_all(EngineDeadError("server is shutting down"))
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
