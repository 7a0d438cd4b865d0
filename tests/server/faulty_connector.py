"""A connector plugin with a bug (loaded by kv_connector_module_path in test_hardening.py): it
raises inside the engine's step when a request's prompt is TRIGGER. The engine cannot blame that
on the request, so the core must die loudly rather than report a clean stop."""
from __future__ import annotations

from connectors.base import ConnectorMeta, FinishedTransfers, KVConnector

TRIGGER = [5, 4, 3, 2, 1]


class FaultyConnector(KVConnector):
    def __init__(self, ctx) -> None:  # noqa: ANN001 - ConnectorContext
        self.ctx = ctx

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        return None

    def build_connector_meta(self, scheduled):
        if any(req.prompt_token_ids == TRIGGER for req, _, _ in scheduled):
            raise RuntimeError("FaultyConnector: a plugin bug")
        return ConnectorMeta()

    def get_finished(self):
        return FinishedTransfers()


class OddStatsConnector(FaultyConnector):
    """Works, but reports a stat the core's channel cannot carry (a numpy float32), as G3's batch
    reader once did: the stats query must fail alone, not the core."""

    def build_connector_meta(self, scheduled):
        return ConnectorMeta()

    def stats(self):
        import numpy as np

        return {"odd": {"read_s": np.float32(0.25)}}
