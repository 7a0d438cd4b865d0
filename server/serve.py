"""`kvtier serve [MODEL]`: the OpenAI-compatible server.

The API process (FastAPI under uvicorn) tokenizes, formats and streams; the engine core runs in
a process of its own (server.core) and the two talk over ZMQ with msgpack, so the HTTP event
loop never waits on the model. SIGTERM or Ctrl-C drains in-flight requests for up to
--shutdown-timeout seconds, aborts what is left, flushes offload writes and exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from engine.args import add_engine_args, llm_kwargs

log = logging.getLogger("kvtier.server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier serve", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a model over an OpenAI-compatible HTTP API (completions, chat, streaming, "
                    "a batch chat endpoint, /metrics, /v1/kv/stats).",
        epilog="example:\n  kvtier serve                      # the embedded demo model on 127.0.0.1:8000\n"
               "  kvtier serve ./my-llama --port 9000 --kv-offloading-size 4 --kv-offload-disk /var/cache/kvtier")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s; "
                                                       "0.0.0.0 listens on every interface)")
    s.add_argument("--port", type=int, default=8000,
                   help="TCP port (default: %(default)s; 0 picks a free one and logs it)")
    s.add_argument("--api-key", default=os.environ.get("KVTIER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $KVTIER_API_KEY; unset: no auth)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) the API accepts and reports; the first is used in responses "
                        "(default: the model directory's name)")
    s.add_argument("--max-request-bytes", type=int, default=8 * 2**20,
                   help="largest request body accepted; bigger ones get 413 (default: 8 MiB)")
    s.add_argument("--max-pending-requests", type=int, default=512,
                   help="sequences in flight (queued or running) before new requests get 503 with "
                        "Retry-After (default: %(default)s)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may finish before they are aborted "
                        "(default: %(default)s)")
    s.add_argument("--engine-start-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="how long the engine core may take to load the model (default: %(default)s)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="logging verbosity of both processes (default: %(default)s)")
    return p


def _uvicorn_server() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # kvtier installs its own SIGINT/SIGTERM handlers. uvicorn's re-raise the signal
            # after shutdown, which would turn a clean drain's exit status 0 into 143.
            yield

    return Server


def _fail(msg: str) -> int:
    print(f"kvtier serve: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not 0 <= ns.port <= 65535:
        p.error(f"--port must be in [0, 65535]; got {ns.port}")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return _fail(f"{e.name} is not installed; run 'pip install -e .' (or 'make setup')")
    from server.api import API, ServerSettings

    kwargs = llm_kwargs(ns)
    try:
        if kwargs["model"] is None:
            from engine.demo_model import ensure_demo_model

            kwargs["model"] = str(ensure_demo_model())
        model_dir = Path(kwargs["model"])
        if not model_dir.is_dir():
            return _fail(f"model directory {model_dir} does not exist")
        settings = ServerSettings(tuple(ns.served_model_name or [model_dir.name]), str(model_dir),
                                  ns.api_key or None, ns.max_request_bytes, ns.max_pending_requests)
        # Probe the config in this process (cheap: no weights) so flag errors exit 2 before a spawn.
        from engine.llm import _parse_json

        for key in ("kv_transfer_config", "kv_events_config", "speculative_config"):
            kwargs[key] = _parse_json(kwargs[key], key)
        from engine.loader import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
        return _fail(str(e))
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in ns.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ns.host, ns.port))
    except OSError as e:
        return _fail(f"cannot listen on {ns.host}:{ns.port}: {e.strerror}")
    return asyncio.run(_serve(ns, kwargs, settings, tokenizer, sock, API))


async def _serve(ns: argparse.Namespace, kwargs: dict[str, Any], settings: Any, tokenizer: Any,
                 sock: socket.socket, api_cls: Any) -> int:
    import uvicorn

    from server.client import EngineClient, StartupError

    _Server = _uvicorn_server()
    from server.routes import build_app

    client = EngineClient(kwargs, ns.log_level)
    log.info("starting the engine core for %s", settings.model_path)
    try:
        info = await client.start(ns.engine_start_timeout)
    except StartupError as e:
        await client.shutdown(0)
        sock.close()
        return _fail(f"engine core failed to start: {e}")
    api = api_cls(client, tokenizer, settings)
    app = build_app(api)

    @asynccontextmanager
    async def lifespan(_: Any) -> Any:
        yield
        log.info("shutting down: %d sequence(s) still in flight", client.num_pending)
        # uvicorn has already waited up to --shutdown-timeout for the requests, and those still
        # running then were aborted (on_signal): the core only has to flush its offload writes.
        await client.shutdown(1.0)

    app.router.lifespan_context = lifespan
    # At --shutdown-timeout the requests left end with finish_reason "abort" (their responses
    # still complete); uvicorn's own timeout, a little later, only backs that up.
    config = uvicorn.Config(app, log_level=ns.log_level, timeout_graceful_shutdown=max(ns.shutdown_timeout, 0) + 5,
                            access_log=ns.log_level == "debug", lifespan="on")
    server = _Server(config)
    host, port = sock.getsockname()[:2]
    loop = asyncio.get_running_loop()
    stop_signals = 0
    aborting: list[asyncio.Task[None]] = []

    async def abort_left() -> None:
        n = await client.abort_all()
        if n:
            log.warning("shutdown timeout: aborted %d sequence(s) still running", n)

    def on_signal(sig: int) -> None:
        nonlocal stop_signals
        stop_signals += 1
        if stop_signals == 1:
            loop.call_later(max(ns.shutdown_timeout, 0), lambda: aborting.append(loop.create_task(abort_left())))
        if stop_signals > 1:  # a second Ctrl-C: stop waiting for requests
            server.force_exit = True
        log.info("received %s: draining in-flight requests for up to %.0fs", signal.Signals(sig).name,
                 ns.shutdown_timeout)
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    from server.launch import READY_LINE

    print(READY_LINE.format(model=settings.served_model_names[0], max_model_len=info.max_model_len,
                            url=f"http://{host}:{port}"), flush=True)
    await server.serve(sockets=[sock])
    if client.died:
        log.error("exiting with status 1: the engine core had died")
        return 1
    return 0
