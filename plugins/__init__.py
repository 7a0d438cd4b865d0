"""Plugin class loading shared by every kvtier registry (policies, backends, connectors).

A spec is a builtin name, an entry-point name in the registry's group, or a `module:Class`
path. It is its own bottom-level package (stdlib only, below `policies`) so that every package
can use it without depending on the eviction policies.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from importlib.metadata import EntryPoint
from typing import TypeVar

T = TypeVar("T")


def import_path(spec: str, what: str) -> object:
    module_name, _, qualname = spec.partition(":")
    if not module_name or not qualname:
        raise ValueError(f"bad {what} path {spec!r}: expected 'module:Class'")
    try:
        obj: object = importlib.import_module(module_name)
        for attr in qualname.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load {what} {spec!r}: {e}") from e
    return obj


def load_plugin_class(spec: str, base: type[T], what: str, builtins: Mapping[str, type | str],
                      plugins: Mapping[str, EntryPoint], short: str | None = None) -> type[T]:
    """Resolves `spec` to a concrete subclass of `base`; ValueError naming the choices otherwise.
    Builtins (classes, or `module:Class` strings imported on use) win over plugins. `what`
    names the kind in messages ("eviction policy"); `short` in load errors ("policy")."""
    name = base.__name__
    article = "an" if name[0] in "AEIOU" else "a"
    what_short = short or what
    if spec in builtins:
        entry = builtins[spec]
        obj: object = import_path(entry, what_short) if isinstance(entry, str) else entry
    elif ":" in spec:
        obj = import_path(spec, what_short)
    else:
        if spec not in plugins:
            names = ", ".join(sorted(builtins.keys() | plugins.keys()))
            raise ValueError(f"unknown {what} {spec!r}; available: {names} (or a 'module:Class' path)")
        try:
            obj = plugins[spec].load()
        except Exception as e:  # a broken plugin is a configuration error, reported as such
            raise ValueError(f"cannot load {what_short} plugin {spec!r}: {e}") from e
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ValueError(f"{spec!r} resolves to {obj!r}, which is not {article} {name} subclass")
    if inspect.isabstract(obj):
        raise ValueError(f"{spec!r} resolves to abstract class {obj.__qualname__}")
    return obj
