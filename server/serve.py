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
import hashlib
import json
import logging
import signal
import socket
import sys
from collections.abc import Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from engine.config import UsageContext
from server.args import add_engine_args, add_setting_args, llm_kwargs
from server.flags import HttpSettings, add_http_args, http_settings, load_chat_template
from server.limits import RequestLimits
from server.reasoning import PARSERS as REASONING_PARSERS
from server.media import MediaSettings
from server.settings import ServerGroup, ServerSettings

log = logging.getLogger(__name__)
DEATH_LINGER_S = 5.0  # how long a server whose engine core died keeps answering 503 before it exits 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier serve", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve a model over an OpenAI-compatible HTTP API (completions, chat, streaming, "
                    "a batch chat endpoint, /metrics, /v1/kv/stats).",
        epilog="example:\n  kvtier serve                      # the embedded demo model on 127.0.0.1:8000\n"
               "  kvtier serve ./my-llama --port 9000 --kv-offloading-size 4 --kv-offload-disk /var/cache/kvtier")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="read flags from a YAML file (vLLM's): keys are flag names without the dashes "
                        "(max-model-len or max_model_len, model for MODEL); flags on the command line win; "
                        "an unknown key is an error")
    add_engine_args(p)
    s = p.add_argument_group(ServerGroup.SERVER.value)
    add_setting_args(p, ServerSettings, {ServerGroup.SERVER: s})
    add_setting_args(p, MediaSettings)
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) the API accepts and reports; the first is used in responses "
                        "(default: the model directory's name)")
    s.add_argument("--request-limits", default=None, metavar="JSON",
                   help="bounds on what one request may make the server do, as a JSON object of those to change, "
                        "e.g. '{\"bad_words\": 4096}'; a request over one gets 400 naming it (docs/HARDENING.md). "
                        "List sizes, constraint sizes (schema_bytes, schema_depth, schema_enum, pattern_chars, "
                        "grammar_chars, choice_chars) and the seconds a grammar may take to compile. Defaults: "
                        + RequestLimits.describe())
    add_http_args(p)
    return p


def reasoning_config(parser: str | None, config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The engine's reasoning_config: --reasoning-config, its markers defaulting to the parser's;
    ValueError when they differ from the parser's (the budget would force a marker the parser
    does not split on)."""
    from engine.sample.thinking import ReasoningConfig

    ReasoningConfig.from_dict(config)  # a bad key or value: exit 2 before the engine spawns
    if parser is None:
        return config
    p = REASONING_PARSERS[parser]
    merged = {"reasoning_start_str": p.start, "reasoning_end_str": p.end, **(config or {})}
    if (merged["reasoning_start_str"], merged["reasoning_end_str"]) != (p.start, p.end):
        raise ValueError(f"--reasoning-config markers {merged['reasoning_start_str']!r}/{merged['reasoning_end_str']!r} "
                         f"differ from --reasoning-parser {parser}'s {p.start!r}/{p.end!r}")
    return merged


def system_fingerprint(kwargs: dict[str, Any]) -> str:
    """OpenAI's system_fingerprint: changes when the version or an engine setting does."""
    from server.api import VERSION

    text = json.dumps({"version": VERSION, **kwargs}, sort_keys=True, default=str)
    return "fp_" + hashlib.sha256(text.encode()).hexdigest()[:12]


def _uvicorn_server() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # kvtier installs its own SIGINT/SIGTERM handlers. uvicorn's re-raise the signal
            # after shutdown, which would turn a clean drain's exit status 0 into 143.
            yield

    return Server


def image_processor(model_dir: Path, media: MediaSettings) -> Any:
    """The checkpoint's processor when the model takes images (None otherwise); ValueError when an
    image flag is set for a model that takes none (it would be ignored)."""
    from engine.model_config import load_model_config

    mc = load_model_config(model_dir, "float32")
    if not mc.multimodal:
        if media.changed():
            raise ValueError(f"{', '.join(media.changed())}: {mc.architecture} takes no images")
        return None
    from engine.mm.processor import ImageProcessor

    proc = ImageProcessor(model_dir, mc.image_spec)
    log.info("images: this model takes image_url content parts in chat messages (data: URLs%s%s; at most %d per "
             "prompt); other content parts are refused by name", ", http(s) from " + ", ".join(sorted(media.domains))
             if media.domains else "", ", file: under " + media.allowed_local_media_path
             if media.allowed_local_media_path else "", media.images_per_prompt)
    return proc


def check_lora_modules(kwargs: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """--lora-modules, each adapter read and checked against the LoRA flags here, so a bad one
    exits 2 before the engine starts."""
    from engine.lora.adapter import allowed_targets, parse_lora_modules, read_info

    modules = parse_lora_modules(kwargs["lora_modules"] or ())
    if modules and not kwargs["enable_lora"]:
        raise ValueError("--lora-modules needs --enable-lora")
    if len(modules) > kwargs["max_loras"]:
        raise ValueError(f"--lora-modules names {len(modules)} adapters but --max-loras is {kwargs['max_loras']}")
    targets = allowed_targets(kwargs["lora_target_modules"])
    for name, path in modules:
        read_info(name, path, kwargs["max_lora_rank"], targets)
    return modules


def _fail(msg: str) -> int:
    print(f"kvtier serve: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    p = build_parser()
    from server import config_file

    ns = p.parse_args(config_file.expand(p, argv))
    from server.logs import LogSettings

    logs = LogSettings(ns.log_level, ns.log_format)
    logs.configure("api")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        return _fail(f"{e.name} is not installed; run 'pip install -e .' (or 'make setup')")
    from server.api import API
    from server.defaults import SamplingDefaults
    from server.request_log import RequestLogger
    from server.stats_log import STATS_INTERVAL_S, StatsLogger

    kwargs = llm_kwargs(ns, UsageContext.SERVER)
    try:
        if kwargs["model"] is None:
            from engine.demo.demo_model import ensure_demo_model

            kwargs["model"] = str(ensure_demo_model())
        model_dir = Path(kwargs["model"])
        if not model_dir.is_dir():
            return _fail(f"model directory {model_dir} does not exist")
        http = http_settings(ns)
        defaults = SamplingDefaults.load(ns.generation_config, model_dir)
        request_log = RequestLogger(ns.max_log_len, ns.log_prompts)  # checks --max-log-len even when unused
        if ns.log_prompts and not ns.enable_log_requests:
            raise ValueError("--log-prompts needs --enable-log-requests")
        if ns.max_log_len is not None and not ns.log_prompts:
            raise ValueError("--max-log-len needs --log-prompts (it cuts the logged prompt token ids)")
        if ns.disable_log_stats and ns.log_stats_interval != STATS_INTERVAL_S:
            raise ValueError("--log-stats-interval has no effect with --disable-log-stats")
        stats_log = None if ns.disable_log_stats else StatsLogger(ns.log_stats_interval)
        settings = ServerSettings.from_flags(
            ns, served_model_names=tuple(ns.served_model_name or [model_dir.name]), model_path=str(model_dir),
            system_fingerprint=system_fingerprint(kwargs), sampling_defaults=defaults,
            request_logger=request_log if ns.enable_log_requests else None,
            limits=RequestLimits.from_json(ns.request_limits), media=MediaSettings.from_flags(ns),
            lora_modules=check_lora_modules(kwargs))
        if settings.allow_runtime_lora_updating and not kwargs["enable_lora"]:
            raise ValueError("--allow-runtime-lora-updating (or $VLLM_ALLOW_RUNTIME_LORA_UPDATING) needs --enable-lora")
        # Probe the config in this process (cheap: no weights) so flag errors exit 2 before a spawn.
        from engine.config import JSON_SETTINGS, parse_json_setting

        for key in JSON_SETTINGS:
            kwargs[key] = parse_json_setting(kwargs[key], key)
        kwargs["reasoning_config"] = reasoning_config(ns.reasoning_parser, kwargs["reasoning_config"])
        from policies import check_policy

        check_policy(kwargs["kv_eviction_policy"], "--kv-eviction-policy")
        if ns.data_parallel_size > 1 and kwargs.get("kv_events_config"):
            raise ValueError("--kv-events-config with --data-parallel-size > 1: every core would bind the same "
                             "endpoint; not supported yet")
        from engine.config import resolve_device

        if ns.data_parallel_size > 1 and resolve_device(kwargs.get("device") or "auto") != "cpu":
            raise ValueError("--data-parallel-size > 1 runs CPU engine cores only for now (on a GPU every core "
                             "would take the same device)")
        from connectors.factory import check_shared_tiers, check_transfer_config, flag_tiers
        from kvstore.entry import load_secret

        check_transfer_config(kwargs["kv_transfer_config"], flag_tiers(
            kwargs.get("kv_offloading_size"), kwargs.get("kv_offload_disk"), kwargs.get("kv_offload_remote")))
        check_shared_tiers(kwargs["kv_transfer_config"], kwargs["kv_offload_remote"],
                           load_secret(kwargs["kv_offload_secret_file"]) is not None, kwargs["kv_offload_remote_trusted"])
        chat_template = None if ns.chat_template is None else load_chat_template(ns.chat_template)
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
        return _fail(str(e))
    defaults.log_startup()
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.host, settings.port))
        # Listening now, not when uvicorn starts: the ready line goes out before uvicorn's start-up
        # (an SSL context to load, under load in CI) and a client that reads it and connects at
        # once must wait in the backlog, not be refused.
        sock.listen(2048)
    except OSError as e:
        return _fail(f"cannot listen on {settings.host}:{settings.port}: {e.strerror}")
    return asyncio.run(_serve(ns, kwargs, settings, (model_dir, chat_template), sock, API, http, logs, stats_log))


def make_client(kwargs: dict[str, Any], settings: Any, logs: Any) -> Any:
    """One engine core, or with --data-parallel-size N, N of them on disjoint CPU sets behind one client."""
    from engine.parallel.ranks import cpu_sets
    from server.client import EngineClient
    from server.dp_client import DataParallelClient

    n = settings.data_parallel_size
    args = (kwargs, logs, settings.engine_heartbeat_timeout, settings.limits.compile_timeout_s)
    if n == 1:
        return EngineClient(*args)
    return DataParallelClient([EngineClient(*args, cpus=cpus) for cpus in cpu_sets(n)])


def load_frontend(model_dir: Path, media: MediaSettings, chat_template: str | None) -> tuple[Any, Any]:
    """The tokenizer (with --chat-template's, for chat and /tokenize; a request's own, if trusted,
    still wins) and the image processor (None for a text model). ValueError, OSError, ... for a
    checkpoint or flag they refuse."""
    from engine.runner.loader import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    images = image_processor(model_dir, media)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer, images


async def _serve(ns: argparse.Namespace, kwargs: dict[str, Any], settings: Any, frontend: tuple[Path, str | None],
                 sock: socket.socket, api_cls: Any, http: HttpSettings, logs: Any, stats_log: Any) -> int:
    import uvicorn

    from server.client import CoreState, StartupError
    from server.stats_log import run_stats_log

    _Server = _uvicorn_server()
    from server.routes import build_app

    client = make_client(kwargs, settings, logs)
    log.info("starting the engine core for %s", settings.model_path)
    starting = asyncio.ensure_future(client.start(settings.engine_start_timeout))
    try:
        # While the core loads the model, this process loads the tokenizer: transformers' imports
        # and the config take seconds that would otherwise come before the core's own.
        tokenizer, images = await asyncio.to_thread(load_frontend, frontend[0], settings.media, frontend[1])
    except (ValueError, FileNotFoundError, OSError, RuntimeError) as e:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await client.shutdown(0)
        sock.close()
        return _fail(str(e))
    try:
        info = await starting
    except StartupError as e:
        await client.shutdown(0)
        sock.close()
        return _fail(f"engine core failed to start: {e}")
    api = api_cls(client, tokenizer, settings, images)
    api.metrics.enable_compat(settings.metrics_compat, info.max_model_len)  # vLLM's token buckets need the model length
    app = build_app(api)
    http.add_cors(app)

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
    # JSON logs: uvicorn's loggers go through the root handler instead of its own text ones.
    config = uvicorn.Config(app, timeout_graceful_shutdown=max(settings.shutdown_timeout, 0) + 5, lifespan="on",
                            **http.uvicorn_kwargs(), **({"log_config": None} if logs.format == "json" else {}))
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
            loop.call_later(max(settings.shutdown_timeout, 0), lambda: aborting.append(loop.create_task(abort_left())))
        if stop_signals > 1:  # a second Ctrl-C: stop waiting for requests
            server.force_exit = True
        log.info("received %s: draining in-flight requests for up to %.0fs", signal.Signals(sig).name,
                 settings.shutdown_timeout)
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    from server.launch import READY_LINE

    print(READY_LINE.format(model=settings.served_model_names[0], max_model_len=info.max_model_len,
                            url=f"{http.scheme}://{host}:{port}"), flush=True)
    async def exit_on_death() -> None:
        await client.dead.wait()
        # Linger so health checkers and the failed requests' clients see the 503s, then exit 1
        # for the supervisor to restart us: a server without its engine only answers errors.
        log.error("the engine core is dead: exiting in %.0fs", DEATH_LINGER_S)
        await asyncio.sleep(DEATH_LINGER_S)
        server.should_exit = True

    watcher = loop.create_task(exit_on_death())
    stats_task = None if stats_log is None else loop.create_task(
        run_stats_log(client.stats, lambda: client.state is CoreState.READY, stats_log))
    try:
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()
        if stats_task is not None:
            stats_task.cancel()
        api.close()
        # A second signal makes uvicorn cancel the lifespan's shutdown: the core was never told to
        # stop, and the exit's join of it waited for ever (the core waits for this process to go).
        if client.state is not CoreState.STOPPED:
            await client.shutdown(1.0)
    if client.died:
        log.error("exiting with status 1: the engine core had died")
        return 1
    return 0
