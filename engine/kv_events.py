"""Publishes KV cache events on a ZMQ PUB socket as msgpack, once per engine step.

Opt in with `kv_events_config`, vLLM's keys: {"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://127.0.0.1:5557", "topic": "kv-events"}. Each message is three
frames: topic, an 8-byte big-endian sequence number (so subscribers detect drops), and
msgpack `[timestamp, [event, ...]]`, an event being `["BlockStored", hashes, parent,
token_ids, block_size, medium]` or `["BlockRemoved", hashes, medium]`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvstore.events import BlockRemoved, BlockStored, KVEvent


@dataclass(frozen=True)
class KVEventsConfig:
    endpoint: str
    topic: str = "kv-events"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVEventsConfig | None:
        known = {"enable_kv_cache_events", "publisher", "endpoint", "topic", "replay_endpoint", "buffer_steps",
                 "hwm", "max_queue_size"}
        if set(d) - known:
            raise ValueError(f"unknown kv_events_config keys {sorted(set(d) - known)}; known: {sorted(known)}")
        if not d.get("enable_kv_cache_events", False):
            return None
        if d.get("publisher", "zmq") != "zmq":
            raise ValueError(f"kv_events_config.publisher must be 'zmq'; got {d.get('publisher')!r}")
        if "endpoint" not in d:
            raise ValueError("kv_events_config needs an 'endpoint', e.g. tcp://127.0.0.1:5557")
        return cls(str(d["endpoint"]), str(d.get("topic", "kv-events")))


def encode(event: KVEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return ["BlockStored", event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                event.medium]
    assert isinstance(event, BlockRemoved)
    return ["BlockRemoved", event.block_hashes, event.medium]


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(config.endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(f"cannot bind kv events endpoint {config.endpoint!r}: {e}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = config.topic.encode()
        self._seq = 0

    def publish(self, events: list[KVEvent]) -> None:
        import msgpack

        if not events:
            return
        payload = msgpack.packb([time.time(), [encode(e) for e in events]], use_bin_type=True)
        self._sock.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload])
        self._seq += 1

    def close(self) -> None:
        self._sock.close()
