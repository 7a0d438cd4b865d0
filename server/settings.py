"""`kvtier serve`'s own settings (the engine's are `EngineConfig`'s), a frozen dataclass validated
with ValueError. A field backed by a flag is declared once with `setting` (default, help text,
flag) and its flag is generated from it (server/args.py `add_setting_args`); the others are built
from flags that need parsing (--served-model-name, --generation-config, --enable-log-requests,
--request-limits) or from the engine."""
from __future__ import annotations

import enum
from dataclasses import Field, dataclass, fields
from typing import Any

from engine.config import is_flag, setting
from server.client import DEFAULT_HEARTBEAT_TIMEOUT_S
from server.defaults import SamplingDefaults
from server.limits import RequestLimits
from server.media import MediaSettings
from server.metrics_compat import DEFAULT_METRICS_COMPAT, METRICS_COMPAT_CHOICES
from server.reasoning import PARSERS as REASONING_PARSERS
from server.request_log import RequestLogger
from server.tools import PARSERS as TOOL_PARSERS


class ServerGroup(str, enum.Enum):
    """Where a server setting's flag is listed in `--help`."""
    SERVER = "server"


def _server(default: Any, help: str, **kw: Any) -> Any:
    return setting(default, help, group=ServerGroup.SERVER, **kw)


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]  # --served-model-name, else the model directory's name
    model_path: str
    host: str = _server("127.0.0.1", "address to listen on (default: %(default)s; 0.0.0.0 listens on every interface)")
    port: int = _server(8000, "TCP port (default: %(default)s; 0 picks a free one and logs it)")
    api_key: str | None = _server(
        None, "require 'Authorization: Bearer KEY' on /v1 routes (default: $KVTIER_API_KEY; unset: no auth)",
        env="KVTIER_API_KEY")
    max_request_bytes: int = _server(8 * 2**20, "largest request body accepted; bigger ones get 413 (default: 8 MiB)")
    max_pending_requests: int = _server(
        512, "sequences in flight (queued or running) before new requests get 503 with Retry-After "
        "(default: %(default)s)")
    shutdown_timeout: float = _server(
        30.0, "on SIGTERM, how long in-flight requests may finish before they are aborted (default: %(default)s)",
        metavar="SECONDS")
    data_parallel_size: int = _server(
        1, "engine cores behind this server, each a process of its own on its share of the CPUs (and with "
        "--tensor-parallel-size, its own ranks); a request goes to the core that got its prompt's prefix before, "
        "else to the least loaded (default: %(default)s)", aliases=("-dp",), metavar="N")
    engine_start_timeout: float = _server(
        900.0, "how long the engine core may take to load the model (default: %(default)s)", metavar="SECONDS")
    engine_heartbeat_timeout: float = _server(
        DEFAULT_HEARTBEAT_TIMEOUT_S, "the engine core sends a heartbeat several times a second; if none comes, or "
        "one step runs, for this long, the core is taken for hung (SIGSTOP, a deadlock): it is killed, /health "
        "turns 503, requests fail, and the server exits 1 (default: %(default)s)", metavar="SECONDS")
    trust_request_chat_template: bool = _server(
        False, "accept a chat template sent in a request (chat_template, or chat_template_kwargs.chat_template); "
        "without this flag such requests get 400. Templates are sandboxed Jinja, but a hostile one can still burn "
        "CPU up to --chat-template-timeout")
    enable_auto_tool_choice: bool = _server(
        False, 'let requests with tools use tool_choice "auto" (the default when tools are given): the model '
        "decides, and --tool-call-parser finds its calls in the text")
    tool_call_parser: str | None = _server(
        None, "the format the model writes tool calls in, for tool_choice auto (hermes and qwen3: "
        "<tool_call>{...}</tool_call>; llama3_json: a JSON object; mistral: [TOOL_CALLS] [...])",
        choices=tuple(sorted(TOOL_PARSERS)))
    reasoning_parser: str | None = _server(
        None, "split a reasoning model's thinking (between <think> and </think>) into reasoning_content (and "
        "reasoning) in chat responses and stream deltas; it also gives the engine the markers that "
        "thinking_token_budget needs (deepseek_r1: the output starts inside the thinking; qwen3: only when the "
        "prompt opened it)", choices=tuple(sorted(REASONING_PARSERS)))
    chat_template_timeout_s: float = _server(
        5.0, "longest a request-supplied chat template may render before the request gets 400 "
        "(default: %(default)s)", flag="--chat-template-timeout", metavar="SECONDS")
    tokenizer_threads: int = _server(
        2, "threads that tokenize and apply chat templates, off the HTTP event loop; at most this many requests "
        "tokenize at once (default: %(default)s)")
    metrics_no_auth: bool = _server(
        False, "with --api-key, leave /metrics open to scrapers without the key (by default every route but "
        "/health and /version needs it, /metrics and /tokenize included)")
    metrics_compat: str = _server(
        DEFAULT_METRICS_COMPAT, "vllm: /metrics also carries vLLM's own names (vllm:...) for the series that mean "
        "the same thing, with vLLM's labels and buckets, so vLLM's dashboards and alerts work unchanged; "
        "server/metrics_compat.py lists which are exported and why the rest are not (default: %(default)s, "
        "kvtier: names only)", choices=METRICS_COMPAT_CHOICES)
    retry_after_s: int = 1  # the Retry-After of a 503 when the server is full
    sampling_defaults: SamplingDefaults | None = None  # --generation-config: for fields a request leaves unset
    request_logger: RequestLogger | None = None  # --enable-log-requests
    system_fingerprint: str = ""  # OpenAI's: names the backend configuration answers come from
    limits: RequestLimits = RequestLimits()  # --request-limits: what one request may make the server do
    media: MediaSettings = MediaSettings()  # where images may come from and how big (server/media.py)
    lora_modules: tuple[tuple[str, str], ...] = ()  # --lora-modules: (name, path) of each adapter served by name
    allow_runtime_lora_updating: bool = _server(
        False, "with --enable-lora, serve vLLM's POST /v1/load_lora_adapter ({\"lora_name\", \"lora_path\", "
        "\"load_inplace\"}) and /v1/unload_lora_adapter ({\"lora_name\"}): anyone who can reach the API may "
        "then make the server read a folder of its choice (default: $VLLM_ALLOW_RUNTIME_LORA_UPDATING, as in vLLM; "
        "unset: off, and the routes are 404)", env="VLLM_ALLOW_RUNTIME_LORA_UPDATING")

    def __post_init__(self) -> None:
        if not self.api_key:
            object.__setattr__(self, "api_key", None)  # an empty $KVTIER_API_KEY: no auth
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if not self.served_model_names:
            raise ValueError("served_model_names must not be empty")
        if clash := sorted(set(self.lora_names) & set(self.served_model_names)):
            raise ValueError(f"--lora-modules name(s) {clash} are also --served-model-name(s)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535]; got {self.port}")
        for name, least, value in (("max_request_bytes", 1024, self.max_request_bytes),
                                   ("max_pending_requests", 1, self.max_pending_requests),
                                   ("tokenizer_threads", 1, self.tokenizer_threads),
                                   ("data_parallel_size", 1, self.data_parallel_size)):
            if value < least:
                raise ValueError(f"{name} must be >= {least}; got {value}")
        for name, value in (("chat_template_timeout_s", self.chat_template_timeout_s),
                            ("engine_heartbeat_timeout", self.engine_heartbeat_timeout),
                            ("engine_start_timeout", self.engine_start_timeout)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0; got {value}")

    @property
    def lora_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.lora_modules)

    @classmethod
    def flag_fields(cls) -> tuple[Field[Any], ...]:
        return tuple(filter(is_flag, fields(cls)))

    @classmethod
    def from_flags(cls, ns: Any, **built: Any) -> ServerSettings:
        """The settings of the parsed flags, with `built`: the fields that are not flags of their own."""
        return cls(**{f.name: getattr(ns, f.name) for f in cls.flag_fields()}, **built)
