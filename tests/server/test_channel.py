"""The engine-core channel's typed messages round-trip through msgpack, keep the documented wire
shape, and a kind from the wrong direction (or garbage) is refused, not misread."""
from __future__ import annotations

import msgpack
import pytest

from server import channel as ch

TO_CORE = [ch.Add({"request_id": "r", "prompt_token_ids": [1, 2], "params": {"max_tokens": 3}, "priority": 0,
                   "cache_salt": None}), ch.Abort(["a", "b"]), ch.StatsQuery(7), ch.Shutdown(2.5)]
FROM_CORE = [ch.Ready({"max_model_len": 8, "vocab_size": 5, "num_gpu_blocks": 2, "eos_token_ids": [1]}),
             ch.StartupError("bad"), ch.Outputs([{"id": "r", "token_ids": [3], "logprobs": [{3: -0.1}]}]),
             ch.StatsReply(7, {"x": 1}), ch.AddError("r", "why"), ch.Heartbeat(0.25), ch.Stopped(), ch.Fatal("boom")]


@pytest.mark.parametrize("msg", TO_CORE)
def test_to_core_round_trip(msg):
    assert ch.decode_to_core(ch.encode(msg)) == msg
    with pytest.raises(ValueError):
        ch.decode_from_core(ch.encode(msg)) if not isinstance(msg, ch.StatsQuery) else ch.decode_to_core(b"\x90")


@pytest.mark.parametrize("msg", FROM_CORE)
def test_from_core_round_trip(msg):
    assert ch.decode_from_core(ch.encode(msg)) == msg


def test_wire_shape_is_the_documented_list():
    assert msgpack.unpackb(ch.encode(ch.Abort(["a"])), raw=False) == ["abort", ["a"]]
    assert msgpack.unpackb(ch.encode(ch.StatsReply(3, {})), raw=False) == ["stats", 3, {}]
    for junk in (msgpack.packb({"a": 1}), msgpack.packb(["nope"]), msgpack.packb([])):
        with pytest.raises(ValueError):
            ch.decode_from_core(junk)
