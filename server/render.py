"""vLLM's render endpoints: what a generation request would run, without running it.

`POST /v1/chat/completions/render` takes a chat completion request and answers vLLM's
`GenerateRequest` shape: {"request_id", "token_ids", "features": null, "sampling_params", "model",
"stream", "stream_options", "cache_salt", "priority", "kv_transfer_params": null}, plus "prompt":
the text of `token_ids` (decoded with special tokens; vLLM users asked for the rendered text).
`speculators prepare-data --render-endpoint URL` reads `token_ids` from it to derive loss masks.
`POST /v1/completions/render` does the same for a completion request: a list, one per prompt.

Both parse with the generation endpoint's own model (`api.parse`), so a field is implemented,
refused or harmless exactly as there, plus vLLM's `truncate_prompt_tokens` (N tokens kept, -1 for
as many as the context allows; more than that is a 400, as in vLLM) and `truncation_side` ("left"
keeps the last N, "right" the first N; default "left", vLLM's tokenizer default). The token ids are
checked as the generation endpoint checks them (empty, vocabulary, context length): what renders is
what `/v1/completions` would accept as a prompt.
"""
from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from server.api import API, APIError
from server.core import params_to_wire
from server.protocol import ChatCompletionRequest, CompletionRequest


class _Truncation(BaseModel):
    """vLLM's truncation fields: render only (the generation endpoints refuse them). A side without
    a count truncates nothing, as in vLLM."""
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, lt=2**63)
    truncation_side: Literal["left", "right"] | None = None


class ChatRenderRequest(ChatCompletionRequest, _Truncation):
    pass


class CompletionRenderRequest(CompletionRequest, _Truncation):
    pass


def add_render_routes(app: FastAPI, api: API) -> None:
    model_name = api.s.served_model_names[0]

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> dict[str, Any]:
        req: ChatRenderRequest = await api.parse(request, ChatRenderRequest)
        api.check_limits(req)  # what generation refuses unseen, this refuses too
        await api.tool_plan(req)  # a bad tools/tool_choice is a 400 here too; a forced call constrains the params
        (ids,), _ = await api.chat_prompts([req.messages], req)
        return _generate_request(api, req, ids, f"chatcmpl-{uuid.uuid4().hex}", model_name)

    @app.post("/v1/completions/render")
    async def render_completion(request: Request) -> list[dict[str, Any]]:
        req: CompletionRenderRequest = await api.parse(request, CompletionRenderRequest)
        api.check_limits(req)
        prompts = await api.text_ids(req.prompts())
        return [_generate_request(api, req, ids, f"cmpl-{uuid.uuid4().hex}", model_name) for ids in prompts]


def _generate_request(api: API, req: ChatRenderRequest | CompletionRenderRequest, ids: list[int], default_id: str, model_name: str) -> dict[str, Any]:
    if api.client.info is None:
        raise APIError(503, "the engine is not ready", "ServiceUnavailableError")
    ids = _truncate(api, req, ids)
    api._check_prompt(ids, req)  # what the generation endpoint would refuse, this refuses too
    room = api.client.info.max_model_len - len(ids)
    try:
        params = req.sampling_params(room)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    sampling = params_to_wire(params)  # shallow: a deeply nested schema must not recurse
    return {"request_id": req.request_id or default_id, "token_ids": ids, "features": None,
            "sampling_params": sampling, "model": req.model or model_name, "stream": bool(req.stream),
            "stream_options": req.stream_options.model_dump() if req.stream and req.stream_options else None,
            "cache_salt": req.cache_salt, "priority": req.priority, "kv_transfer_params": None,
            "prompt": api.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)}


def _truncate(api: API, req: ChatRenderRequest | CompletionRenderRequest, ids: list[int]) -> list[int]:
    """vLLM's truncation: keep `truncate_prompt_tokens` tokens from the `truncation_side` end."""
    n = req.truncate_prompt_tokens
    if n is None:
        return ids
    info = api.client.info
    assert info is not None
    # vLLM's bound: the context less the output the request asks for (at least one token here,
    # since the engine always generates one: a prompt of max_model_len tokens could never run).
    most = info.max_model_len - max(req._limit() or 0, 1)
    if n == -1:
        n = most
    if n > most:
        raise APIError(400, f"truncate_prompt_tokens={n} cannot be greater than max_model_len "
                            f"({info.max_model_len}) - max_tokens ({max(req._limit() or 0, 1)}) = {most}: "
                            "request a smaller truncation size", param="truncate_prompt_tokens")
    if n >= len(ids):
        return ids
    return ids[:n] if req.truncation_side == "right" else ids[len(ids) - n:]
