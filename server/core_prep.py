"""The engine core's preparation queue: requests whose building is slow are built off the step loop.

A request with bad words or a structured-output constraint has work whose cost its client
controls (`RequestFactory.prepare`: tokenizing the words, compiling the grammar; a large
constraint compiles for seconds). Done in the step loop, it stalled every other request for that
long (issue 38). Here it runs on one daemon thread, the step loop keeps stepping the others, and
the request joins the scheduler once its preparation is done (`ready`). The thread keeps normal
priority: at nice 10 (as it was) it held the GIL, or a lock of the process's memory map, while
the busy machine's scheduler left it off the CPU, and the step loop waited on it (a probe's
latency 1.4-1.9 s beside a 2,000-tool compile with two busy processes on the 2 cores; 0.28-0.39 s
at normal priority). A thread whose preparation ran out of budget is niced to 19 and leaves the
pool when its compile ends: its work is for nobody, and at normal priority a few such compiles
took the cores from the step loop (a probe at 0.82 s against 0.13 s idle in CI). Compiled grammars are cached
by content (engine/sample/structured.py), so n sequences of one request compile once.

A preparation that takes longer than `timeout_s` is refused (its client gets a 400), and every
later request with the same constraint is refused at once: it would take as long again. A thread
cannot stop a compile it started: it finishes it in the background while a spare thread (at most
PREP_SPARES at once; one frees its place when its overrun compile ends) takes over the queue, so
the requests behind a slow compile wait at most one budget. With the default limits (server/limits.py) no constraint compiles for
anywhere near that long; raising them is what makes this path matter.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from engine.core.request_factory import Prepared
from engine.sampling_params import SamplingParams
from kvstore.threads import DaemonPool, lower_priority, one_torch_thread
from server.channel import AddRequest

log = logging.getLogger(__name__)

OVERRUN_NICE = 19  # a thread whose preparation ran out of budget (it then leaves the pool)
PREP_SPARES = 3  # threads that may stand in, at once, for ones stuck in an overlong compile
QUEUE_BUDGETS = 3  # a request waiting this many budgets for a preparation thread is refused
SLOW_KEYS = 4096  # constraints remembered as too slow to compile (LRU)


@dataclass
class _Pending:
    add: AddRequest  # the message that asked for it
    params: SamplingParams
    queued: float
    started: float | None = None  # set by the preparation thread when it takes the request
    thread: threading.Thread | None = None  # the preparation thread running it
    future: Future[Prepared] | None = None


# (the Add message's request, its params, what preparing it gave: Prepared, or why it is refused)
Outcome = tuple[AddRequest, SamplingParams, Prepared | str]


class PrepQueue:
    """Requests being prepared, by request id. Owned by the core loop's thread."""

    def __init__(self, prepare: Callable[[SamplingParams], Prepared], timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the preparation timeout must be > 0 seconds; got {timeout_s}")
        self.timeout_s = timeout_s
        self._prepare = prepare
        self._pool = DaemonPool(1, "kvtier-prep", initializer=one_torch_thread, spares=PREP_SPARES)
        self._pending: dict[str, _Pending] = {}
        self._slow: OrderedDict[tuple[str, str], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, request_id: str, add: AddRequest, params: SamplingParams) -> str | None:
        """Queues the request's preparation; or why it is refused at once (its constraint timed
        out before). The server sends a JSON schema as its canonical text (server/limits.py), so
        its key costs nothing here; a tree would be sorted and encoded on the step loop."""
        if request_id in self._pending:
            return f"request id {request_id!r} is already being prepared"
        so = params.structured_outputs
        if so is not None and so.key() in self._slow:
            return self._too_slow(so.kind())
        p = _Pending(add, params, time.monotonic())
        p.future = self._pool.submit(self._run, p)
        self._pending[request_id] = p
        return None

    def _run(self, p: _Pending) -> Prepared:
        p.thread = threading.current_thread()
        p.started = time.monotonic()  # the budget is the preparation's own, not its wait in the queue
        return self._prepare(p.params)

    def abort(self, request_id: str) -> bool:
        p = self._pending.pop(request_id, None)
        if p is not None and p.future is not None:
            p.future.cancel()  # if it has not started yet
        return p is not None

    def ready(self) -> list[Outcome]:
        """Requests whose preparation ended (Prepared, or the ValueError's text) or ran out of time."""
        out: list[Outcome] = []
        now = time.monotonic()
        for rid, p in list(self._pending.items()):
            assert p.future is not None
            if p.future.done():
                del self._pending[rid]
                try:
                    out.append((p.add, p.params, p.future.result()))
                except (ValueError, TypeError) as e:
                    out.append((p.add, p.params, str(e)))
                except Exception as e:  # noqa: BLE001 - one request's input must not end the engine
                    log.exception("request %s: preparing it failed", rid)
                    out.append((p.add, p.params, f"preparing the request failed: {type(e).__name__}: {e}"))
            elif p.started is None and now > p.queued + QUEUE_BUDGETS * self.timeout_s:
                del self._pending[rid]
                p.future.cancel()
                out.append((p.add, p.params, f"the request waited over {QUEUE_BUDGETS * self.timeout_s:g}s for a "
                                             "preparation thread (others are compiling); retry later"))
            elif p.started is not None and now > p.started + self.timeout_s:
                del self._pending[rid]
                if self._pool.replace_stuck(p.thread):  # it keeps its thread: let the queue go on
                    log.warning("request %s: a preparation thread is busy past its budget; a spare takes the queue", rid)
                    if p.thread is not None and p.thread.native_id is not None:  # its compile runs on, for nobody
                        lower_priority(OVERRUN_NICE, p.thread.native_id)
                so = p.params.structured_outputs
                if so is not None:
                    self._slow[so.key()] = None
                    while len(self._slow) > SLOW_KEYS:
                        self._slow.popitem(last=False)
                    log.warning("request %s: its structured outputs %s constraint did not compile within %gs; "
                                "refusing it (and it from now on)", rid, so.kind(), self.timeout_s)
                out.append((p.add, p.params, self._too_slow(so.kind()) if so is not None else
                            f"the request's bad_words took longer than {self.timeout_s:g}s to prepare"))
        return out

    def _too_slow(self, kind: str) -> str:
        return (f"structured outputs {kind} did not compile within {self.timeout_s:g}s "
                "(--request-limits compile_timeout_s): simplify the constraint")

    def close(self) -> None:
        for p in self._pending.values():
            if p.future is not None:
                p.future.cancel()
        self._pending.clear()
        self._pool.shutdown(0.0)
