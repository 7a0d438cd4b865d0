"""The engine-core channel: typed messages between the API process and the engine-core process.

Every message is a `msgspec.Struct` below, and this file is the schema. On the wire a message is
msgpack `[PROTOCOL_VERSION, {"type": KIND, field: value, ...}]`, with fields by name and fields at
their defaults left out. Decoding checks the version first, then validates the message against
the direction's union: a wrong version, an unknown type, a missing or unknown field, or a value of
the wrong type is a `ValueError` that names it. msgspec rather than dataclasses over msgpack:
its decoder validates types and names the field and path of an error in C, and it encodes a
step's deltas faster than building dicts did.

API -> core: AddRequest, Abort, StatsQuery, Shutdown (finish running requests for up to grace_s,
abort the rest, flush offload writes, exit 0), LoRAUpdate (load or unload an adapter at run time).
Core -> API: Ready (`engine.core.stats.EngineInfo`), StartupError (configuration rejected; the process
exits 2), Outputs (a `Delta` per request that advanced this step), StatsReply, AddError, Accepted
(a request that needed preparation, bad words or a grammar: server/core_prep.py, is built and
scheduled), LoRAReply (a LoRAUpdate's outcome), Heartbeat (from a thread of its own every HEARTBEAT_INTERVAL_S: seconds since the step
loop last went round), Stopped (after a requested shutdown only), Fatal (the loop raised: the core
exits 1, a death, not a stop).

Both processes run from one install, so a version mismatch means a stale process; it is refused,
never half-read. Bump PROTOCOL_VERSION with any change to a message.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from engine.core.stats import EngineInfo  # a frozen dataclass: msgspec carries it as it is

PROTOCOL_VERSION = 2


class Message(msgspec.Struct, frozen=True, tag_field="type", forbid_unknown_fields=True, omit_defaults=True):
    """A channel message; `type` on the wire is its class's tag."""


class MediaItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One image of a prompt (engine/mm/inputs.py MMItem): its placeholders, digest and pixel
    values as raw bytes (rebuilt with a dtype from a fixed list: never unpickled)."""
    offset: int
    length: int
    digest: bytes
    shape: list[int]
    dtype: str
    data: bytes
    grid: list[int] | None = None  # (rows, cols) of patches for a variable-resolution encoder (Gemma 4)


class AddRequest(Message, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams' fields (server.core.params_to_wire), validated by SamplingParams in the core
    priority: int = 0
    cache_salt: str | None = None
    session: str | None = None  # the prompt_cache_key or user that eviction policies group by
    kv_transfer_params: dict[str, Any] | None = None
    media: list[MediaItem] | None = None  # the prompt's images, in order
    lora: str | None = None  # the LoRA adapter it runs under (a name loaded at start-up), None: the base model


class Abort(Message, tag="abort"):
    request_ids: list[str]


class StatsQuery(Message, tag="stats_query"):
    nonce: int


class Shutdown(Message, tag="shutdown"):
    grace_s: float


class LoRAUpdate(Message, tag="lora_update"):
    """Loads adapter `name` from `path` (vLLM's /v1/load_lora_adapter; `load_inplace`: a name
    already loaded is re-read, its KV then keyed by the new files' digest), or with no path
    unloads it (/v1/unload_lora_adapter)."""
    nonce: int
    name: str
    path: str | None = None
    load_inplace: bool = False


class Ready(Message, tag="ready"):
    info: EngineInfo


class StartupError(Message, tag="startup_error"):
    message: str


class Delta(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One request's progress in one step: the tokens (and their log-probs) since its last delta;
    the last one carries `finish_reason` and what the request cost."""
    id: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[Any] | None = None  # [rank, {token id: logprob}] per prompt position after the first
    finish_reason: str | None = None  # set on the last delta only
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    cached_by_tier: dict[str, int] = msgspec.field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None
    queue_s: float | None = None  # arrival to first scheduled, on the core's clock
    prefill_s: float | None = None  # first scheduled to first token
    thinking_tokens: int | None = None
    thinking_forced_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Outputs(Message, tag="outputs"):
    deltas: list[Delta]


class StatsReply(Message, tag="stats"):
    """A StatsQuery's answer: the snapshot, or (`stats` empty) why the core could not send one."""
    nonce: int
    stats: dict[str, Any]  # server.core.stats_snapshot: EngineStats' fields and two gauges
    error: str | None = None


class LoRAReply(Message, tag="lora_reply"):
    """A LoRAUpdate's outcome: no error, or why not, and whether it is because the name is unknown."""
    nonce: int
    error: str | None = None
    unknown: bool = False


class AddError(Message, tag="add_error"):
    request_id: str | None
    message: str


class Accepted(Message, tag="accepted"):
    request_id: str


class Heartbeat(Message, tag="heartbeat"):
    loop_age_s: float


class Stopped(Message, tag="stopped"):
    pass


class Fatal(Message, tag="fatal"):
    message: str


ToCore = Union[AddRequest, Abort, StatsQuery, Shutdown, LoRAUpdate]
FromCore = Union[Ready, StartupError, Outputs, StatsReply, LoRAReply, AddError, Accepted, Heartbeat, Stopped, Fatal]
_ENCODER = msgspec.msgpack.Encoder()
_HEADER = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])
_TO_CORE = msgspec.msgpack.Decoder(ToCore)
_FROM_CORE = msgspec.msgpack.Decoder(FromCore)


def encode(msg: Message) -> bytes:
    """The wire bytes of `msg`. Raises (TypeError, OverflowError, ValueError, ...) for a value
    that does not fit its field, before anything is sent."""
    return _ENCODER.encode((PROTOCOL_VERSION, msg))


def _decode(data: bytes, decoder: msgspec.msgpack.Decoder, direction: str) -> Any:
    try:
        version, body = _HEADER.decode(data)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a channel message ({direction}): {e}") from None
    if version != PROTOCOL_VERSION:
        raise ValueError(f"channel protocol version {version} ({direction}); this process speaks {PROTOCOL_VERSION}")
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as e:  # ValidationError included: it names the field or the type
        raise ValueError(f"refused channel message ({direction}): {e}") from None


def decode_to_core(data: bytes) -> ToCore:
    return _decode(data, _TO_CORE, "API -> core")


def decode_from_core(data: bytes) -> FromCore:
    return _decode(data, _FROM_CORE, "core -> API")
