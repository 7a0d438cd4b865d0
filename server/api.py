"""The OpenAI-compatible HTTP API (FastAPI). It tokenizes, validates, detokenizes and formats;
the engine-core process does the rest. Every error is OpenAI's JSON error object."""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from engine.core.request_factory import needs_preparation
from engine.core.token_ids import check_token_ids
from engine.mm.inputs import MMInputs
from engine.mm.processor import ImageProcessor
from server.api_output import OutputFormats
from server.channel import Delta
from server.client import CoreState, EngineClient, EngineDeadError
from server.detok import IncrementalDetokenizer
from server.errors import APIError, error_response  # noqa: F401 (re-exported: routes import them from here)
from server.fields import decode_body
from server.limits import LimitExceeded, check_constraint, check_lists
from server.lora_routes import LoRACatalog
from server.media import MediaError, image_urls, load_image
from server.media_wire import to_wire
from server.metrics import Metrics
from server.reasoning import PARSERS as REASONING_PARSERS
from server.reasoning import prompt_opens
from server.protocol import (
    TokenizeRequest,
    _Chat,
    _Sampling,
)
from server.tokenizing import Tokenizing
from server.tools import ToolPlan
from server.tools import plan as tool_plan
from server.settings import ServerSettings

log = logging.getLogger(__name__)
VERSION = "0.1.0"
BIG_BODY_BYTES = 64 * 1024  # a body this big is decoded and validated on a worker thread
FEW_TOOLS = 16  # more tools than this: their plan is built and checked on a worker thread


@dataclass
class Choice:
    """One sequence of one request, as the API process follows it."""
    index: int
    request_id: str
    prompt_ids: list[int]
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish: Delta | None = None  # the last delta
    first_token_at: float | None = None
    last_token_at: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # seconds between successive deltas with tokens
    queue: Any = None  # asyncio.Queue of core deltas, set by submit()
    thinking_opened: bool | None = None  # with a reasoning parser: the prompt opened a thinking section
    prompt_logprobs: list[Any] | None = None  # from the core's first delta: [rank, {token id: logprob}] each
    # With prompt_logprobs and n > 1: the prompt's first sequence, which alone computes them
    # (protocol.sampling_params); this choice's deltas wait until they are in.
    leader: Choice | None = None
    formatted_prompt_logprobs: list[Any] | None = None  # server/api_output.py's, once


class API(OutputFormats):
    def __init__(self, client: EngineClient, tokenizer: Any, settings: ServerSettings,
                 images: ImageProcessor | None = None) -> None:
        """`images`: the checkpoint's processor, for a model that takes images (engine/mm/processor.py)."""
        self.client, self.tok, self.s, self.images = client, tokenizer, settings, images
        self.loras = LoRACatalog(settings.lora_modules)  # the adapters served by name (server/lora_routes.py)
        self.metrics = Metrics(settings.served_model_names[0])
        self.created = int(time.time())
        self.tokenizing = Tokenizing(tokenizer, settings.tokenizer_threads, settings.chat_template_timeout_s)
        self._pieces: dict[int, str] = {}
        self.reasoning = REASONING_PARSERS[settings.reasoning_parser] if settings.reasoning_parser else None
        self._markers = ([tokenizer.encode(m, add_special_tokens=False) for m in (self.reasoning.start, self.reasoning.end)]
                         if self.reasoning is not None else None)

    def close(self) -> None:
        self.tokenizing.close()

    # -- input -----------------------------------------------------------------------------
    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > self.s.max_request_bytes:
                    raise APIError(413, f"request body exceeds {self.s.max_request_bytes} bytes")
        except ClientDisconnect:  # gone while uploading: nobody to answer, nothing to log loudly
            log.info("client disconnected while sending the request body")
            raise APIError(499, "client disconnected") from None
        if len(body) > BIG_BODY_BYTES:  # decoding and validating it is CPU the event loop need not wait for
            return await asyncio.to_thread(self._decode, body, model)
        return self._decode(body, model)

    def _decode(self, body: bytearray, model: type[BaseModel]) -> Any:
        """A request body as `model`, or the 400/404 that says what is wrong with it."""
        parsed = decode_body(body, model, self.s.trust_request_chat_template)
        name = getattr(parsed, "model", None)
        if name is not None and name not in self.s.served_model_names and name not in self.loras:
            raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")
        return parsed

    async def chat_ids(self, convs: list[list[Any]], req: _Chat | TokenizeRequest, bound: bool = True) -> list[list[int]]:
        """Token ids of each conversation through the chat template, rendered off the event loop.
        `bound`: a conversation whose text alone cannot fit max_model_len is a 400 first."""
        kwargs, template = self._template_args(req)
        try:
            msgs = [[m.as_dict() for m in conv] for conv in convs]
        except ValueError as e:  # a content part this server does not take (an image)
            raise APIError(400, f"messages: {e}", param="messages") from None
        chars = [sum(len(m["content"]) for m in conv) for conv in msgs]
        if bound:
            for n in chars:
                self._bound(n, "messages")
        try:
            return await self.tokenizing.chat(msgs, req.add_generation_prompt, kwargs, template,
                                              req.continue_final_message, sum(chars))
        except TimeoutError as e:
            raise APIError(400, f"chat_template: {e}", param="chat_template") from None
        except Exception as e:  # noqa: BLE001 - the user's messages, template kwargs or template failed
            raise APIError(400, f"messages: {type(e).__name__}: {e}", param="messages") from None

    async def chat_prompts(self, convs: list[list[Any]], req: _Chat | TokenizeRequest, bound: bool = True
                           ) -> tuple[list[list[int]], list[MMInputs | None]]:
        """`chat_ids`, with each conversation's images when it has some (a model that takes them:
        server/media.py loads and checks them, the checkpoint's processor expands their markers)."""
        if self.images is None or not any(m.has_media for conv in convs for m in conv):
            return await self.chat_ids(convs, req, bound), [None] * len(convs)
        media = self.s.media
        try:
            urls = [[u for m in conv if m.has_media for u in image_urls(m.content)] for conv in convs]
        except MediaError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        for u in urls:
            if len(u) > media.images_per_prompt:
                raise APIError(400, f"messages: the prompt has {len(u)} images, more than the {media.images_per_prompt} "
                                    "the server takes (--limit-mm-per-prompt)", param="messages")
        kwargs, template = self._template_args(req)
        msgs = [[m.as_dict(media=True) for m in conv] for conv in convs]
        chars = [sum(len(p.get("text", "")) for m in conv for p in (
            m["content"] if isinstance(m["content"], list) else [{"text": m["content"]}])) for conv in msgs]
        if bound:
            for n in chars:
                self._bound(n, "messages")
        images = self.images

        def process(text: str, i: int) -> tuple[list[int], MMInputs | None]:
            return images.process(text, [load_image(u, media) for u in urls[i]], add_special_tokens=False)
        try:
            out = await self.tokenizing.chat_with(msgs, req.add_generation_prompt, kwargs, template,
                                                  req.continue_final_message, sum(chars), process)
        except MediaError as e:
            raise APIError(400, f"messages: {e}", param="messages") from None
        except TimeoutError as e:
            raise APIError(400, f"chat_template: {e}", param="chat_template") from None
        except Exception as e:  # noqa: BLE001 - the user's messages, template kwargs or template failed
            raise APIError(400, f"messages: {type(e).__name__}: {e}", param="messages") from None
        return [ids for ids, _ in out], [mm for _, mm in out]

    def _template_args(self, req: _Chat | TokenizeRequest) -> tuple[dict[str, Any], str | None]:
        """The chat template's variables and the request's own template (if allowed); 400s."""
        kwargs = dict(req.chat_template_kwargs or {})
        template = req.chat_template
        if "chat_template" in kwargs:
            if not self.s.trust_request_chat_template:
                raise APIError(400, "chat_template_kwargs.chat_template: a request-supplied chat template needs "
                                    "the server's --trust-request-chat-template", param="chat_template_kwargs")
            template = kwargs.pop("chat_template")
        reserved = sorted(self.tokenizing.reserved_kwargs & set(kwargs))
        if reserved:
            raise APIError(400, f"chat_template_kwargs must not set {reserved}: they are apply_chat_template's "
                                "own parameters, not template variables", param="chat_template_kwargs")
        if getattr(req, "tools", None):
            kwargs["tools"] = req.tools
        if getattr(req, "reasoning_effort", None) is not None:  # a template variable, as in vLLM
            kwargs["reasoning_effort"] = req.reasoning_effort
        return kwargs, template

    async def text_ids(self, prompts: list[str | list[int]], add_special_tokens: bool = True,
                       bound: bool = True) -> list[list[int]]:
        """Token ids of each prompt; `bound`: as chat_ids'."""
        if bound:
            for p in prompts:
                if isinstance(p, str):
                    self._bound(len(p), "prompt")
        return await self.tokenizing.encode(prompts, add_special_tokens)

    def _bound(self, chars: int, param: str) -> None:
        """400 for a text that has too many tokens for max_model_len by its length alone
        (server/tokenizing.py's bound): refused without tokenizing it."""
        info = self.client.info
        at_least = self.tokenizing.min_tokens(chars)
        if info is not None and at_least >= info.max_model_len:
            raise APIError(400, f"This model's maximum context length is {info.max_model_len} tokens. However, the "
                                f"{param} has {chars} characters, so at least {at_least} tokens. Reduce the prompt.",
                           param=param)

    async def admit(self, num_prompts: int, req: _Sampling) -> None:
        """The checks that need no tokens, made before tokenizing: a full server answers at once,
        and a request over a limit (server/limits.py) before it costs anything. A constraint's
        check walks and re-encodes it (a 2,000-tool schema: tens of ms, seconds under CPU load):
        on a worker thread, so the event loop serves other requests meanwhile."""
        if req._structured_sources():
            await asyncio.to_thread(self.check_limits, req)
        else:
            self.check_limits(req)
        self.check_capacity(num_prompts, req)

    def check_capacity(self, num_prompts: int, req: _Sampling) -> None:
        """503 while the engine is not ready or the server is full; 400 for more sequences than it ever runs."""
        if self.client.state is not CoreState.READY:
            raise APIError(503, f"the engine is {self.client.state.value}", "ServiceUnavailableError",
                           headers={"Retry-After": str(self.s.retry_after_s)})
        total = num_prompts * req.n
        if total > self.s.max_pending_requests:  # could never be admitted: retrying cannot help
            raise APIError(400, f"the request has {total} sequences ({num_prompts} prompt(s) x n={req.n}) but the "
                                f"server runs at most {self.s.max_pending_requests} at once (--max-pending-requests)")
        if self.client.num_pending + total > self.s.max_pending_requests:
            self.metrics.rejected.labels(self.metrics.model, "503").inc()
            raise APIError(503, f"the server has {self.client.num_pending} requests in flight (limit "
                                f"{self.s.max_pending_requests}); retry later", "ServiceUnavailableError",
                           headers={"Retry-After": str(self.s.retry_after_s)})

    def check_limits(self, req: _Sampling) -> None:
        """400 for a request over one of --request-limits (server/limits.py)."""
        try:
            check_lists(req, self.s.limits)
            so = req.structured()
            if so is not None:
                req.constrain(checked=(so[0], check_constraint(so[0], so[1], self.s.limits)))
        except LimitExceeded as e:
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:  # a malformed structured_outputs
            raise APIError(400, str(e), param=(req._structured_sources() or [None])[0]) from None

    def _check_prompt(self, ids: list[int], req: _Sampling) -> None:
        info = self.client.info
        assert info is not None
        if not ids:
            raise APIError(400, "prompt is empty: it must contain at least one token", param="prompt")
        try:
            check_token_ids(ids, info.vocab_size, "token id")
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        limit = req._limit()
        if len(ids) >= info.max_model_len or (limit is not None and len(ids) + limit > info.max_model_len):
            raise APIError(400, f"This model's maximum context length is {info.max_model_len} tokens. However, you "
                                f"requested {len(ids) + (limit or 1)} tokens ({len(ids)} in the prompt, "
                                f"{limit or 1} in the completion). Reduce the prompt or the completion length.",
                           param="max_tokens" if limit and len(ids) < info.max_model_len else "prompt")

    # -- running ---------------------------------------------------------------------------
    async def submit(self, prompts: list[list[int]], req: _Sampling,
                     media: list[MMInputs | None] | None = None) -> list[Choice]:
        """Validates everything first, then queues n sequences per prompt in the core. `media`:
        each prompt's images (chat_prompts)."""
        self.check_capacity(len(prompts), req)  # again: tokenizing awaited, others may have come in meanwhile
        for ids in prompts:
            self._check_prompt(ids, req)
        info = self.client.info
        assert info is not None
        for name, ids in (("stop_token_ids", req.stop_token_ids), ("allowed_token_ids", req.allowed_token_ids),
                          ("logit_bias", [int(k) for k in req.logit_bias or ()])):
            try:
                check_token_ids(ids or (), info.vocab_size, f"{name} entry")
            except ValueError as e:
                raise APIError(400, str(e), param=name) from None
        if req.kv_transfer_params and len(prompts) * req.n > 1:
            raise APIError(400, "kv_transfer_params name one sequence: use n=1, one prompt", param="kv_transfer_params")
        total = len(prompts) * req.n
        base = req.request_id or uuid.uuid4().hex
        choices: list[Choice] = []
        try:
            params = [req.sampling_params(info.max_model_len - len(ids), j) for ids in prompts for j in range(req.n)]
            if self.s.sampling_defaults:
                params = [self.s.sampling_defaults.apply(req, p) for p in params]
        except ValueError as e:
            raise APIError(400, str(e)) from None
        stops = params[0].stop
        for i, ids in enumerate(prompts):
            for j in range(req.n):
                k = i * req.n + j
                rid = base if total == 1 and req.request_id else f"{base}-{k}"
                choices.append(Choice(k, rid, ids, IncrementalDetokenizer(
                    self.tok, req.skip_special_tokens, stops),
                    leader=choices[i * req.n] if j and req.prompt_logprobs is not None else None))
        if self.s.request_logger is not None:
            for c, p in zip(choices, params):
                self.s.request_logger.received(c.request_id, c.prompt_ids, p)
        queues = []
        # Bad words and grammars are prepared off the core's step loop (server/core_prep.py): wait
        # until the core has them, so a constraint that does not compile is a 400, streamed or not.
        prepared = needs_preparation(params[0])
        wires = [to_wire(mm) if mm is not None else None for mm in (media or [None] * len(prompts))]
        try:
            for c, p in zip(choices, params):
                extra = {"media": w} if (w := wires[c.index // req.n]) is not None else {}
                queues.append(await self.client.add(c.request_id, c.prompt_ids, p, priority=req.priority,
                                                    cache_salt=req.cache_salt,
                                                    session=req.prompt_cache_key or req.user,
                                                    kv_transfer_params=req.kv_transfer_params, ack=prepared,
                                                    lora=req.model if req.model in self.loras else None,
                                                    **extra))
        except EngineDeadError as e:
            await self.client.abort([c.request_id for c in choices])
            raise APIError(503, str(e), "ServiceUnavailableError") from None
        except ValueError as e:  # a request_id already in flight
            await self.client.abort([c.request_id for c in choices[:len(queues)]])
            raise APIError(400, str(e), param="request_id") from None
        for c, q in zip(choices, queues):
            c.queue = q
        if prepared:
            try:
                await self.client.accepted([c.request_id for c in choices])
            except EngineDeadError as e:
                raise APIError(503, str(e), "ServiceUnavailableError") from None
            except ValueError as e:
                await self.client.abort([c.request_id for c in choices])
                so = req.structured()
                raise APIError(400, str(e), param=so[0] if so else "bad_words") from None
        return choices

    def follow_reasoning(self, choices: list[Choice]) -> None:
        """Chat choices of a server with a reasoning parser: where each output starts."""
        if self._markers is not None:
            for c in choices:
                c.thinking_opened = prompt_opens(c.prompt_ids, *self._markers)

    def split_reasoning(self, c: Choice, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished choice's text; no parser: (None, text)."""
        if self.reasoning is None or c.thinking_opened is None:
            return None, text
        return self.reasoning.split(text, c.thinking_opened)

    async def tool_plan(self, req: Any) -> ToolPlan | None:
        """The request's tool plan (server/tools.py); a constrained choice is set on the request.
        Many tools make a big schema to build and check: then on a worker thread (`admit`'s reason)."""
        if len(req.tools or ()) > FEW_TOOLS:
            return await asyncio.to_thread(self._tool_plan, req)
        return self._tool_plan(req)

    def _tool_plan(self, req: Any) -> ToolPlan | None:
        try:
            tp = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, self.s.enable_auto_tool_choice,
                           self.s.tool_call_parser)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice" if req.tools else "tools") from None
        if tp is not None and tp.constraint is not None:
            try:
                req.constrain(tool_constraint=check_constraint("tools", tp.constraint, self.s.limits))
            except LimitExceeded as e:
                raise APIError(400, str(e), param=e.param) from None
            if len(req._structured_sources()) > 1:
                raise APIError(400, f"tool_choice {tp.mode!r} constrains the output itself: drop "
                                    f"{req._structured_sources()[0]}", param="tool_choice")
        return tp

    async def events(self, choices: list[Choice], arrival: float) -> AsyncIterator[tuple[Choice, str]]:
        """Yields (choice, new text) as deltas arrive, until every choice has finished. Aborts
        whatever is still running if the consumer stops early (a client disconnect)."""
        merged: asyncio.Queue[tuple[Choice, Any]] = asyncio.Queue()

        async def pump(c: Choice) -> None:
            while True:
                d = await c.queue.get()
                await merged.put((c, d))
                if isinstance(d, BaseException) or d.finished:
                    return

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        left = len(choices)
        ready: collections.deque[tuple[Choice, Any]] = collections.deque()  # deltas let through again
        held: dict[int, list[tuple[Choice, Any]]] = {}  # leader index -> its followers' deltas
        try:
            while left:
                c, d = ready.popleft() if ready else await merged.get()
                if isinstance(d, EngineDeadError):
                    raise APIError(503, f"engine failed: {d}", "ServiceUnavailableError")
                if isinstance(d, ValueError):
                    raise APIError(400, str(d))
                if isinstance(d, BaseException):
                    raise d
                if c.leader is not None and c.prompt_logprobs is None:
                    if c.leader.prompt_logprobs is None and c.leader.finish is None:
                        held.setdefault(c.leader.index, []).append((c, d))  # the leader's come first
                        continue
                    c.prompt_logprobs = c.leader.prompt_logprobs
                now = time.monotonic()
                if d.token_ids:
                    if c.first_token_at is None:
                        c.first_token_at = now
                    else:  # one engine step's tokens arrive in one delta: a gap per step, as vLLM counts
                        c.token_gaps.append(now - c.last_token_at)
                    c.last_token_at = now
                c.token_ids += d.token_ids
                c.logprobs += d.logprobs or []
                if d.prompt_logprobs is not None:
                    c.prompt_logprobs = d.prompt_logprobs
                if c.index in held and (c.prompt_logprobs is not None or d.finished):
                    ready.extend(held.pop(c.index))
                if not d.finished:
                    text = c.detok.add(d.token_ids)
                else:  # the last tokens may hold the stop string: take the engine's cut text
                    c.finish = d
                    left -= 1
                    text = c.detok.finish(self.final_text(c))
                    self.metrics.observe_request(arrival, c.first_token_at, now, len(c.token_ids), d.finish_reason,
                                                 len(c.prompt_ids), d.cached_by_tier, queue_s=d.queue_s,
                                                 prefill_s=d.prefill_s, token_gaps=tuple(c.token_gaps))
                    self._log_finished(c, d.finish_reason, d.cached_by_tier, arrival, now)
                yield c, text
            self.metrics.observe_group(max(len(c.token_ids) for c in choices))
        finally:
            for t in tasks:
                t.cancel()
            running = [c.request_id for c in choices if c.finish is None]
            if running:
                log.info("aborting %d unfinished sequence(s) (client gone or error)", len(running))
                now = time.monotonic()
                for c in choices:
                    if c.finish is None:
                        self.metrics.observe_abort()
                        self._log_finished(c, "abort", {}, arrival, now)
                await self.client.abort(running)

    def _log_finished(self, c: Choice, reason: str, cached_by_tier: dict[str, int], arrival: float, now: float) -> None:
        if self.s.request_logger is not None:
            ttft = None if c.first_token_at is None else c.first_token_at - arrival
            self.s.request_logger.finished(c.request_id, len(c.prompt_ids), cached_by_tier, len(c.token_ids), reason,
                                           ttft, now - arrival)

    def final_text(self, c: Choice) -> str:
        text = self.tok.decode(c.token_ids, skip_special_tokens=c.detok.skip)
        stop = c.finish.stop_reason if c.finish else None
        if isinstance(stop, str):
            at = text.find(stop)
            text = text[:at] if at >= 0 else text
        return text

    async def collect(self, request: Request, choices: list[Choice], arrival: float) -> None:
        """Runs a non-streaming request to the end; aborts it if the client disconnects."""
        async def drain() -> None:
            async for _ in self.events(choices, arrival):
                pass

        async def client_gone() -> None:
            # Waits for the ASGI disconnect message itself: request.is_disconnected() never sees
            # it behind a BaseHTTPMiddleware (the auth middleware), so a request whose client
            # had gone ran to its end.
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task = asyncio.create_task(drain())
        watch = asyncio.create_task(client_gone())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and watch.exception() is not None:  # cannot watch: run to the end
                await asyncio.wait({task})
        finally:
            watch.cancel()
            if not task.done():  # the client went away (or this handler was cancelled)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise APIError(499, "client disconnected")
        task.result()

def _check_error(choices: list[Choice]) -> None:
    for c in choices:
        if c.finish is not None and c.finish.finish_reason == "error":
            raise APIError(500, c.finish.error or "the request failed in the engine", "InternalServerError")


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
