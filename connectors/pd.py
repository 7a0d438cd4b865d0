"""Prefill/decode disaggregation through the shared tier (G4): the `kv_transfer_params` contract.

vLLM's disaggregation protocol, as `vllm-router --vllm-pd-disaggregation` drives it over HTTP:
the router sends the request to a prefill replica with `max_tokens=1` and
`kv_transfer_params={"do_remote_decode": true, ...}`, then sends the original request to a decode
replica with the `kv_transfer_params` the prefill's response carried. vLLM fills those with
NIXL/Mooncake addresses; the router only relays them. kvtier moves the KV through G4 instead:

- prefill: the request's full offload blocks are written to G4 before the response is sent, and
  the response's `kv_transfer_params` name them (`"kvtier": {"transport": "G4", "namespace",
  "tokens", "keys"}` beside vLLM's keys, `do_remote_prefill: true`);
- decode: the request loads those blocks through the normal tier lookup (G4 is below G1/G2/G3),
  so nothing but the router and Redis connects the two replicas. Blocks that are gone (evicted,
  Redis down) are a miss plus a log line: recomputed, never wrong.

Parameters from another model (namespace) or another system (NIXL's remote_block_ids without a
"kvtier" entry) are refused by name, never half-used.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from kvstore.keys import BlockKey

# vLLM's keys: the router sends them all (null where unused); kvtier reads only the two flags.
_VLLM_KEYS = frozenset({"do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids",
                        "remote_host", "remote_port", "remote_request_id", "tp_size"})
TRANSPORT = "G4"


class PDRole(enum.Enum):
    PREFILL = "prefill"  # compute the prompt, publish its blocks to G4, name them
    DECODE = "decode"  # load the named blocks from G4, then generate


@dataclass(frozen=True)
class PDRequest:
    role: PDRole
    namespace: str | None = None  # decode: the prefill's model namespace (hex)
    tokens: int = 0  # decode: prompt tokens the prefill published
    keys: tuple[BlockKey, ...] = ()  # decode: their offload-block keys, in order

    def __post_init__(self) -> None:
        if self.role is PDRole.DECODE and (self.namespace is None or self.tokens < 0):
            raise ValueError("a decode PDRequest needs the prefill's namespace and token count")


def parse(params: dict[str, Any] | None) -> PDRequest | None:
    """A request's `kv_transfer_params` (None, {} or all-off: no disaggregation). ValueError
    naming the field that cannot be honoured."""
    if not params:
        return None
    if not isinstance(params, dict):
        raise ValueError("'kv_transfer_params' must be an object")
    unknown = set(params) - _VLLM_KEYS - {"kvtier"}
    if unknown:
        raise ValueError(f"unsupported 'kv_transfer_params' keys {sorted(unknown)}; kvtier reads do_remote_decode, "
                         "do_remote_prefill and its own 'kvtier' entry (vLLM's other keys may be null)")
    addressed = sorted(k for k in _VLLM_KEYS - {"do_remote_decode", "do_remote_prefill"} if params.get(k) is not None)
    if addressed:  # accepted only as null: a value would be ignored
        raise ValueError(f"'kv_transfer_params' {addressed} must be null: kvtier moves KV through its shared tier (G4) "
                         "and has no NIXL or Mooncake transport to address")
    decode, prefill = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
    if decode and prefill:
        raise ValueError("'kv_transfer_params' cannot set both do_remote_decode and do_remote_prefill")
    if decode:
        return PDRequest(PDRole.PREFILL)
    if not prefill:
        if params.get("kvtier") is not None:
            raise ValueError("'kv_transfer_params'.kvtier is only read with do_remote_prefill: true")
        return None
    ours = params.get("kvtier")
    if not isinstance(ours, dict):
        raise ValueError("'kv_transfer_params' with do_remote_prefill need the 'kvtier' entry a kvtier prefill "
                         "replica returns: kvtier moves KV through its shared tier (G4), not NIXL or Mooncake")
    if ours.get("transport") != TRANSPORT:
        raise ValueError(f"'kv_transfer_params'.kvtier.transport must be {TRANSPORT!r}; got {ours.get('transport')!r}")
    ns, tokens, keys = ours.get("namespace"), ours.get("tokens"), ours.get("keys")
    if not isinstance(ns, str) or type(tokens) is not int or not isinstance(keys, list):
        raise ValueError("'kv_transfer_params'.kvtier needs 'namespace' (hex), 'tokens' (int) and 'keys' (list)")
    try:
        parsed = tuple(BlockKey(bytes.fromhex(k)) for k in keys)
    except (TypeError, ValueError):
        raise ValueError("'kv_transfer_params'.kvtier.keys must be hex strings") from None
    return PDRequest(PDRole.DECODE, ns, tokens, parsed)


def prefill_response(namespace: str, tokens: int, keys: list[BlockKey]) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill replica answers with: what the decode replica will load."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
            "kvtier": {"transport": TRANSPORT, "namespace": namespace, "tokens": tokens,
                       "keys": [bytes(k).hex() for k in keys]}}
