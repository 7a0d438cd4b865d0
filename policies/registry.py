"""Find an eviction policy by name, entry point, or `module:Class` path."""

from __future__ import annotations

import importlib
import inspect
from importlib.metadata import EntryPoint, entry_points

from policies.base import EvictionPolicy
from policies.lru import LRUPolicy
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


def _import_path(spec: str) -> object:
    module_name, _, qualname = spec.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"bad policy path {spec!r}: expected 'module:Class'")
    try:
        obj: object = importlib.import_module(module_name)
        for attr in qualname.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load policy {spec!r}: {e}") from e
    return obj


def load_policy_class(spec: str) -> type[EvictionPolicy]:
    """Resolve `spec` (builtin name, `kvtier.policies` entry point, or `module:Class`)."""
    if spec in _BUILTIN:
        return _BUILTIN[spec]
    if ":" in spec:
        obj = _import_path(spec)
    else:
        plugins = _plugins()
        if spec not in plugins:
            names = ", ".join(sorted(_BUILTIN.keys() | plugins.keys()))
            raise ValueError(
                f"unknown eviction policy {spec!r}; available: {names} (or a 'module:Class' path)"
            )
        try:
            obj = plugins[spec].load()
        except Exception as e:  # a broken plugin is a configuration error, not a crash
            raise ValueError(f"cannot load policy plugin {spec!r}: {e}") from e
    if not (isinstance(obj, type) and issubclass(obj, EvictionPolicy)):
        raise ValueError(f"{spec!r} resolves to {obj!r}, which is not an EvictionPolicy subclass")
    if inspect.isabstract(obj):
        raise ValueError(f"{spec!r} resolves to abstract class {obj.__qualname__}")
    return obj


def make_policy(spec: str) -> EvictionPolicy:
    """Instantiate the policy named by `spec` (see `load_policy_class`); ValueError if
    it cannot be resolved."""
    return load_policy_class(spec)()
