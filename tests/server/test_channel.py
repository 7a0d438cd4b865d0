"""The engine-core channel's typed messages round-trip through msgpack, keep the documented wire
shape, and a wrong version, an unknown type, a missing or unknown field, a wrong type, a kind
from the wrong direction or garbage is refused with a message that names it, never misread."""
from __future__ import annotations

import typing

import msgpack
import pytest

from server import channel as ch

FULL_DELTA = ch.Delta("r", [3, 4], [{3: -0.1, 9: -2.5}, {4: -0.2}], [[1, {5: -0.5, 7: -1.0}]], finish_reason="stop",
                      stop_reason="###", error=None, num_cached_tokens=16, cached_by_tier={"G1": 16},
                      kv_transfer_params={"do_remote_decode": True}, queue_s=0.01, prefill_s=0.02, thinking_tokens=3,
                      thinking_forced_tokens=1)
TO_CORE = [ch.AddRequest("r", [1, 2], {"max_tokens": 3}, 1, "salt", "user-1", {"do_remote_prefill": True}),
           ch.AddRequest("r", [1, 2], {"max_tokens": 3}), ch.Abort(["a", "b"]), ch.StatsQuery(7), ch.Shutdown(2.5),
           ch.LoRAUpdate(3, "a", "/adapters/a", True), ch.LoRAUpdate(4, "a")]
FROM_CORE = [ch.Ready(ch.EngineInfo(8, 5, 2, (1, 2), 16)), ch.StartupError("bad"),
             ch.Outputs([ch.Delta("r", [3]), FULL_DELTA]), ch.StatsReply(7, {"x": 1}), ch.LoRAReply(3),
             ch.LoRAReply(4, "not loaded", unknown=True), ch.AddError("r", "why"),
             ch.AddError(None, "no id"), ch.Accepted("r"), ch.Heartbeat(0.25), ch.Stopped(), ch.Fatal("boom")]


def test_every_message_type_is_covered():
    union_members = set(typing.get_args(ch.ToCore)) | set(typing.get_args(ch.FromCore))
    assert {type(m) for m in TO_CORE + FROM_CORE} == union_members


@pytest.mark.parametrize("msg", TO_CORE, ids=lambda m: type(m).__name__)
def test_to_core_round_trip_and_wrong_direction(msg):
    assert ch.decode_to_core(ch.encode(msg)) == msg
    with pytest.raises(ValueError, match="core -> API"):
        ch.decode_from_core(ch.encode(msg))


@pytest.mark.parametrize("msg", FROM_CORE, ids=lambda m: type(m).__name__)
def test_from_core_round_trip_and_wrong_direction(msg):
    assert ch.decode_from_core(ch.encode(msg)) == msg
    with pytest.raises(ValueError, match="API -> core"):
        ch.decode_to_core(ch.encode(msg))


def test_wire_shape_is_version_then_named_fields():
    assert msgpack.unpackb(ch.encode(ch.Abort(["a"])), raw=False) == [ch.PROTOCOL_VERSION,
                                                                      {"type": "abort", "request_ids": ["a"]}]
    # defaults are left out: a decode step's delta is its id and tokens
    assert msgpack.unpackb(ch.encode(ch.Outputs([ch.Delta("r", [3])])), raw=False)[1] == \
        {"type": "outputs", "deltas": [{"id": "r", "token_ids": [3]}]}


def _wire(body, version=ch.PROTOCOL_VERSION) -> bytes:
    return msgpack.packb([version, body])


def test_a_wrong_version_is_refused_naming_both():
    with pytest.raises(ValueError, match=f"version 99 .*speaks {ch.PROTOCOL_VERSION}"):
        ch.decode_to_core(_wire({"type": "abort", "request_ids": []}, version=99))


def test_an_unknown_type_is_refused_naming_it():
    with pytest.raises(ValueError, match="'launch_missiles'"):
        ch.decode_to_core(_wire({"type": "launch_missiles"}))


def test_a_missing_field_is_refused_naming_it():
    with pytest.raises(ValueError, match="`prompt_token_ids`"):
        ch.decode_to_core(_wire({"type": "add", "request_id": "r", "params": {}}))
    with pytest.raises(ValueError, match=r"`token_ids` - at `\$\.deltas\[0\]`"):
        ch.decode_from_core(_wire({"type": "outputs", "deltas": [{"id": "r"}]}))


def test_an_unknown_field_and_a_wrong_type_are_refused_naming_them():
    with pytest.raises(ValueError, match="`bogus`"):
        ch.decode_to_core(_wire({"type": "shutdown", "grace_s": 1.0, "bogus": 1}))
    with pytest.raises(ValueError, match=r"Expected `int`.*\$\.prompt_token_ids\[1\]"):
        ch.decode_to_core(_wire({"type": "add", "request_id": "r", "prompt_token_ids": [1, "x"], "params": {}}))


@pytest.mark.parametrize("junk", [b"", b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([]), msgpack.packb(["abort"]),
                                  msgpack.packb([1])])
def test_garbage_is_refused(junk):
    with pytest.raises(ValueError):
        ch.decode_from_core(junk)


def test_a_value_that_does_not_fit_fails_before_sending():
    with pytest.raises((TypeError, OverflowError, ValueError)):
        ch.encode(ch.AddRequest("r", [1 << 70], {}))
