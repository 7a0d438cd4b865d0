"""`kvtier serve`'s HTTP-side flags, with vLLM's names: the proxy prefix, CORS, TLS, uvicorn's log
level, logging (levels, format, request and stats lines), the chat template and --generation-config (read by server/defaults.py).
Each is checked before the engine starts, so a bad value exits 2 with a line naming its flag."""
from __future__ import annotations

import argparse
import codecs
import json
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.logs import LOG_FORMATS, LOG_LEVELS, LogSettings
from server.stats_log import STATS_INTERVAL_S

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class HttpSettings:
    """What uvicorn and the app's middleware get from the flags; ValueError names the bad flag."""

    root_path: str = ""  # FastAPI's root_path: the prefix a path-routing proxy strips
    # CORS, vLLM's defaults: any origin, method and header; no credentials (with them and the
    # wildcard, Starlette answers every asking origin by name: any site could then send them).
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    uvicorn_log_level: str = "info"

    def __post_init__(self) -> None:
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"--root-path must start with '/' and not end with one (e.g. /api); got {self.root_path!r}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"--uvicorn-log-level must be one of {', '.join(UVICORN_LOG_LEVELS)}; "
                             f"got {self.uvicorn_log_level!r}")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required); got {self.ssl_cert_reqs}")
        if self.ssl_certfile is None:
            given = [f for f, v in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-ca-certs", self.ssl_ca_certs)) if v]
            if given or self.ssl_cert_reqs != ssl.CERT_NONE:
                raise ValueError(f"{given[0] if given else '--ssl-cert-reqs'} needs --ssl-certfile")
            return
        if self.ssl_cert_reqs != ssl.CERT_NONE and not self.ssl_ca_certs:
            raise ValueError("--ssl-cert-reqs 1 or 2 (client certificates) needs --ssl-ca-certs to check them against")
        self._check_ssl()

    def _check_ssl(self) -> None:
        """Builds a TLS context from the files now, so a missing or mismatched one is a flag error
        (uvicorn builds its own from them once serving)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(self.ssl_certfile, self.ssl_keyfile)  # type: ignore[arg-type]
        except (OSError, ssl.SSLError) as e:
            flag = "--ssl-certfile/--ssl-keyfile" if self.ssl_keyfile else "--ssl-certfile"
            raise ValueError(f"{flag}: cannot load the certificate and key: {e}") from None
        if self.ssl_ca_certs:
            try:
                ctx.load_verify_locations(self.ssl_ca_certs)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"--ssl-ca-certs: cannot load {self.ssl_ca_certs}: {e}") from None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """uvicorn.Config keywords (it builds its own SSL context from the files checked here)."""
        return {"root_path": self.root_path, "log_level": self.uvicorn_log_level,
                "access_log": self.uvicorn_log_level in ("debug", "trace"), "ssl_keyfile": self.ssl_keyfile,
                "ssl_certfile": self.ssl_certfile, "ssl_ca_certs": self.ssl_ca_certs,
                "ssl_cert_reqs": self.ssl_cert_reqs}

    def add_cors(self, app: Any) -> None:
        """CORS around everything else (the API-key check included): a browser's preflight is
        answered without a key, and error responses carry the CORS headers the browser needs to
        read them."""
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                           allow_methods=list(self.allowed_methods), allow_headers=list(self.allowed_headers),
                           allow_credentials=self.allow_credentials)


_D = HttpSettings()
_L = LogSettings()


def _json_list(value: str) -> tuple[str, ...]:
    """A CORS flag's value: a JSON list of strings, as vLLM takes them."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}); give a list like '[\"*\"]'") from None
    if not isinstance(parsed, list) or not all(isinstance(x, str) for x in parsed):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings; got {value}")
    return tuple(parsed)


def add_http_args(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("HTTP (vLLM's flags): proxy prefix, CORS, TLS, uvicorn's log level")
    h.add_argument("--root-path", default=_D.root_path, metavar="PREFIX",
                   help="the path prefix a path-routing proxy strips before forwarding (FastAPI's root_path): "
                        "routes stay where they are, /docs and /openapi.json name the prefix (default: none)")
    for name, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        h.add_argument(f"--allowed-{name}", type=_json_list, default=getattr(_D, f"allowed_{name}"),
                       metavar="JSON", help=f"CORS: the {what} browsers may use, a JSON list (default: '[\"*\"]')")
    h.add_argument("--allow-credentials", action="store_true",
                   help="CORS: let browsers send cookies and Authorization; list --allowed-origins with it, since "
                        "with the default '*' every site may then send them")
    h.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="the TLS private key (PEM), with --ssl-certfile")
    h.add_argument("--ssl-certfile", default=None, metavar="PATH",
                   help="serve HTTPS with this certificate chain (PEM; it may hold the key too)")
    h.add_argument("--ssl-ca-certs", default=None, metavar="PATH", help="CA certificates that client certificates "
                                                                        "are checked against (with --ssl-cert-reqs)")
    h.add_argument("--ssl-cert-reqs", type=int, default=_D.ssl_cert_reqs, metavar="{0,1,2}",
                   help="client certificates: 0 not asked for, 1 optional, 2 required (Python's ssl.CERT_*; "
                        "default: %(default)s)")
    h.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                   help="uvicorn's own loggers (start-up, errors; the access log at debug and trace), apart from "
                        "kvtier's (default: --log-level's value)")
    g = p.add_argument_group("logging")
    g.add_argument("--log-level", default=_L.level, choices=LOG_LEVELS,
                   help="logging verbosity of both processes (default: %(default)s)")
    g.add_argument("--log-format", default=_L.format, choices=LOG_FORMATS,
                   help="text: vLLM-like lines; json: one JSON object per line (time, level, process, logger, "
                        "message, and the per-request and stats lines' numbers as fields) for log shippers "
                        "(default: %(default)s)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log one INFO line per finished request: its id, prompt tokens, cached tokens by tier, output "
                        "tokens, finish reason, TTFT and latency. Never the prompt (the users' data) unless "
                        "--log-prompts")
    g.add_argument("--log-prompts", action="store_true",
                   help="with --enable-log-requests, also log each request's prompt token ids and non-default "
                        "sampling parameters when it arrives")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM's older command lines; request logging is off unless "
                        "--enable-log-requests is given")
    g.add_argument("--max-log-len", type=int, default=None, metavar="TOKENS",
                   help="with --log-prompts, the prompt token ids shown per request (default: all)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="do not log the periodic stats line (throughput, running/waiting, G1 usage, prefix-cache "
                        "hit rate, per-tier hit tokens and bytes moved), which is logged every "
                        "--log-stats-interval seconds while the server is busy")
    g.add_argument("--log-stats-interval", type=float, default=STATS_INTERVAL_S, metavar="SECONDS",
                   help="seconds between stats lines (default: %(default)s)")
    c = p.add_argument_group("chat template and default sampling parameters")
    c.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the Jinja chat template for chat requests and /tokenize, instead of the tokenizer's: a file "
                        "path, or the template itself written on one line (vLLM's rule: a value that cannot be "
                        "opened and holds none of '{', '}' or a newline is taken for a missing file)")
    c.add_argument("--generation-config", default="auto", metavar="{auto,vllm,DIR}",
                   help="default sampling parameters for fields a request leaves unset: auto reads the model's "
                        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, and "
                        "max_new_tokens as the default max_tokens), vllm ignores it (OpenAI's defaults), a directory "
                        "reads its generation_config.json, whose max_new_tokens then also caps every request. The "
                        "defaults in effect are logged at start-up (default: %(default)s)")


def http_settings(ns: argparse.Namespace) -> HttpSettings:
    """From the parsed flags; ValueError names the flag."""
    return HttpSettings(ns.root_path, ns.allowed_origins, ns.allowed_methods, ns.allowed_headers, ns.allow_credentials,
                        ns.ssl_keyfile, ns.ssl_certfile, ns.ssl_ca_certs, ns.ssl_cert_reqs,
                        ns.uvicorn_log_level or ns.log_level)


JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """--chat-template's text (vLLM's rule): the file's contents, or else the value itself with its
    backslash escapes decoded (a template on one command line); ValueError for a value that reads
    like a path to a file that cannot be opened, or a template that does not parse."""
    try:
        text = Path(value).read_text()
    except (OSError, UnicodeDecodeError, ValueError) as e:
        if not any(c in value for c in JINJA_CHARS):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be opened: {e}") from None
        text = codecs.decode(value, "unicode_escape")
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # transformers renders it in a sandbox with loop controls; a syntax error shows here, not per request
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return text
