"""The HTTP routes. Each handler parses and validates, submits to the engine core through
`API`, and formats the answer as OpenAI does (SSE chunks when streaming)."""
from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from connectors.base import tier_entries
from server.api import API, VERSION, APIError, Choice, _check_error, error_response, sse
from server.api_output import heavy_output, json_response
from server.client import CoreState, EngineDeadError, StatsError
from server.lora_routes import add_lora_routes
from server.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from server.render import add_render_routes
from server.tools import ToolPlan
from server.tools import extract as extract_tool_calls

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DASHBOARD_HTML = (Path(__file__).parent / "static" / "dashboard.html").read_text()
# Its script and style are inline and it talks only to this server: nothing else may load or run.
DASHBOARD_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "Content-Security-Policy":
                     "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
                     "img-src 'self' data:; form-action 'none'; frame-ancestors 'none'"}

# /v1/kv/stats under --data-parallel-size: each core's own figures beside the merged ones
DP_STATS = ("num_running", "num_waiting", "prompt_tokens", "generation_tokens", "prefix_cache_queries",
            "prefix_cache_hits", "kv_cache_usage")


def build_app(api: API) -> FastAPI:
    app = FastAPI(title="kvtier", version=VERSION, docs_url="/docs", redoc_url=None)
    s = api.s
    model_name = s.served_model_names[0]

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(e.status_code, str(e.detail), "NotFoundError" if e.status_code == 404 else
                                       "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:  # a bug; uvicorn logs the traceback
        return error_response(APIError(500, f"internal error: {type(e).__name__}", "InternalServerError"))

    # With --api-key every route needs the key except these: load balancers probe /health without
    # one, and /metrics only with --metrics-no-auth (its gauges describe the traffic).
    # /dashboard is a static page with no data in it: it asks for the key and sends it with its
    # own requests, which need it like any other.
    open_paths = {"/health", "/ping", "/version", "/dashboard"} | ({"/metrics"} if s.metrics_no_auth else set())

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        # The route's own path: behind --root-path the URL's path starts with the proxy's prefix.
        path, root = request.scope["path"], request.scope.get("root_path", "")
        if s.api_key and (path[len(root):] if root and path.startswith(root) else path) not in open_paths:
            got = request.headers.get("authorization", "")
            if not secrets.compare_digest(got.encode(), f"Bearer {s.api_key}".encode()):
                return error_response(APIError(401, "invalid or missing API key", "authentication_error"))
        return await call_next(request)

    # -- service endpoints -----------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if api.client.state is CoreState.READY:
            return Response(status_code=200)
        why = f": {api.client.death}" if api.client.death else ""
        return error_response(APIError(503, f"engine core is {api.client.state.value}{why}", "ServiceUnavailableError"))

    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) name for /health
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> Response:
        return Response(DASHBOARD_HTML, media_type="text/html; charset=utf-8", headers=DASHBOARD_HEADERS)

    def model_card(name: str) -> dict[str, Any]:
        """A LoRA adapter's card names its folder as root and the base model as parent (vLLM's)."""
        info = api.client.info
        adapter = api.loras.path(name) if name not in s.served_model_names else None
        return {"id": name, "object": "model", "created": api.created, "owned_by": "kvtier",
                "root": adapter or s.model_path, "parent": model_name if adapter else None,
                "max_model_len": info.max_model_len if info else None}

    if s.allow_runtime_lora_updating:
        add_lora_routes(app, api)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in (*s.served_model_names, *api.loras.names())]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in s.served_model_names and model_id not in api.loras:
            raise APIError(404, f"The model `{model_id}` does not exist.", "NotFoundError", param="model")
        return model_card(model_id)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req: TokenizeRequest = await api.parse(request, TokenizeRequest)
        if req.messages is not None:
            (ids,), _ = await api.chat_prompts([req.messages], req, bound=False)  # counting is what it is for
        else:
            (ids,) = await api.text_ids([req.prompt], req.add_special_tokens, bound=False)
        info = api.client.info
        return {"count": len(ids), "max_model_len": info.max_model_len if info else None, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req: DetokenizeRequest = await api.parse(request, DetokenizeRequest)
        vocab = api.client.info.vocab_size if api.client.info else len(api.tok)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": api.tok.decode(req.tokens)}

    async def engine_stats() -> dict[str, Any]:
        try:
            return await api.client.stats()
        except (EngineDeadError, TimeoutError) as e:
            raise APIError(503, f"engine stats unavailable: {e}", "ServiceUnavailableError") from None
        except StatsError as e:
            raise APIError(500, f"engine stats could not be sent: {e}", "InternalServerError") from None

    @app.get("/metrics")
    async def metrics() -> Response:
        snap = None
        if api.client.state is CoreState.READY:
            try:
                snap = await api.client.stats()
            except (EngineDeadError, StatsError, TimeoutError):
                snap = None  # latencies still render; engine gauges are absent while it is down
        return Response(api.metrics.render(snap), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/kv/stats")
    async def kv_stats() -> dict[str, Any]:
        st = await engine_stats()
        tiers = dict(st.get("tiers") or {})
        g1 = {"num_blocks": st["num_gpu_blocks"], "usage": st["kv_cache_usage"], "free_blocks": st["num_free_blocks"],
              "prefix_cache_queries": st["prefix_cache_queries"], "prefix_cache_hits": st["prefix_cache_hits"],
              "evictions": st["num_evictions"], "cached_blocks": st["num_cached_blocks"],
              "groups": st.get("kv_groups", [])}
        tier_view = {"G1": g1, **{t: tiers.pop(t) for t in tier_entries(tiers)}}
        return {"model": model_name, "tiers": tier_view, "offload": tiers,
                "requests": {"running": st["num_running"], "waiting": st["num_waiting"],
                             "preemptions": st["num_preemptions"], "prompt_tokens": st["prompt_tokens"],
                             "generation_tokens": st["generation_tokens"]},
                "steps": {"busy_seconds": st["busy_seconds"], "forward_seconds": st["forward_seconds"],
                          "bubble_fraction": st["bubble_fraction"]},
                "spec_decode": st.get("spec_decode"),
                **({"data_parallel": [{k: core[k] for k in DP_STATS} for core in st["data_parallel"]]}
                   if "data_parallel" in st else {})}

    # -- generation ------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req: CompletionRequest = await api.parse(request, CompletionRequest)
        await api.admit(len(req.prompts()), req)
        prompts = await api.text_ids(req.prompts())
        choices = await api.submit(prompts, req)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "system_fingerprint": s.system_fingerprint}
        if req.stream:
            return StreamingResponse(_stream_completion(api, req, choices, arrival, head),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        await api.collect(request, choices, arrival)
        _check_error(choices)

        def body() -> dict[str, Any]:
            out = {**head, "choices": [
                {"index": c.index, "text": api.final_text(c), "finish_reason": api.finish_reason(c),
                 "logprobs": api.completion_logprobs(c) if req.logprobs is not None else None, **api.extras(c, req),
                 **_prompt_logprobs(api, req, c)}
                for c in choices], "usage": api.usage(choices, req.n)}
            kvp = api.transfer_params(choices)
            if kvp is not None:
                out["kv_transfer_params"] = kvp
            return out
        return await json_response(body, heavy_output(req))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        arrival = time.monotonic()
        req: ChatCompletionRequest = await api.parse(request, ChatCompletionRequest)
        await api.admit(1, req)
        tools = await api.tool_plan(req)
        ids, media = await api.chat_prompts([req.messages], req)
        choices = await api.submit(ids, req, media)
        api.follow_reasoning(choices)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name,
                "system_fingerprint": s.system_fingerprint}
        if req.stream:
            return StreamingResponse(_stream_chat(api, req, choices, arrival, head, tools),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        await api.collect(request, choices, arrival)
        _check_error(choices)
        return await json_response(lambda: _chat_body(api, req, choices, head, tools), heavy_output(req))

    @app.post("/v1/chat/completions/batch")
    async def chat_batch(request: Request) -> Response:
        arrival = time.monotonic()
        req: BatchChatCompletionRequest = await api.parse(request, BatchChatCompletionRequest)
        await api.admit(len(req.messages), req)
        tools = await api.tool_plan(req)
        ids, media = await api.chat_prompts(req.messages, req)
        choices = await api.submit(ids, req, media)
        api.follow_reasoning(choices)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model_name,
                "system_fingerprint": s.system_fingerprint}
        await api.collect(request, choices, arrival)
        _check_error(choices)
        return await json_response(lambda: _chat_body(api, req, choices, head, tools), heavy_output(req))

    add_render_routes(app, api)  # vLLM's /v1/chat/completions/render and /v1/completions/render
    return app


def _message(api: API, c: Choice, tools: ToolPlan | None, include_reasoning: bool = True
             ) -> tuple[dict[str, Any], str | None]:
    """A finished choice's assistant message (its reasoning split off, with the calls `tools`
    finds in the rest) and finish reason."""
    reasoning, text = api.split_reasoning(c, api.final_text(c))
    reason = api.finish_reason(c)
    content, calls = extract_tool_calls(tools, text or "") if tools is not None else (text, [])
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None and include_reasoning:
        msg.update(_reasoning_fields(reasoning))
    if calls:
        msg["tool_calls"] = calls
        reason = "tool_calls" if reason == "stop" else reason
    return msg, reason


def _reasoning_fields(text: str) -> dict[str, str]:
    # vLLM moved from DeepSeek's `reasoning_content` to `reasoning`; clients read either.
    return {"reasoning_content": text, "reasoning": text}


def _prompt_logprobs(api: API, req: Any, c: Choice) -> dict[str, Any]:
    return {"prompt_logprobs": api.prompt_logprobs(c)} if req.prompt_logprobs is not None else {}


def _chat_body(api: API, req: Any, choices: list[Choice], head: dict[str, Any],
               tools: ToolPlan | None = None) -> dict[str, Any]:
    # vLLM puts a chat response's prompt_logprobs beside its choices; the batch endpoint's
    # choices answer different prompts, so there each choice has its own.
    batch = isinstance(req, BatchChatCompletionRequest)
    body = {**head, "object": "chat.completion", "choices": [
        {"index": c.index, "message": msg, "finish_reason": reason,
         "logprobs": api.chat_logprobs(c, req.top_logprobs or 0) if req.logprobs else None, **api.extras(c, req),
         **(_prompt_logprobs(api, req, c) if batch else {})}
        for c in choices for msg, reason in [_message(api, c, tools, req.include_reasoning)]],
        "usage": api.usage(choices, req.n), **({} if batch else _prompt_logprobs(api, req, choices[0]))}
    kvp = api.transfer_params(choices)
    if kvp is not None:
        body["kv_transfer_params"] = kvp
    return body


async def _stream_errors(gen: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Errors after the 200 went out become an SSE error event, then [DONE]."""
    try:
        async for chunk in gen:
            yield chunk
    except APIError as e:
        yield sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.status}})
    yield b"data: [DONE]\n\n"


def _usage_chunk(api: API, req: Any, choices: list[Choice], head: dict[str, Any]) -> bytes | None:
    if req.stream_options is not None and req.stream_options.include_usage:
        return sse({**head, "choices": [], "usage": api.usage(choices, req.n)})
    return None


def _stream(api: API, req: Any, choices: list[Choice], arrival: float, head: dict[str, Any],
            body: Callable[[Choice, str, int, int], dict[str, Any] | None], preamble: list[bytes],
            buffered: bool = False) -> AsyncIterator[bytes]:
    """SSE chunks: `preamble`, then one chunk per delta with text (or a finish), shaped by
    `body(choice, text, first token index, text offset)` (None: nothing to send yet), then the
    usage chunk if asked. `buffered`: one chunk per choice, at its finish (tool calls are known
    only then)."""
    continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats

    async def gen() -> AsyncIterator[bytes]:
        for chunk in preamble:
            yield chunk
        sent = {c.index: 0 for c in choices}  # tokens already covered by a chunk, for logprobs
        offsets = {c.index: 0 for c in choices}
        async for c, text in api.events(choices, arrival):
            done = c.finish is not None
            if (not text or buffered) and not done:
                continue
            choice = body(c, text, sent[c.index], offsets[c.index])
            if choice is None:
                continue
            if not sent[c.index] and not offsets[c.index]:  # the choice's first chunk
                choice.update(_prompt_logprobs(api, req, c))
            sent[c.index] = len(c.token_ids)
            offsets[c.index] += len(text)
            if done:
                choice.update(api.extras(c, req))
            chunk: dict[str, Any] = {**head, "choices": [choice]}
            if done and (kvp := api.transfer_params([c])) is not None:
                chunk["kv_transfer_params"] = kvp
            if continuous:  # vLLM's stream_options.continuous_usage_stats: usage so far, in every chunk
                chunk["usage"] = api.usage(choices, req.n)
            yield sse(chunk)
        usage = _usage_chunk(api, req, choices, head)
        if usage:
            yield usage
    return _stream_errors(gen())


def _stream_completion(api: API, req: CompletionRequest, choices: list[Choice], arrival: float,
                       head: dict[str, Any]) -> AsyncIterator[bytes]:
    def body(c: Choice, text: str, start: int, offset: int) -> dict[str, Any]:
        lp = api.completion_logprobs(c, start, offset) if req.logprobs is not None else None
        return {"index": c.index, "text": text, "finish_reason": api.finish_reason(c), "logprobs": lp}
    return _stream(api, req, choices, arrival, head, body, [])


def _stream_chat(api: API, req: ChatCompletionRequest, choices: list[Choice], arrival: float,
                 head: dict[str, Any], tools: ToolPlan | None = None) -> AsyncIterator[bytes]:
    head = {**head, "object": "chat.completion.chunk"}
    buffered = tools is not None and tools.mode != "none"
    splits = {c.index: api.reasoning.stream(c.thinking_opened) for c in choices
              if api.reasoning is not None and c.thinking_opened is not None and not buffered}

    def body(c: Choice, text: str, start: int, _offset: int) -> dict[str, Any] | None:
        lp = api.chat_logprobs(c, req.top_logprobs or 0, start) if req.logprobs else None
        if not buffered:
            delta: dict[str, Any] = {"content": text} if text else {}
            if (split := splits.get(c.index)) is not None:
                reasoning, content = split.feed(text)
                if c.finish is not None:
                    r2, c2 = split.finish()
                    reasoning, content = reasoning + r2, content + c2
                delta = {"content": content} if content else {}
                if reasoning and req.include_reasoning:
                    delta.update(_reasoning_fields(reasoning))
                if not delta and c.finish is None:
                    return None  # held back: it may be the beginning of a marker
            return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": api.finish_reason(c)}
        msg, reason = _message(api, c, tools, req.include_reasoning)  # the whole output, at its finish
        delta = {k: v for k, v in msg.items() if k != "role" and v is not None}
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
        return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": reason}
    roles = [sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}]}) for c in choices]
    return _stream(api, req, choices, arrival, head, body, roles, buffered)
