"""LoRA adapters served by name: which ones (`LoRACatalog`), and vLLM's routes that change them at
run time, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (only with
--allow-runtime-lora-updating, as vLLM only serves them with $VLLM_ALLOW_RUNTIME_LORA_UPDATING).

A change reaches the catalog only after every engine core took it (server/core.py
`_lora_update`: the adapter is read, checked against the LoRA flags and in its slot), so a name the
API routes to is always loaded in the core; loads and unloads run one at a time.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from server.client import EngineDeadError
from server.errors import APIError

if TYPE_CHECKING:
    from server.api import API

log = logging.getLogger(__name__)


class LoRACatalog:
    """Adapter name -> its folder, for the adapters the server routes to. Owns only that map."""

    def __init__(self, modules: Iterable[tuple[str, str]]) -> None:
        self._paths = dict(modules)
        self.lock = asyncio.Lock()  # one load or unload at a time

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    def names(self) -> tuple[str, ...]:
        return tuple(self._paths)

    def path(self, name: str) -> str | None:
        return self._paths.get(name)

    def put(self, name: str, path: str) -> None:
        self._paths[name] = path

    def drop(self, name: str) -> None:
        del self._paths[name]


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; accepted and unused (the name is the key)


def add_lora_routes(app: FastAPI, api: API) -> None:
    catalog = api.loras

    async def update(name: str, path: str | None, load_inplace: bool = False) -> None:
        try:
            reply = await api.client.update_lora(name, path, load_inplace)
        except EngineDeadError as e:
            raise APIError(503, str(e), "ServiceUnavailableError") from None
        except TimeoutError:
            raise APIError(503, f"the engine core did not answer the LoRA update of {name!r} in time",
                           "ServiceUnavailableError") from None
        if reply.error is not None:
            if reply.unknown:
                raise APIError(404, reply.error, "NotFoundError", param="lora_name")
            raise APIError(400, reply.error, param="lora_name")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        req: LoadLoRAAdapterRequest = await api.parse(request, LoadLoRAAdapterRequest)
        if req.lora_name in api.s.served_model_names:
            raise APIError(400, f"{req.lora_name!r} is the base model's served name", param="lora_name")
        async with catalog.lock:
            await update(req.lora_name, req.lora_path, req.load_inplace)
            catalog.put(req.lora_name, req.lora_path)
        log.info("LoRA adapter %r loaded from %s at run time", req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        req: UnloadLoRAAdapterRequest = await api.parse(request, UnloadLoRAAdapterRequest)
        async with catalog.lock:
            await update(req.lora_name, None)
            if req.lora_name in catalog:
                catalog.drop(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
