"""Publishes KV cache events on a ZMQ PUB socket as msgpack, once per engine step.

Opt in with `kv_events_config`, vLLM's keys: {"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://127.0.0.1:5557", "topic": ""} (vLLM's default topic). Each message is three
frames: topic, an 8-byte big-endian sequence number (so subscribers detect drops), and the
payload.

The payload is byte for byte what vLLM 0.32 sends (vllm/distributed/kv_events.py, msgspec
structs): `EventBatch` is `array_like`, so `[ts, [event, ...], data_parallel_rank]`, the rank
0 here as from a vLLM engine without data parallelism (its publisher fills in its rank before
encoding); each event is `tag=True, omit_defaults=True` and not array_like, so a map
whose first key "type" is the class name, then the fields in declaration order, required ones
always (None as nil) and defaulted ones only when set:

    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
     "token_ids": [...], "block_size": n, "lora_id": i | nil, "medium": m, "lora_name": s | nil,
     "locality": l}                         # "locality" only where the tier has one
    {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": m, "locality": l}

`lora_name`/`lora_id` name the LoRA adapter the blocks were computed under (`kvstore.events.LoRATag`:
the id comes from the digest of its files), nil for the base model.
Hashes are the 16-byte G1 block keys as msgpack bin (vLLM's ExternalBlockHash is bytes or int).
`medium` / `locality` come from the tier (`kvstore.events.TierKind`): G1 "GPU"; G2 "CPU",
"LOCAL"; G3 "STORAGE", "LOCAL"; G4 "STORAGE", "REMOTE".
"""
from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass
from typing import Any

from engine.kv.kv_events_replay import ReplayServer
from kvstore.events import DEFAULT_TOPIC, BlockRemoved, BlockStored, EventBuffer, KVEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVEventsConfig:
    endpoint: str
    topic: str = DEFAULT_TOPIC
    hwm: int = 100_000  # ZMQ's send high-water mark: messages a slow subscriber may fall behind
    replay_endpoint: str | None = None  # vLLM's: a ROUTER answering subscribers that missed batches
    buffer_steps: int = 10_000  # vLLM's default: batches kept for replay

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVEventsConfig | None:
        known = {"enable_kv_cache_events", "publisher", "endpoint", "topic", "hwm", "replay_endpoint", "buffer_steps"}
        later = {"max_queue_size"}  # vLLM's publisher-thread queue; events are published on the step here
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
        steps = d.get("buffer_steps", cls.buffer_steps)
        if type(steps) is not int or steps < 1:
            raise ValueError(f"kv_events_config.buffer_steps must be an integer >= 1; got {steps!r}")
        replay = d.get("replay_endpoint")
        if replay is not None and not isinstance(replay, str):
            raise ValueError(f"kv_events_config.replay_endpoint must be a ZMQ endpoint string; got {replay!r}")
        return cls(str(d["endpoint"]), str(d.get("topic", cls.topic)), hwm, replay, steps)


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


def encode(event: KVEvent) -> dict[str, Any]:
    """The event as msgspec encodes vLLM's struct of the same name (see the module docstring):
    keys in vLLM's declaration order, since that is the order msgspec writes them in."""
    out: dict[str, Any]
    if isinstance(event, BlockStored):
        out = {"type": "BlockStored", "block_hashes": list(event.block_hashes),
               "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
               "block_size": event.block_size, "lora_id": event.lora.id if event.lora else None,
               "medium": event.tier.medium, "lora_name": event.lora.name if event.lora else None}
    else:
        assert isinstance(event, BlockRemoved)
        out = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.tier.medium}
    if event.tier.locality is not None:  # a defaulted field: omitted when None (omit_defaults)
        out["locality"] = event.tier.locality
    return out


DATA_PARALLEL_RANK = 0  # one engine: vLLM's publisher sends its rank, 0, in every batch


def encode_batch(events: list[KVEvent], ts: float) -> bytes:
    """vLLM's `KVEventBatch` payload: `[ts, [event, ...], data_parallel_rank]`."""
    import msgpack

    return msgpack.packb([float(ts), [encode(e) for e in events], DATA_PARALLEL_RANK], use_bin_type=True)


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
        self.replay: ReplayServer | None = None
        if config.replay_endpoint is not None:
            try:
                self.replay = ReplayServer(self._ctx, config.replay_endpoint, self._topic, config.buffer_steps)
            except ValueError:
                self._sock.close()
                raise

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        payload = encode_batch(events, time.time())
        self._sock.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload])
        if self.replay is not None:
            self.replay.record(self._seq, payload)
        self._seq += 1

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
        self._sock.close()


def open_events(config: dict[str, Any] | None) -> tuple[EventBuffer | None, ZmqEventPublisher | None]:
    """The engine's event buffer and publisher for `kv_events_config` (both None when it is off)."""
    cfg = KVEventsConfig.from_dict(config or {})
    if cfg is None:
        return None, None
    publisher = ZmqEventPublisher(cfg)
    log.info("KV events published on %s (topic %r)%s", publisher.endpoint, cfg.topic,
             f", replay on {publisher.replay.endpoint} (last {cfg.buffer_steps} batches)" if publisher.replay else "")
    return EventBuffer(), publisher
