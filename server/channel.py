"""The engine-core channel: typed messages between the API process and the engine-core process.

On the wire each message is a msgpack list, its kind first and then its fields in the order
below (so the schema is this file). Two sockets, one direction each; `decode_to_core` and
`decode_from_core` refuse a kind that does not belong to their direction.

API -> core:
  Add       ["add", {request_id, prompt_token_ids, params, priority, cache_salt, session, kv_transfer_params}]
  Abort     ["abort", [request_id, ...]]
  StatsQuery ["stats", nonce]
  Shutdown  ["shutdown", grace_s]   finish running requests for up to grace_s, abort the rest,
                                    flush offload writes, exit 0
Core -> API:
  Ready        ["ready", {max_model_len, vocab_size, num_gpu_blocks, eos_token_ids}]
  StartupError ["startup_error", message]   configuration rejected; the process exits 2
  Outputs      ["outputs", [delta, ...]]    per request: new token ids and logprobs since the last
                                            delta, and on finish the reason, cached-token counts
                                            and transfer params (see `server.core.CoreLoop._delta`)
  StatsReply   ["stats", nonce, {...}]
  AddError     ["add_error", request_id, message]
  Accepted     ["accepted", request_id]         a request that needed preparation (bad words, a grammar:
                                            server/core_prep.py) is built and scheduled
  Heartbeat    ["heartbeat", loop_age_s]    every HEARTBEAT_INTERVAL_S from a thread of its own:
                                            seconds since the step loop last went round
  Stopped      ["stopped"]                  after a requested shutdown only
  Fatal        ["fatal", message]           the loop raised: the core exits 1 (a death, not a stop)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack


@dataclass(frozen=True)
class Add:
    KIND: ClassVar[str] = "add"
    request: dict[str, Any]  # request_id, prompt_token_ids, params (SamplingParams fields), priority, cache_salt, session, kv_transfer_params


@dataclass(frozen=True)
class Abort:
    KIND: ClassVar[str] = "abort"
    request_ids: list[str]


@dataclass(frozen=True)
class StatsQuery:
    KIND: ClassVar[str] = "stats"
    nonce: int


@dataclass(frozen=True)
class Shutdown:
    KIND: ClassVar[str] = "shutdown"
    grace_s: float


@dataclass(frozen=True)
class Ready:
    KIND: ClassVar[str] = "ready"
    info: dict[str, Any]  # max_model_len, vocab_size, num_gpu_blocks, eos_token_ids


@dataclass(frozen=True)
class StartupError:
    KIND: ClassVar[str] = "startup_error"
    message: str


@dataclass(frozen=True)
class Outputs:
    KIND: ClassVar[str] = "outputs"
    deltas: list[dict[str, Any]]


@dataclass(frozen=True)
class StatsReply:
    KIND: ClassVar[str] = "stats"
    nonce: int
    stats: dict[str, Any]


@dataclass(frozen=True)
class AddError:
    KIND: ClassVar[str] = "add_error"
    request_id: str | None
    message: str


@dataclass(frozen=True)
class Accepted:
    KIND: ClassVar[str] = "accepted"
    request_id: str


@dataclass(frozen=True)
class Heartbeat:
    KIND: ClassVar[str] = "heartbeat"
    loop_age_s: float


@dataclass(frozen=True)
class Stopped:
    KIND: ClassVar[str] = "stopped"


@dataclass(frozen=True)
class Fatal:
    KIND: ClassVar[str] = "fatal"
    message: str


ToCore = Add | Abort | StatsQuery | Shutdown
FromCore = Ready | StartupError | Outputs | StatsReply | AddError | Accepted | Heartbeat | Stopped | Fatal
_TO_CORE = {c.KIND: c for c in (Add, Abort, StatsQuery, Shutdown)}
_FROM_CORE = {c.KIND: c for c in (Ready, StartupError, Outputs, StatsReply, AddError, Accepted, Heartbeat, Stopped,
                                   Fatal)}


def encode(msg: ToCore | FromCore) -> bytes:
    """The wire bytes of `msg`. Raises (OverflowError, TypeError, ValueError, ...) for a value
    msgpack cannot carry, before anything is sent."""
    return msgpack.packb([msg.KIND, *(getattr(msg, f.name) for f in dataclasses.fields(msg))], use_bin_type=True)


def _decode(data: bytes, kinds: dict[str, type]) -> Any:
    # strict_map_key=False: logprob maps are keyed by token id.
    raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(raw, list) or not raw or raw[0] not in kinds:
        raise ValueError(f"not a channel message for this direction: {str(raw)[:80]}")
    return kinds[raw[0]](*raw[1:])


def decode_to_core(data: bytes) -> ToCore:
    return _decode(data, _TO_CORE)


def decode_from_core(data: bytes) -> FromCore:
    return _decode(data, _FROM_CORE)
