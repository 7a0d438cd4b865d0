"""MultiConnector: several connectors behind one, as vLLM's MultiConnector.

Loads: the first connector (in order) that offers external tokens for a request serves all
of that request's load; the others are told about the allocation with zero external tokens.
Stores and worker-side hooks go to every connector; their kv_transfer_params are merged (later
keys win).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from connectors.base import ConnectorMeta, FinishedTransfers, KVConnector


@dataclass
class MultiMeta(ConnectorMeta):
    parts: list[ConnectorMeta] = field(default_factory=list)


class MultiConnector(KVConnector):
    def __init__(self, connectors: list[KVConnector]) -> None:
        if not connectors:
            raise ValueError("MultiConnector needs at least one connector")
        self.connectors = connectors
        self._loader: dict[str, int] = {}  # request id -> index of the connector loading it

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        for i, c in enumerate(self.connectors):
            n, is_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if n > 0:
                self._loader[request.request_id] = i
                return n, is_async
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        chosen = self._loader.get(request.request_id)
        for i, c in enumerate(self.connectors):
            c.update_state_after_alloc(request, block_ids, num_external_tokens if i == chosen else 0)

    def take_load_split(self, req_id):
        for c in self.connectors:
            split = c.take_load_split(req_id)
            if split:
                return split
        return {}

    def build_connector_meta(self, scheduled):
        return MultiMeta(parts=[c.build_connector_meta(scheduled) for c in self.connectors])

    def check_pd(self, pd):
        errors = []
        for c in self.connectors:  # one connector that can play the role is enough
            try:
                return c.check_pd(pd)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if errors else "no connector supports kv_transfer_params")

    def request_finished(self, request, block_ids):
        self._loader.pop(request.request_id, None)
        params = None
        for c in self.connectors:
            p = c.request_finished(request, block_ids)
            if p:
                params = {**(params or {}), **p}
        return params

    def register_kv_caches(self, kv_cache):
        for c in self.connectors:
            c.register_kv_caches(kv_cache)

    def register_hidden_cache(self, hidden_cache):
        for c in self.connectors:
            c.register_hidden_cache(hidden_cache)

    def start_load_kv(self, meta: MultiMeta) -> None:
        for c, m in zip(self.connectors, meta.parts):
            c.start_load_kv(m)

    def wait_for_save(self, meta: MultiMeta) -> None:
        for c, m in zip(self.connectors, meta.parts):
            c.wait_for_save(m)

    def get_finished(self):
        return FinishedTransfers(frozenset().union(*(c.get_finished().loaded for c in self.connectors)))

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed: set[int] = set()
        for c in self.connectors:
            failed |= c.get_block_ids_with_load_errors()
        return failed

    def busy(self) -> bool:
        return any(c.busy() for c in self.connectors)

    def wait_for_progress(self, timeout: float) -> None:
        # One child's signal is enough to wake on; the engine polls them all right after.
        busy = [c for c in self.connectors if c.busy()] or self.connectors
        busy[0].wait_for_progress(timeout)

    def flush(self) -> None:
        for c in self.connectors:
            c.flush()

    def wait_for_outputs(self) -> None:
        for c in self.connectors:
            c.wait_for_outputs()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for c in self.connectors:
            out.update(c.stats())
        return out

    def close(self) -> None:
        for c in self.connectors:
            c.close()
