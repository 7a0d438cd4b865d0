"""Find an eviction policy by name, entry point, or `module:Class` path."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from policies.base import EvictionPolicy
from policies.lru import LRUPolicy
from plugins import load_plugin_class
from policies.priority import PriorityPolicy

ENTRY_POINT_GROUP = "kvtier.policies"

# The only name -> class table; builtins win over plugins of the same name.
_BUILTIN: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRUPolicy, PriorityPolicy)}


def _plugins() -> dict[str, EntryPoint]:
    # `entry_points` is looked up at call time so tests can monkeypatch this module's name.
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_policies() -> list[str]:
    """Builtin and installed-plugin policy names, sorted."""
    return sorted(_BUILTIN.keys() | _plugins().keys())


def load_policy_class(spec: str) -> type[EvictionPolicy]:
    """Resolve `spec` (builtin name, `kvtier.policies` entry point, or `module:Class`)."""
    return load_plugin_class(spec, EvictionPolicy, "eviction policy", _BUILTIN, _plugins(), short="policy")


def make_policy(spec: str) -> EvictionPolicy:
    """Instantiate the policy named by `spec` (see `load_policy_class`); ValueError if
    it cannot be resolved."""
    return load_policy_class(spec)()
