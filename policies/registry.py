"""Find an eviction policy by name, entry point, or `module:Class` path, with its options.

A policy spec is a string (a name, an entry point, or `module:Class`) or a mapping
`{"name": NAME, "options": {...}}`; a string that starts with `{` is that mapping as JSON, so a
command-line flag can carry options.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType

from plugins import load_plugin_class
from policies.base import EvictionPolicy
from policies.lru import LRUPolicy
from policies.priority import PriorityPolicy
from policies.turn_lru import TurnLRUPolicy

ENTRY_POINT_GROUP = "kvtier.policies"
SPEC_KEYS = ("name", "options")

# The only name -> class table; builtins win over plugins of the same name.
_BUILTIN: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRUPolicy, PriorityPolicy, TurnLRUPolicy)}


@dataclass(frozen=True)
class PolicySpec:
    """A policy's name (see `load_policy_class`) and the options its `from_config` gets."""

    name: str
    options: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"an eviction policy's \"name\" must be a non-empty string; got {self.name!r}")
        if not isinstance(self.options, Mapping):
            raise ValueError(f"eviction policy {self.name!r}: \"options\" must be a mapping; got {self.options!r}")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))  # frozen means frozen

    @classmethod
    def parse(cls, spec: PolicySpecLike) -> PolicySpec:
        """`spec` as a PolicySpec; ValueError naming what is wrong with it."""
        if isinstance(spec, PolicySpec):
            return spec
        if isinstance(spec, str):
            if not spec.lstrip().startswith("{"):
                return cls(spec)
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"eviction policy {spec!r} starts with '{{' but is not valid JSON: {e}") from None
        if not isinstance(spec, Mapping):
            raise ValueError(f"an eviction policy is a name or {{\"name\": ..., \"options\": {{...}}}}; got {spec!r}")
        unknown = sorted(set(spec) - set(SPEC_KEYS))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown} in eviction policy {dict(spec)!r}; it takes {list(SPEC_KEYS)}")
        if "name" not in spec:
            raise ValueError(f"eviction policy {dict(spec)!r} has no \"name\"")
        return cls(spec["name"], spec.get("options", {}))  # type: ignore[arg-type]


PolicySpecLike = str | Mapping[str, object] | PolicySpec


def _plugins() -> dict[str, EntryPoint]:
    # `entry_points` is looked up at call time so tests can monkeypatch this module's name.
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_policies() -> list[str]:
    """Builtin and installed-plugin policy names, sorted."""
    return sorted(_BUILTIN.keys() | _plugins().keys())


def load_policy_class(spec: str) -> type[EvictionPolicy]:
    """Resolve `spec` (builtin name, `kvtier.policies` entry point, or `module:Class`)."""
    return load_plugin_class(spec, EvictionPolicy, "eviction policy", _BUILTIN, _plugins(), short="policy")


def make_policy(spec: PolicySpecLike, capacity: int | None = None) -> EvictionPolicy:
    """A fresh policy for a tier of `capacity` blocks (None: unknown), from a name or a
    `{"name", "options"}` spec (see the module docstring); ValueError if the name cannot be
    resolved or the policy refuses the options."""
    parsed = PolicySpec.parse(spec)
    cls = load_policy_class(parsed.name)
    try:
        return cls.from_config(capacity, parsed.options)
    except TypeError as e:  # an option of the wrong type, met by a from_config that does not check it
        raise ValueError(f"eviction policy {parsed.name!r} rejected its options {dict(parsed.options)}: {e}") from None


def check_policy(spec: PolicySpecLike, where: str) -> None:
    """Build `spec`'s policy once, its tier's size unknown, to check its name and options before
    anything runs; ValueError prefixed with `where` (the flag or key that gave it)."""
    try:
        make_policy(spec)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
