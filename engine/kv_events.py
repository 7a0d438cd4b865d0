"""Publishes KV cache events on a ZMQ PUB socket as msgpack, once per engine step.

Opt in with `kv_events_config`, vLLM's keys: {"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://127.0.0.1:5557", "topic": "kv-events"}. Each message is three
frames: topic, an 8-byte big-endian sequence number (so subscribers detect drops), and
msgpack `[timestamp, [event, ...]]`, an event being `["BlockStored", hashes, parent,
token_ids, block_size, medium]` or `["BlockRemoved", hashes, medium]`.
"""
from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import Any

from kvstore.events import BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVEventsConfig:
    endpoint: str
    topic: str = "kv-events"
    hwm: int = 100_000  # ZMQ's send high-water mark: messages a slow subscriber may fall behind

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVEventsConfig | None:
        known = {"enable_kv_cache_events", "publisher", "endpoint", "topic", "hwm"}
        later = {"replay_endpoint", "buffer_steps", "max_queue_size"}  # vLLM's; not implemented here yet
        if set(d) & later:
            raise ValueError(f"kv_events_config keys {sorted(set(d) & later)} are not supported yet; "
                             f"supported: {sorted(known)}")
        if set(d) - known:
            raise ValueError(f"unknown kv_events_config keys {sorted(set(d) - known)}; known: {sorted(known)}")
        if not d.get("enable_kv_cache_events", False):
            return None
        if d.get("publisher", "zmq") != "zmq":
            raise ValueError(f"kv_events_config.publisher must be 'zmq'; got {d.get('publisher')!r}")
        if "endpoint" not in d:
            raise ValueError("kv_events_config needs an 'endpoint', e.g. tcp://127.0.0.1:5557")
        hwm = d.get("hwm", cls.hwm)
        if type(hwm) is not int or hwm < 0:
            raise ValueError(f"kv_events_config.hwm must be an integer >= 0; got {hwm!r}")
        return cls(str(d["endpoint"]), str(d.get("topic", "kv-events")), hwm)


def is_loopback(endpoint: str) -> bool:
    """Whether a ZMQ endpoint can only be reached from this machine (ipc://, inproc://, or tcp on
    a loopback address)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name or a host name: reachable from elsewhere
        return False


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
        self._sock.setsockopt(zmq.SNDHWM, config.hwm)
        if not is_loopback(config.endpoint):
            log.warning("KV events go to %s, reachable from other machines: every event carries the token ids "
                        "of the blocks it names, so subscribers can read prompts (cache_salt tenants included)",
                        config.endpoint)
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
