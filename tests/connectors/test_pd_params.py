"""kv_transfer_params parsing (connectors/pd.py): what a prefill and a decode replica accept."""
from __future__ import annotations

import pytest

from connectors.pd import PDRole, parse, prefill_response
from kvstore.keys import BlockKey

ROUTER_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def test_off_values_mean_no_disaggregation():
    assert parse(None) is None and parse({}) is None
    assert parse({"do_remote_decode": False, "do_remote_prefill": False, "remote_host": None}) is None


def test_the_routers_prefill_params_and_our_answer_round_trip():
    assert parse(ROUTER_PREFILL).role is PDRole.PREFILL
    keys = [BlockKey(bytes([i]) * 16) for i in range(3)]
    answer = prefill_response("ab" * 16, 48, keys)
    pd = parse(answer)
    assert pd.role is PDRole.DECODE and pd.namespace == "ab" * 16 and pd.tokens == 48 and list(pd.keys) == keys


@pytest.mark.parametrize("params, match", [
    ({"do_remote_decode": True, "do_remote_prefill": True}, "both"),
    ({"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_host": "10.0.0.1"}, "NIXL"),
    ({"do_remote_prefill": True, "kvtier": {"transport": "nixl"}}, "transport"),
    ({"do_remote_prefill": True, "kvtier": {"transport": "G4", "namespace": "00", "tokens": 16, "keys": ["zz"]}}, "hex"),
    ({"do_remote_prefill": True, "kvtier": {"transport": "G4", "tokens": 16, "keys": []}}, "namespace"),
    ({"do_remote_decode": True, "bootstrap_room": 7}, "bootstrap_room"),
    ({"do_remote_decode": True, "remote_engine_id": "e"}, "remote_engine_id"),
    ({"kvtier": {"transport": "G4"}}, "only read with do_remote_prefill"),
    ("yes", "object"),
])
def test_what_cannot_be_honoured_is_refused_by_name(params, match):
    with pytest.raises(ValueError, match=match):
        parse(params)
