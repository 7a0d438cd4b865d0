"""The offload tier stack: which storage sits below G1, from flags or from an explicit list.

Two ways to say it, never both:

- **Flags** (unchanged): `kv_offloading_size` (G2, host memory), `kv_offload_disk` (G3, the
  built-in disk backend), `kv_offload_remote` (G4, Redis/Valkey), tuned by the flat
  `kv_connector_extra_config` keys in `FLAG_STACK_KEYS`.
- **An explicit stack**: `kv_connector_extra_config = {"tiers": [{"backend": ...}, ...]}`, top
  first. `host` (G2) may only come first; below it come storage tiers, named G3, G4, G5, ... by
  position: `disk`, `redis`, or any storage backend by name (built-in `memory`, a
  `kvtier.backends` entry point) or `module:Class`. A plugin backend's options go to its
  constructor; it is wrapped in `kvstore.sealed.SealedBackend`, so its entries are namespaced by
  the model and checked on read (with the KV secret, MAC'd) like the built-in tiers'.

Each storage tier is `parallel` (several single-key reads in flight, ordered writes: the default,
for disks and most plugins) or `batched` (one round trip per batch, writes after `min_uses`
uses: the default for `redis`); `"mode"` overrides it (`connectors.storage_tier`).

Every key is checked: an unknown one, an unknown backend, or options a backend refuses raise
ValueError naming it. Eviction policies (`g2_eviction_policy`, `g3_eviction_policy`, a `host` or
`disk` tier's `eviction_policy`) are `policies.make_policy` specs, a name or
`{"name": ..., "options": {...}}`, built once to check them. G4 has none: Redis evicts.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policies import check_policy

log = logging.getLogger(__name__)

HOST = "host"
# Flat keys of the flag-built stack (and what each tunes).
FLAG_STACK_KEYS = {
    "g2_eviction_policy": "G2's eviction policy", "g3_eviction_policy": "G3's eviction policy",
    "g3_timeout_s": "G3 read timeout", "g3_read_threads": "G3 reads in flight",
    "g3_io_mib": "G3 file size and read size, MiB", "g3_min_uses": "uses before a block is written to G3",
    "g4_prefix": "G4 key prefix", "g4_ttl_s": "G4 entry TTL", "g4_timeout_s": "G4 socket timeout",
    "g4_min_uses": "uses before a block is written to G4",
}
# Keys of the connector itself, valid with either form.
CONNECTOR_KEYS = {"write_policy", "block_size"}
TIERS_KEY = "tiers"
# Options a storage tier takes by its mode (not passed to the backend), with their defaults.
MODE_KEY = "mode"
PARALLEL_OPTIONS = {"read_threads": 4, "read_timeout_s": 10.0, "min_uses": 1}
BATCHED_OPTIONS = {"min_uses": 1}  # both modes take min_uses: admission after that many uses
BATCHED_BY_DEFAULT = {"redis"}
_BUILTIN_OPTIONS = {
    HOST: {"size_gib", "eviction_policy"},
    "disk": {"path", "size_gib", "eviction_policy"},
    "redis": {"url", "prefix", "ttl_s", "timeout_s"},
}
MAX_STORAGE_TIERS = 6  # G3..G8: a sanity bound, not a design limit
POLICY_OPTION = "eviction_policy"
NO_G4_POLICY = ("G4 (Redis/Valkey) takes no eviction policy: the server evicts, by its maxmemory-policy (e.g. "
                "allkeys-lru or allkeys-lfu), because replicas share the store and one client cannot see the "
                "others' accesses")


@dataclass(frozen=True)
class TierSpec:
    """One entry of the stack: a backend name and the options given for it."""

    backend: str
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError("each tier needs \"backend\": a backend name or module:Class")


@dataclass(frozen=True)
class StorageSpec:
    """A storage tier of the stack: its name, mode, mode options and the backend's own options."""

    name: str
    tier: TierSpec
    batched: bool
    mode_options: dict[str, Any]
    backend_options: dict[str, Any]


@dataclass(frozen=True)
class StackSpec:
    """The validated explicit stack: `host` (or None) and the storage tiers below it, in order."""

    host: TierSpec | None
    storage: tuple[StorageSpec, ...]


FLAG_TIER_SOURCE = {"g2": "kv_offloading_size", "g3": "kv_offload_disk", "g4": "kv_offload_remote"}


def check_extra_keys(extra: dict[str, Any], flag_tiers: set[str]) -> None:
    """ValueError for any key the tiered connector does not take, for a flat key tuning a tier the
    flags did not set up (it would be ignored), or for mixing the two forms. `flag_tiers`: which
    of "g2", "g3", "g4" the flags configure."""
    known = set(FLAG_STACK_KEYS) | CONNECTOR_KEYS | {TIERS_KEY}
    if "g4_eviction_policy" in extra:
        raise ValueError(f"kv_connector_extra_config.g4_eviction_policy: {NO_G4_POLICY}")
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown} for the tiered offload connector; "
                         f"known: {sorted(known)}")
    if TIERS_KEY in extra:
        flat = sorted(set(extra) & set(FLAG_STACK_KEYS))
        if flat:
            raise ValueError(f"{flat} tune the flag-built stack; with \"tiers\" give each tier its own options")
        if flag_tiers:
            raise ValueError("give the offload tiers either as flags (kv_offloading_size, kv_offload_disk, "
                             "kv_offload_remote) or as kv_connector_extra_config \"tiers\", not both")
    idle = sorted(k for k in set(extra) & set(FLAG_STACK_KEYS) if k[:2] not in flag_tiers)
    if idle and TIERS_KEY not in extra:
        raise ValueError(f"{idle} tune tier(s) that are not configured: set "
                         f"{sorted({FLAG_TIER_SOURCE[k[:2]] for k in idle})} or drop them")
    for key in ("g2_eviction_policy", "g3_eviction_policy"):
        if key in extra:
            check_policy(extra[key], f"kv_connector_extra_config.{key}")


def parse_stack(raw: Any) -> StackSpec:
    """The `tiers` list, checked for shape; each backend's own options are checked when it is built."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("\"tiers\" must be a non-empty list of {\"backend\": NAME, ...options} objects")
    specs = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or "backend" not in entry:
            raise ValueError(f"tiers[{i}] must be an object with a \"backend\" key; got {entry!r}")
        opts = {k: v for k, v in entry.items() if k != "backend"}
        specs.append(TierSpec(entry["backend"], opts))
    host = specs[0] if specs[0].backend == HOST else None
    rest = specs[1:] if host else specs
    if any(s.backend == HOST for s in rest):
        raise ValueError("the host tier (G2) can only be the first entry of \"tiers\"")
    if len(rest) > MAX_STORAGE_TIERS:
        raise ValueError(f"at most {MAX_STORAGE_TIERS} storage tiers below host memory; got {len(rest)}")
    return StackSpec(host, tuple(_storage_spec(f"G{pos + 3}", spec) for pos, spec in enumerate(rest)))


def _storage_spec(name: str, spec: TierSpec) -> StorageSpec:
    mode = spec.options.get(MODE_KEY, "batched" if spec.backend in BATCHED_BY_DEFAULT else "parallel")
    if mode not in ("parallel", "batched"):
        raise ValueError(f"tier {spec.backend!r}: \"mode\" must be \"parallel\" or \"batched\"; got {mode!r}")
    mine, other = (BATCHED_OPTIONS, PARALLEL_OPTIONS) if mode == "batched" else (PARALLEL_OPTIONS, BATCHED_OPTIONS)
    wrong = sorted(set(spec.options) & (set(other) - set(mine)))
    if wrong:
        raise ValueError(f"tier option(s) {wrong} of {spec.backend!r} apply to {'parallel' if mode == 'batched' else 'batched'} "
                         f"tiers; this one is {mode} (set \"mode\" to change it)")
    mode_options = {k: spec.options.get(k, v) for k, v in mine.items()}
    backend_options = {k: v for k, v in spec.options.items() if k not in mine and k != MODE_KEY}
    return StorageSpec(name, spec, mode == "batched", mode_options, backend_options)


def check_builtin_options(spec: TierSpec, options: dict[str, Any], required: tuple[str, ...]) -> None:
    if spec.backend == "redis" and POLICY_OPTION in options:
        raise ValueError(f"the 'redis' tier's {POLICY_OPTION}: {NO_G4_POLICY}")
    allowed = _BUILTIN_OPTIONS[spec.backend]
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for the {spec.backend!r} tier; it takes {sorted(allowed)}")
    missing = [k for k in required if k not in options]
    if missing:
        raise ValueError(f"the {spec.backend!r} tier needs {missing}")
    if POLICY_OPTION in options:
        check_policy(options[POLICY_OPTION], f"the {spec.backend!r} tier's {POLICY_OPTION}")


REQUIRED = {HOST: ("size_gib",), "disk": ("path",), "redis": ("url",)}


def check_stack(spec: StackSpec) -> None:
    """Every tier's options, checked without building anything (no files, no connections): the
    built-ins' against their option lists, a plugin's against its constructor's signature."""
    if spec.host is not None:
        check_builtin_options(spec.host, spec.host.options, REQUIRED[HOST])
    for st in spec.storage:
        if st.tier.backend in REQUIRED:
            check_builtin_options(st.tier, st.backend_options, REQUIRED[st.tier.backend])
        else:
            plugin_class(st.tier, st.backend_options)


def plugin_class(spec: TierSpec, options: dict[str, Any]) -> type:
    """The backend class `spec` names, after checking that its constructor takes `options`."""
    from connectors.registry import load_backend_class

    cls = load_backend_class(spec.backend)
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as e:
        raise ValueError(f"backend {spec.backend!r} does not take options {sorted(options)}: {e}") from None
    return cls


def build_plugin(spec: TierSpec, options: dict[str, Any], namespace: bytes, secret: bytes | None) -> Any:
    """A storage backend by registry name or module:Class, built with `options`, sealed."""
    from kvstore.sealed import SealedBackend

    cls = plugin_class(spec, options)
    try:
        inner = cls(**options)
    except (TypeError, ValueError, OSError) as e:
        raise ValueError(f"backend {spec.backend!r} rejected its options {sorted(options)}: {e}") from e
    return SealedBackend(inner, namespace, secret, name=spec.backend)


def disk_path(options: dict[str, Any]) -> Path:
    path = options["path"]
    if not isinstance(path, str) or not path:
        raise ValueError(f"the disk tier's \"path\" must be a directory path; got {path!r}")
    return Path(path)
