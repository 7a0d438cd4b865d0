"""Builds the engine's connector from its config and vLLM-style `kv_transfer_config`.

`kv_connector` names a connector: a built-in (`BUILTIN_KINDS`: `TieredOffloadConnector`, alias
`OffloadingConnector`, vLLM's name; `HiddenStatesConnector`; `MultiConnector`), a
`kvtier.connectors` entry point, or a class in `kv_connector_module_path`. A plugin connector is
constructed as `cls(ctx: ConnectorContext)`. Every question about a config (check it, which
shared tiers it sets up, whether it takes KV groups, build it) goes to its kind, once.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from connectors.base import KVConnector
from connectors.codec import BlockLayout
from connectors.hidden_spec import HiddenStatesSpec
from kvstore.events import EventBuffer
from kvstore.g1 import BlockPool
from plugins import load_plugin_class
from policies import PolicySpecLike

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "kvtier.connectors"
TRANSFER_KEYS = {"kv_connector", "kv_role", "kv_connector_extra_config", "kv_connector_module_path",
                 "kv_load_failure_policy", "kv_buffer_device", "engine_id"}
HIDDEN_STATES_KEYS = {"shared_storage_path", "include_output_tokens", "writer_threads", "max_queued_files"}


@dataclass(frozen=True)
class ConnectorContext:
    layout: BlockLayout
    pool: BlockPool
    fingerprint: bytes  # 16-byte model identity digest (namespaces persistent tiers)
    eviction_policy: PolicySpecLike  # G1's; G2's and G3's unless their own keys say otherwise
    offloading_size_gib: float | None
    disk_path: str | None
    disk_size_gib: float
    extra_config: dict[str, Any] = field(default_factory=dict)
    events: EventBuffer | None = None  # KV events sink, when enabled
    hidden_spec: HiddenStatesSpec | None = None  # hidden-state export, when on
    model_name: str = ""
    remote_url: str | None = None  # G4: redis://, rediss://, redis+cluster://
    kv_secret: bytes | None = field(default=None, repr=False)  # MACs G3/G4 entries (kvstore.entry)
    remote_trusted: bool = False  # a shared tier may run without kv_secret (check_shared_tiers)
    # What the namespace is (model, dtype, fingerprint inputs): G3/G4 record it for `kvtier kv`
    # (kvstore.namespace_info); informational only
    namespace_info: dict[str, Any] | None = field(default=None, repr=False)
    # This process's share of the G2 and disk sizes given: 1 / tensor_parallel_size (each rank
    # stores its shard of every block in tiers of its own)
    size_share: float = 1.0


def validate_transfer_config(tc: dict[str, Any]) -> dict[str, Any]:
    unknown = set(tc) - TRANSFER_KEYS
    if unknown:
        raise ValueError(f"unknown kv_transfer_config keys {sorted(unknown)}; known: {sorted(TRANSFER_KEYS)}")
    extra = tc.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ValueError("kv_connector_extra_config must be a JSON object")
    return tc


def check_transfer_config(tc: dict[str, Any] | None, flag_tiers: set[str]) -> None:
    """Everything about `kv_transfer_config` that can be checked without a model: its keys, the
    connector's name, and for the built-in connectors their extra-config keys and tier stack
    (backend names and options). `kvtier serve` calls it before it spawns the engine, so a bad
    config exits 2 with the message instead of failing in the engine process."""
    tc = validate_transfer_config(dict(tc or {}))
    connector_kind(tc).check(tc, flag_tiers)


def shared_tiers(tc: dict[str, Any] | None, remote_url: str | None) -> list[str]:
    """The shared tiers (stores other processes or machines can write to) a config sets up: G4
    from the flags, and each storage tier whose backend class says `shared` in an explicit stack,
    inside a MultiConnector too."""
    names = [f"G4 ({'redis' if remote_url.startswith('redis') else 'remote'}, --kv-offload-remote)"] if remote_url else []
    tc = tc or {}
    return names + connector_kind(tc).shared_tiers(tc)


def check_shared_tiers(tc: dict[str, Any] | None, remote_url: str | None, has_secret: bool, trusted: bool) -> None:
    """ValueError when a shared tier would run without a KV secret and the operator has not said
    the store is trusted: its entries would carry only an unkeyed checksum, so whoever can write to
    the store could plant KV this engine serves. Checked by EngineConfig (before weights load)
    and again when the tiers are built."""
    shared = shared_tiers(tc, remote_url)
    if shared and not has_secret and not trusted:
        raise ValueError(f"{', '.join(shared)} is a shared store and no KV secret is set: whoever can write to it "
                         "could plant KV this engine would serve. Set --kv-offload-secret-file (or "
                         "$KVTIER_KV_SECRET; kv_offload_secret_file offline), shared by every engine on the store, or "
                         "declare the store trusted with --kv-offload-remote-trusted (kv_offload_remote_trusted)")


def _shared_mode(ctx: ConnectorContext, name: str) -> None:
    """Logs which protection a shared tier runs with (check_shared_tiers allowed it)."""
    if ctx.kv_secret is not None:
        log.info("%s: entries MAC'd with the KV secret: values without a valid MAC are refused", name)
    elif ctx.remote_trusted:
        log.warning("%s: TRUSTED store without a KV secret (--kv-offload-remote-trusted): entries carry an unkeyed "
                    "checksum, which catches damage but not forgery", name)
    else:
        raise ValueError(f"{name} is a shared store and no KV secret is set (see --kv-offload-remote-trusted)")


def _check_keys(extra: dict[str, Any], known: set[str], connector: str) -> None:
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown} for {connector}; known: {sorted(known)}")


def load_connector_class(name: str, module_path: str | None) -> type[KVConnector]:
    """`kv_connector_module_path` + `kv_connector` (vLLM's keys), a `module:Class`, or a
    `kvtier.connectors` entry point."""
    spec = f"{module_path}:{name}" if module_path else name
    plugins = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return load_plugin_class(spec, KVConnector, "kv_connector", {}, plugins)


def build_tiered(ctx: ConnectorContext) -> KVConnector:
    """The tiered offload connector over the stack the flags or `extra_config["tiers"]` give
    (`connectors.stack`)."""
    from dataclasses import replace

    from connectors import stack
    from connectors.tiered import TieredOffloadConnector, WritePolicy

    extra = ctx.extra_config
    stack.check_extra_keys(extra, _flag_tiers(ctx))
    if "block_size" in extra:  # this connector's own offload block size (e.g. inside a MultiConnector)
        ob, bs = int(extra["block_size"]), ctx.layout.block_size
        if ob <= 0 or ob % bs:
            raise ValueError(f"offload block size {ob} must be a positive multiple of block_size {bs}")
        ctx = replace(ctx, layout=replace(ctx.layout, g1_blocks=ob // bs))
    g2, tiers = _explicit_stack(ctx) if stack.TIERS_KEY in extra else _flag_stack(ctx)
    policy = extra.get("write_policy", WritePolicy.WRITE_THROUGH.value)
    try:
        write_policy = WritePolicy(policy)
    except ValueError:
        raise ValueError(f"write_policy {policy!r} is not one of {[p.value for p in WritePolicy]}") from None
    connector = TieredOffloadConnector(ctx.layout, ctx.pool, g2, tiers, write_policy=write_policy,
                                       namespace=ctx.fingerprint.hex())
    log.info("offload write policy: %s", write_policy.value)
    return connector



def _flag_tiers(ctx: ConnectorContext) -> set[str]:
    return flag_tiers(ctx.offloading_size_gib, ctx.disk_path, ctx.remote_url)


def flag_tiers(offloading_size: float | None, disk_path: str | None, remote_url: str | None) -> set[str]:
    """Which tiers of the default stack the flags configure ("g2", "g3", "g4")."""
    return {t for t, on in (("g2", bool(offloading_size)), ("g3", disk_path is not None), ("g4", bool(remote_url)))
            if on}


def _flag_stack(ctx: ConnectorContext) -> tuple[Any, list[Any]]:
    """The default stack from the flags and the flat extra-config keys: G2 host memory, G3 the
    disk, G4 Redis/Valkey."""
    extra = ctx.extra_config
    g2 = _host(ctx, ctx.offloading_size_gib, extra.get("g2_eviction_policy")) if ctx.offloading_size_gib else None
    tiers = []
    if ctx.disk_path is not None:
        from connectors.stack import PARALLEL_OPTIONS
        from kvstore.backend import IO_BYTES

        io_bytes = int(_number(extra, "g3_io_mib", IO_BYTES / 2**20, float) * 2**20)
        if io_bytes < 1:
            raise ValueError(f"g3_io_mib must be > 0; got {extra['g3_io_mib']}")
        disk = _disk(ctx, Path(ctx.disk_path), ctx.disk_size_gib, extra.get("g3_eviction_policy"), io_bytes)
        tiers.append(_parallel(ctx, "G3", disk, {
            "read_threads": _number(extra, "g3_read_threads", PARALLEL_OPTIONS["read_threads"], int),
            "read_timeout_s": _number(extra, "g3_timeout_s", PARALLEL_OPTIONS["read_timeout_s"], float),
            "min_uses": _number(extra, "g3_min_uses", PARALLEL_OPTIONS["min_uses"], int)}, io_bytes))
    if ctx.remote_url:
        _shared_mode(ctx, "G4")
        redis = _redis(ctx, str(ctx.remote_url), str(extra.get("g4_prefix", "kvtier")),
                       _number(extra, "g4_ttl_s", None, float), _number(extra, "g4_timeout_s", 0.5, float))
        tiers.append(_batched(ctx, "G4", redis, _number(extra, "g4_min_uses", 1, int)))
    return g2, tiers


def _number(extra: dict[str, Any], key: str, default: Any, kind: type) -> Any:
    """extra[key] (else `default`) as `kind`; a ValueError naming the key when it is not one."""
    value = extra.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be {'an integer' if kind is int else 'a number'}; "
                         f"got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be {'an integer' if kind is int else 'a number'}; "
                         f"got {value!r}") from None


def _explicit_stack(ctx: ConnectorContext) -> tuple[Any, list[Any]]:
    """G2 and the storage tiers below it from `extra_config["tiers"]`."""
    from connectors import stack

    spec = stack.parse_stack(ctx.extra_config[stack.TIERS_KEY])
    stack.check_stack(spec)  # every tier's options before any tier is built
    g2 = None
    if spec.host is not None:
        g2 = _host(ctx, float(spec.host.options["size_gib"]), spec.host.options.get("eviction_policy"))
    tiers = []
    for st in spec.storage:
        opts = st.backend_options
        if backend_class(st.tier, opts).shared:
            _shared_mode(ctx, f"{st.name} ({st.tier.backend})")  # before the backend connects anywhere
        builtin = _BUILTIN_BACKENDS.get(st.tier.backend)
        if builtin is not None:
            backend = builtin(ctx, opts)
        else:
            backend = stack.build_plugin(st.tier, opts, ctx.fingerprint, ctx.kv_secret)
            log.info("%s: storage backend %r (%s)", st.name, st.tier.backend, type(backend.inner).__name__)
        tiers.append(_batched(ctx, st.name, backend, int(st.mode_options["min_uses"])) if st.batched
                     else _parallel(ctx, st.name, backend, st.mode_options))
    if g2 is None and not tiers:
        raise ValueError("\"tiers\" names no tier")
    return g2, tiers


def _parallel(ctx: ConnectorContext, name: str, backend: Any, opts: dict[str, Any], io_bytes: int | None = None) -> Any:
    from connectors.storage_tier import StorageTier

    io = {} if io_bytes is None else {"io_bytes": io_bytes}
    return StorageTier.parallel(name, backend, read_threads=int(opts["read_threads"]),
                                read_timeout_s=float(opts["read_timeout_s"]), events=ctx.events,
                                min_uses=int(opts["min_uses"]), **io)


def _batched(ctx: ConnectorContext, name: str, backend: Any, min_uses: int) -> Any:
    """A batched tier: reuse-gated batched writes and batched reads around `backend`."""
    from connectors.remote_tier import RemoteTier
    from connectors.storage_tier import StorageTier

    log.info("%s: written after %d use(s)", name, min_uses)
    return StorageTier.batched(name, RemoteTier(backend, name=name, min_uses=min_uses, events=ctx.events))


def _host(ctx: ConnectorContext, size_gib: float, policy: PolicySpecLike | None) -> Any:
    from kvstore.host import HostTier
    from policies import make_policy

    slots = int(size_gib * ctx.size_share * 2**30) // ctx.layout.encoded_bytes
    if slots < 1:
        raise ValueError(f"kv_offloading_size={size_gib} GiB holds no offload block of "
                         f"{ctx.layout.encoded_bytes / 2**20:.1f} MiB; raise it or lower the offload block size")
    g2 = HostTier(slots, ctx.layout.encoded_bytes, make_policy(policy or ctx.eviction_policy, slots), pin_memory=_cuda(),
                  events=ctx.events)
    log.info("G2: %d blocks of %d tokens (%.2f GiB)", slots, ctx.layout.tokens, slots * ctx.layout.encoded_bytes / 2**30)
    return g2


def _disk(ctx: ConnectorContext, path: Path, size_gib: float, policy: PolicySpecLike | None,
          file_bytes: int | None = None) -> Any:
    from kvstore.disk import DiskBackend

    # The connector tells G3's policy of each read it used (touch_blocks), so reads are not uses.
    disk = DiskBackend(path, int(size_gib * ctx.size_share * 2**30), ctx.fingerprint, policy=policy or ctx.eviction_policy,
                       secret=ctx.kv_secret, entry_bytes=ctx.layout.encoded_bytes, touch_on_read=False,
                       info=ctx.namespace_info, **({} if file_bytes is None else {"file_bytes": file_bytes}))
    log.info("disk tier: %s (%.1f GiB, %d entries found)", path, size_gib * ctx.size_share, len(disk))
    return disk


def _redis(ctx: ConnectorContext, url: str, prefix: str, ttl_s: float | None, timeout_s: float) -> Any:
    """Redis/Valkey. An unreachable server or a rejected password does not stop the engine: the
    tier turns into misses (and says so in the log)."""
    from kvstore.remote import RedisBackend, RemoteConfig

    cfg = RemoteConfig(url, ctx.fingerprint, prefix=prefix, ttl_s=ttl_s, timeout_s=timeout_s, secret=ctx.kv_secret,
                       info=ctx.namespace_info)
    backend = RedisBackend(cfg)
    log.info("Redis tier: %s (key prefix %s, TTL %s)", backend.url, cfg.prefix, f"{cfg.ttl_s:g}s" if cfg.ttl_s else "none")
    return backend


def build_hidden_states(ctx: ConnectorContext) -> KVConnector:
    from connectors.hidden_states import HiddenStatesConnector

    extra = ctx.extra_config
    _check_keys(extra, HIDDEN_STATES_KEYS, "HiddenStatesConnector")
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


def supports_kv_groups(transfer_config: dict[str, Any] | None) -> bool:
    """Whether the connector `transfer_config` builds (None: the offload flags' tiered one) takes
    G1 in several KV groups: the tiered offload connector, writing through; a plugin connector
    whose class says so (`KVConnector.supports_kv_groups`)."""
    tc = validate_transfer_config(dict(transfer_config or {}))
    return connector_kind(tc).kv_groups(tc)


def has_hidden_states_connector(connector: KVConnector) -> bool:
    from connectors.hidden_states import HiddenStatesConnector
    from connectors.multi import MultiConnector

    if isinstance(connector, MultiConnector):
        return any(has_hidden_states_connector(c) for c in connector.connectors)
    return isinstance(connector, HiddenStatesConnector)


def build_connector(ctx: ConnectorContext, transfer_config: dict[str, Any] | None) -> KVConnector | None:
    tc = validate_transfer_config(dict(transfer_config or {}))
    return connector_kind(tc).build(ctx, tc)


def backend_class(spec: Any, options: dict[str, Any]) -> type:
    """The class a storage tier's backend name stands for (connectors.registry): for a plugin,
    after checking that its constructor takes `options`."""
    from connectors import stack
    from connectors.registry import load_backend_class

    return load_backend_class(spec.backend) if spec.backend in _BUILTIN_BACKENDS else stack.plugin_class(spec, options)


def _disk_backend(ctx: ConnectorContext, opts: dict[str, Any]) -> Any:
    from connectors import stack

    return _disk(ctx, stack.disk_path(opts), float(opts.get("size_gib", 10.0)), opts.get("eviction_policy"))


def _redis_backend(ctx: ConnectorContext, opts: dict[str, Any]) -> Any:
    ttl = opts.get("ttl_s")
    return _redis(ctx, str(opts["url"]), str(opts.get("prefix", "kvtier")), None if ttl is None else float(ttl),
                  float(opts.get("timeout_s", 0.5)))


# The storage backends kvtier builds itself (their options are checked by connectors.stack);
# any other name is a plugin's (connectors.registry).
_BUILTIN_BACKENDS = {"disk": _disk_backend, "redis": _redis_backend}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class ConnectorKind:
    """What kvtier knows of one kind of connector, asked once per question: `check` a transfer
    config without a model (its keys, its tier stack), the `shared_tiers` it sets up, whether it
    takes G1 in several KV groups (`kv_groups`), and `build` it."""
    check: Callable[[dict[str, Any], set[str]], None]
    shared_tiers: Callable[[dict[str, Any]], list[str]]
    kv_groups: Callable[[dict[str, Any]], bool]
    build: Callable[[ConnectorContext, dict[str, Any]], KVConnector | None]


def _extra(tc: dict[str, Any]) -> dict[str, Any]:
    extra = tc.get("kv_connector_extra_config") or {}
    return extra if isinstance(extra, dict) else {}


def _tiered_check(tc: dict[str, Any], flags: set[str]) -> None:
    from connectors import stack

    stack.check_extra_keys(_extra(tc), flags)
    if stack.TIERS_KEY in _extra(tc):
        stack.check_stack(stack.parse_stack(_extra(tc)[stack.TIERS_KEY]))


def _tiered_shared(tc: dict[str, Any]) -> list[str]:
    from connectors import stack

    if stack.TIERS_KEY not in _extra(tc):
        return []
    spec = stack.parse_stack(_extra(tc)[stack.TIERS_KEY])
    stack.check_stack(spec)  # a bad stack fails with its own error first
    return [f"{st.name} ({st.tier.backend})" for st in spec.storage if backend_class(st.tier, st.backend_options).shared]


def _tiered_build(ctx: ConnectorContext, tc: dict[str, Any]) -> KVConnector | None:
    from connectors import stack

    name = tc.get("kv_connector")
    stack.check_extra_keys(ctx.extra_config, _flag_tiers(ctx))  # unknown keys first: they may be why no tier is set
    if _flag_tiers(ctx) or stack.TIERS_KEY in ctx.extra_config:
        return build_tiered(ctx)
    if name is None and ctx.extra_config:
        raise ValueError(f"kv_connector_extra_config {sorted(ctx.extra_config)} given, but no kv_connector "
                         'and no offload tier to apply it to')
    if name is not None:
        raise ValueError(f"{name} needs a tier: set kv_offloading_size, kv_offload_disk or kv_offload_remote, "
                         'or list them in kv_connector_extra_config "tiers"')
    return None


def _multi_subs(tc: dict[str, Any]) -> list[dict[str, Any]]:
    return [sub for sub in _extra(tc).get("connectors") or [] if isinstance(sub, dict)]


def _multi_build(ctx: ConnectorContext, tc: dict[str, Any]) -> KVConnector:
    from dataclasses import replace

    from connectors.multi import MultiConnector

    multi_extra = tc.get("kv_connector_extra_config", {})
    _check_keys(multi_extra, {"connectors"}, "MultiConnector")
    subs = multi_extra.get("connectors")
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


TIERED = ConnectorKind(
    check=_tiered_check, shared_tiers=_tiered_shared,
    kv_groups=lambda tc: _extra(tc).get("write_policy", "write_through") == "write_through",
    build=_tiered_build)
HIDDEN_STATES = ConnectorKind(
    check=lambda tc, flags: _check_keys(_extra(tc), HIDDEN_STATES_KEYS, "HiddenStatesConnector"),
    shared_tiers=lambda tc: [], kv_groups=lambda tc: False, build=lambda ctx, tc: build_hidden_states(ctx))
def _multi_check(tc: dict[str, Any], flags: set[str]) -> None:
    for sub in _multi_subs(tc):
        check_transfer_config(sub, flags)


MULTI = ConnectorKind(
    check=_multi_check,
    shared_tiers=lambda tc: [n for sub in _multi_subs(tc) for n in connector_kind(sub).shared_tiers(sub)],
    kv_groups=lambda tc: False, build=_multi_build)
# By kv_connector; None (no kv_connector) is the tiered connector over the offload flags' tiers.
BUILTIN_KINDS: dict[str | None, ConnectorKind] = {
    None: TIERED, "TieredOffloadConnector": TIERED, "OffloadingConnector": TIERED,  # vLLM's name
    "HiddenStatesConnector": HIDDEN_STATES, "ExampleHiddenStatesConnector": HIDDEN_STATES,  # ours, vLLM's
    "MultiConnector": MULTI,
}


def _plugin_kind(name: str, module_path: str | None) -> ConnectorKind:
    def cls() -> type[KVConnector]:
        return load_connector_class(name, module_path)

    def check(tc: dict[str, Any], flags: set[str]) -> None:
        cls()  # it loads, and is a KVConnector

    return ConnectorKind(check=check, shared_tiers=lambda tc: [],
                         kv_groups=lambda tc: bool(cls().supports_kv_groups),
                         build=lambda ctx, tc: cls()(ctx))  # type: ignore[call-arg]


def builds_tiered(tc: dict[str, Any] | None, offload_enabled: bool) -> bool:
    """Whether the config builds the tiered offload connector (over the flags' tiers or a "tiers" list)."""
    tc = tc or {}
    return connector_kind(tc) is TIERED and (offload_enabled or "tiers" in _extra(tc))


def connector_kind(tc: dict[str, Any]) -> ConnectorKind:
    """The kind of connector a transfer config names: a built-in, else a plugin (loaded lazily)."""
    name = tc.get("kv_connector")
    kind = BUILTIN_KINDS.get(name) if name is None or isinstance(name, str) else None
    if kind is not None:
        return kind
    if not isinstance(name, str):
        raise ValueError(f"kv_connector must be a string; got {name!r}")
    return _plugin_kind(name, tc.get("kv_connector_module_path"))
