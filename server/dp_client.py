"""`kvtier serve --data-parallel-size N`: N engine cores behind one API process.

Each core is an `EngineClient` of its own (its own process, bound to its share of the CPUs, each
possibly tensor-parallel inside). `DataParallelClient` has the same surface, so the API does not
know how many there are. A request goes to the core whose G1 most likely holds its prefix
(`PrefixRouter`: the core that last got a prompt with the same leading blocks), else to the least
loaded one. The router only guesses from what it sent where; a wrong guess costs a prefill, never
a wrong answer, since every core computes every request in full.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from engine.core.stats import EngineInfo
from engine.sampling_params import SamplingParams
from server import channel as ch
from server.client import CoreState, EngineClient, EngineDeadError, StartupError

log = logging.getLogger(__name__)

ROUTER_BLOCKS = 1 << 18  # block hashes remembered (LRU): ~40 MB of Python objects at most


class PrefixRouter:
    """Which core got each chain of leading blocks last. Owns only that map."""

    def __init__(self, num_cores: int, block_size: int, capacity: int = ROUTER_BLOCKS) -> None:
        if num_cores < 1 or block_size < 1 or capacity < 1:
            raise ValueError(f"bad router: {num_cores} cores, block size {block_size}, capacity {capacity}")
        self.num_cores, self.block_size, self.capacity = num_cores, block_size, capacity
        self._owner: OrderedDict[int, int] = OrderedDict()  # chained block hash -> core
        self._turn = 0  # ties in load go round the cores, so one request at a time still spreads

    def _chain(self, prompt: Sequence[int], salt: str | None) -> list[int]:
        """One hash per full block, each covering every block before it (and the salt)."""
        h, out, b = hash(("kvtier-dp", salt)), [], self.block_size
        for start in range(0, len(prompt) - b + 1, b):
            h = hash((h, tuple(prompt[start:start + b])))
            out.append(h)
        return out

    def route(self, prompt: Sequence[int], salt: str | None, loads: Sequence[int]) -> int:
        """The core for a prompt: the one that got its longest known prefix, else the least loaded
        (`loads[i]`: core i's requests in flight; ties go round the cores); the prompt's blocks are
        then recorded there."""
        chain = self._chain(prompt, salt)
        core = next((self._owner[h] for h in reversed(chain) if h in self._owner), None)
        if core is None:
            n = self.num_cores
            core = min(range(n), key=lambda i: (loads[i], (i - self._turn) % n))
            self._turn = (core + 1) % n
        for h in chain:
            self._owner[h] = core
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        return core

    def check_integrity(self) -> None:
        if len(self._owner) > self.capacity or any(not 0 <= c < self.num_cores for c in self._owner.values()):
            raise RuntimeError("router map over capacity or naming a core that does not exist")


def merge_stats(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's view of several: counts summed, fractions averaged, per-core snapshots kept."""
    def merge(values: list[Any], key: str) -> Any:
        first = values[0]
        if isinstance(first, bool) or first is None or isinstance(first, str):
            return first
        if isinstance(first, (int, float)):
            total = sum(values)
            return total / len(values) if ("usage" in key or "fraction" in key or "rate" in key) else total
        if isinstance(first, dict) and all(isinstance(v, dict) for v in values):
            return {k: merge([v[k] for v in values if k in v], k) for k in first}
        return first  # lists (per KV group): the first core's; the per-core snapshots have all
    out = merge(snaps, "")
    out["data_parallel"] = snaps
    return out


class DataParallelClient:
    """`EngineClient`'s surface over several cores (see the module docstring)."""

    def __init__(self, clients: list[EngineClient]) -> None:
        if len(clients) < 2:
            raise ValueError("a data-parallel client needs at least two cores")
        self.clients = clients
        self.router: PrefixRouter | None = None
        self.dead = asyncio.Event()  # set when any core dies: the server then fails as one
        self._watch: asyncio.Task[None] | None = None

    @property
    def info(self) -> EngineInfo:
        return self.clients[0].info

    @property
    def state(self) -> CoreState:
        states = [c.state for c in self.clients]
        for s in (CoreState.DEAD, CoreState.STARTING, CoreState.DRAINING):
            if s in states:
                return s
        return CoreState.STOPPED if all(s is CoreState.STOPPED for s in states) else CoreState.READY

    @property
    def died(self) -> bool:
        return any(c.died for c in self.clients)

    @property
    def death(self) -> str | None:
        return next((f"data-parallel core {i}: {c.death}" for i, c in enumerate(self.clients) if c.death), None)

    @property
    def num_pending(self) -> int:
        return sum(c.num_pending for c in self.clients)

    async def start(self, timeout_s: float = 600.0) -> EngineInfo:
        """Starts every core at once; if one fails, stops the others and raises its error."""
        results = await asyncio.gather(*(c.start(timeout_s) for c in self.clients), return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(c.shutdown(0) for c in self.clients), return_exceptions=True)
            i, err = failed[0]
            if isinstance(err, StartupError):
                raise StartupError(f"data-parallel core {i}: {err}") from None
            raise err
        self.router = PrefixRouter(len(self.clients), self.info.block_size)
        self._watch = asyncio.create_task(self._watch_cores())
        log.info("data parallelism: %d engine cores (CPUs %s)", len(self.clients),
                 " | ".join(",".join(map(str, c.cpus)) or "all" for c in self.clients))
        return self.info

    async def _watch_cores(self) -> None:
        """One core dying fails the server, as one engine's death does: its requests are lost,
        and the others' must not be left to a server that will exit."""
        await asyncio.wait([asyncio.create_task(c.dead.wait()) for c in self.clients],
                           return_when=asyncio.FIRST_COMPLETED)
        log.error("%s; stopping the other data-parallel cores", self.death)
        for c in self.clients:
            if not c.died:
                c.fail(f"data-parallel core stopped: {self.death}")
        self.dead.set()

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                  cache_salt: str | None = None, **kw: Any) -> asyncio.Queue[ch.Delta | BaseException]:
        if self.router is None:
            raise EngineDeadError("the engine cores have not started")
        if any(c.has_request(request_id) for c in self.clients):
            raise ValueError(f"request id {request_id!r} is already in flight")
        core = self.router.route(prompt_token_ids, cache_salt, [c.num_pending for c in self.clients])
        return await self.clients[core].add(request_id, prompt_token_ids, params, cache_salt=cache_salt, **kw)

    async def accepted(self, request_ids: list[str]) -> None:
        for c in self.clients:  # each waits only for its own (unknown ids are skipped)
            await c.accepted([r for r in request_ids if c.has_request(r)])

    async def abort(self, request_ids: list[str]) -> None:
        for c in self.clients:
            await c.abort([r for r in request_ids if c.has_request(r)])

    async def abort_all(self) -> int:
        return sum([await c.abort_all() for c in self.clients])

    async def stats(self, timeout_s: float = 5.0) -> dict[str, Any]:
        return merge_stats(list(await asyncio.gather(*(c.stats(timeout_s) for c in self.clients))))

    async def update_lora(self, name: str, path: str | None, load_inplace: bool = False) -> ch.LoRAReply:
        """On every core in turn; a load one core refuses is undone on those before it."""
        for i, c in enumerate(self.clients):
            reply = await c.update_lora(name, path, load_inplace)
            if reply.error is not None:
                if path is not None and not load_inplace:
                    for done in self.clients[:i]:
                        await done.update_lora(name, None)
                return ch.LoRAReply(reply.nonce, f"data-parallel core {i}: {reply.error}", reply.unknown)
        return reply

    async def shutdown(self, grace_s: float) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(c.shutdown(grace_s) for c in self.clients))
