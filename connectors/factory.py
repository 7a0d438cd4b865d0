"""Builds the engine's connector from its config and vLLM-style `kv_transfer_config`.

`kv_connector` names a connector: a built-in (`TieredOffloadConnector`, alias `OffloadingConnector`,
vLLM's name), a `kvtier.connectors` entry point, or a class in `kv_connector_module_path`. A
plugin connector is constructed as `cls(ctx: ConnectorContext)`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from connectors.base import KVConnector
from connectors.codec import BlockLayout
from connectors.hidden_spec import HiddenStatesSpec
from kvstore.events import EventBuffer
from kvstore.g1 import BlockPool
from policies.plugins import load_plugin_class

log = logging.getLogger("kvtier.connectors")

ENTRY_POINT_GROUP = "kvtier.connectors"
TRANSFER_KEYS = {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_connector_module_path",
                 "kv_load_failure_policy", "kv_buffer_device", "engine_id"}
TIERED_NAMES = {"TieredOffloadConnector", "OffloadingConnector"}
HIDDEN_STATES_NAMES = {"HiddenStatesConnector", "ExampleHiddenStatesConnector"}  # ours, vLLM's


@dataclass(frozen=True)
class ConnectorContext:
    layout: BlockLayout
    pool: BlockPool
    fingerprint: bytes  # 16-byte model identity digest (namespaces persistent tiers)
    eviction_policy: str
    offloading_size_gib: float | None
    disk_path: str | None
    disk_size_gib: float
    extra_config: dict[str, Any] = field(default_factory=dict)
    events: EventBuffer | None = None  # KV events sink, when enabled
    hidden_spec: HiddenStatesSpec | None = None  # hidden-state export, when on
    model_name: str = ""
    remote_url: str | None = None  # G4: redis://, rediss://, redis+cluster://
    kv_secret: bytes | None = field(default=None, repr=False)  # MACs G3/G4 entries (kvstore.entry)


def validate_transfer_config(tc: dict[str, Any]) -> dict[str, Any]:
    unknown = set(tc) - TRANSFER_KEYS
    if unknown:
        raise ValueError(f"unknown kv_transfer_config keys {sorted(unknown)}; known: {sorted(TRANSFER_KEYS)}")
    extra = tc.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be a JSON object")
    return tc


def load_connector_class(name: str, module_path: str | None) -> type[KVConnector]:
    """`kv_connector_module_path` + `kv_connector` (vLLM's keys), a `module:Class`, or a
    `kvtier.connectors` entry point."""
    spec = f"{module_path}:{name}" if module_path else name
    plugins = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return load_plugin_class(spec, KVConnector, "kv_connector", {}, plugins)


def build_tiered(ctx: ConnectorContext) -> KVConnector:
    from connectors.tiered import TieredOffloadConnector, WritePolicy
    from kvstore.host import HostTier
    from policies import make_policy

    from dataclasses import replace

    extra = ctx.extra_config
    if "block_size" in extra:  # this connector's own offload block size (e.g. inside a MultiConnector)
        ob, bs = int(extra["block_size"]), ctx.layout.block_size
        if ob <= 0 or ob % bs:
            raise ValueError(f"offload block size {ob} must be a positive multiple of block_size {bs}")
        ctx = replace(ctx, layout=replace(ctx.layout, g1_blocks=ob // bs))
    g2 = g3 = None
    if ctx.offloading_size_gib:
        slots = int(ctx.offloading_size_gib * 2**30) // ctx.layout.encoded_bytes
        if slots < 1:
            raise ValueError(f"kv_offloading_size={ctx.offloading_size_gib} GiB holds no offload block of "
                             f"{ctx.layout.encoded_bytes / 2**20:.1f} MiB; raise it or lower the offload block size")
        g2 = HostTier(slots, ctx.layout.encoded_bytes, make_policy(extra.get("g2_eviction_policy", ctx.eviction_policy)),
                      pin_memory=_cuda())
        g2.events, g2.block_tokens = ctx.events, ctx.layout.tokens
        log.info("G2: %d blocks of %d tokens (%.2f GiB)", slots, ctx.layout.tokens,
                 slots * ctx.layout.encoded_bytes / 2**30)
    if ctx.disk_path is not None:
        from kvstore.disk import DiskBackend

        g3 = DiskBackend(Path(ctx.disk_path), int(ctx.disk_size_gib * 2**30), ctx.fingerprint,
                         policy=extra.get("g3_eviction_policy", ctx.eviction_policy), secret=ctx.kv_secret)
        log.info("G3: %s (%.1f GiB, %d entries found)", ctx.disk_path, ctx.disk_size_gib, len(g3))
    g4 = build_remote(ctx) if ctx.remote_url else None
    policy = extra.get("write_policy", WritePolicy.WRITE_THROUGH.value)
    try:
        write_policy = WritePolicy(policy)
    except ValueError:
        raise ValueError(f"write_policy {policy!r} is not one of {[p.value for p in WritePolicy]}") from None
    connector = TieredOffloadConnector(ctx.layout, ctx.pool, g2, g3,
                                       g3_timeout_s=float(extra.get("g3_timeout_s", 10.0)),
                                       g3_read_threads=int(extra.get("g3_read_threads", 4)),
                                       write_policy=write_policy, g4=g4)
    log.info("offload write policy: %s", write_policy.value)
    connector.events = ctx.events
    return connector


def build_remote(ctx: ConnectorContext) -> Any:
    """G4 from `remote_url` and the extra-config keys g4_prefix, g4_ttl_s, g4_timeout_s and
    g4_min_uses. An unreachable server or a rejected password does not stop the engine: G4
    turns into misses (and says so in the log)."""
    from connectors.remote_tier import RemoteTier
    from kvstore.remote import RedisBackend, RemoteConfig

    extra = ctx.extra_config
    ttl = extra.get("g4_ttl_s")
    cfg = RemoteConfig(str(ctx.remote_url), ctx.fingerprint, prefix=str(extra.get("g4_prefix", "kvtier")),
                       ttl_s=None if ttl is None else float(ttl), timeout_s=float(extra.get("g4_timeout_s", 0.5)),
                       secret=ctx.kv_secret)
    backend = RedisBackend(cfg)
    log.info("G4: %s (key prefix %s, TTL %s, written after %d use(s))", backend.url, cfg.prefix,
             f"{cfg.ttl_s:g}s" if cfg.ttl_s else "none", int(extra.get("g4_min_uses", 1)))
    return RemoteTier(backend, min_uses=int(extra.get("g4_min_uses", 1)))


def build_hidden_states(ctx: ConnectorContext) -> KVConnector:
    from connectors.hidden_states import HiddenStatesConnector

    extra = ctx.extra_config
    if ctx.hidden_spec is None:
        raise ValueError("HiddenStatesConnector needs speculative_config with method extract_hidden_states "
                         "(and draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids)")
    path = extra.get("shared_storage_path")
    if not isinstance(path, str) or not path:
        raise ValueError("HiddenStatesConnector needs kv_connector_extra_config.shared_storage_path (a directory)")
    include = extra.get("include_output_tokens", False)
    if not isinstance(include, bool):
        raise ValueError(f"include_output_tokens must be true or false; got {include!r}")
    connector = HiddenStatesConnector(Path(path), ctx.hidden_spec, ctx.pool, ctx.layout.block_size,
                                      ctx.model_name, include_output_tokens=include,
                                      writer_threads=int(extra.get("writer_threads", 2)),
                                      max_queued_files=int(extra.get("max_queued_files", 16)))
    log.info("hidden states: layers %s -> %s", list(ctx.hidden_spec.layer_ids), path)
    return connector


def has_hidden_states_connector(connector: KVConnector) -> bool:
    from connectors.hidden_states import HiddenStatesConnector
    from connectors.multi import MultiConnector

    if isinstance(connector, MultiConnector):
        return any(has_hidden_states_connector(c) for c in connector.connectors)
    return isinstance(connector, HiddenStatesConnector)


def build_connector(ctx: ConnectorContext, transfer_config: dict[str, Any] | None) -> KVConnector | None:
    tc = validate_transfer_config(dict(transfer_config or {}))
    name = tc.get("kv_connector")
    if name == "MultiConnector":
        from dataclasses import replace

        from connectors.multi import MultiConnector

        subs = tc.get("kv_connector_extra_config", {}).get("connectors")
        if not isinstance(subs, list) or not subs:
            raise ValueError('MultiConnector needs kv_connector_extra_config.connectors: a list of connector configs')
        parts = []
        for sub in subs:
            if not isinstance(sub, dict) or sub.get("kv_connector") in (None, "MultiConnector"):
                raise ValueError("each MultiConnector entry needs its own kv_connector (not MultiConnector)")
            built = build_connector(replace(ctx, extra_config=dict(sub.get("kv_connector_extra_config", {}))), sub)
            if built is not None:
                parts.append(built)
        return MultiConnector(parts)
    if name in HIDDEN_STATES_NAMES:
        return build_hidden_states(ctx)
    if name is None or name in TIERED_NAMES:
        if ctx.offloading_size_gib or ctx.disk_path is not None or ctx.remote_url:
            return build_tiered(ctx)
        if name is not None:
            raise ValueError(f"{name} needs a tier: set kv_offloading_size and/or kv_offload_disk")
        return None
    return load_connector_class(name, tc.get("kv_connector_module_path"))(ctx)  # type: ignore[call-arg]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
