"""Find a storage backend by builtin name, `kvtier.backends` entry point, or `module:Class`."""

from __future__ import annotations

import importlib
import inspect
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from connectors.backend import StorageBackend

BACKEND_GROUP = "kvtier.backends"

# name -> "module:Class", imported on use so that naming one backend never imports the others.
_BUILTIN_BACKENDS = {
    "disk": "kvstore.disk:DiskBackend",
    "memory": "kvstore.memory:MemoryBackend",
}


def _plugins(group: str) -> dict[str, EntryPoint]:
    # Looked up at call time: a package pip-installed after start-up is found too.
    return {ep.name: ep for ep in entry_points(group=group)}


def available_backends() -> list[str]:
    """Builtin and installed-plugin backend names, sorted."""
    return sorted(_BUILTIN_BACKENDS.keys() | _plugins(BACKEND_GROUP).keys())


def _import_path(spec: str, what: str) -> object:
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


def load_backend_class(spec: str) -> type[StorageBackend]:
    """Resolve `spec`: a builtin name ("disk", "memory"), a `kvtier.backends` entry-point
    name, or a `module:Class` path. Raises ValueError naming the available backends."""
    if spec in _BUILTIN_BACKENDS:
        obj = _import_path(_BUILTIN_BACKENDS[spec], "backend")
    elif ":" in spec:
        obj = _import_path(spec, "backend")
    else:
        plugins = _plugins(BACKEND_GROUP)
        if spec not in plugins:
            names = ", ".join(sorted(_BUILTIN_BACKENDS.keys() | plugins.keys()))
            raise ValueError(f"unknown storage backend {spec!r}; available: {names} (or a 'module:Class' path)")
        try:
            obj = plugins[spec].load()
        except Exception as e:  # a broken plugin is a configuration error, reported as such
            raise ValueError(f"cannot load backend plugin {spec!r}: {e}") from e
    if not (isinstance(obj, type) and issubclass(obj, StorageBackend)):
        raise ValueError(f"{spec!r} resolves to {obj!r}, which is not a StorageBackend subclass")
    if inspect.isabstract(obj):
        raise ValueError(f"{spec!r} resolves to abstract class {obj.__qualname__}")
    return obj


def load_backend(spec: str, **kwargs: Any) -> StorageBackend:
    """Instantiate the backend named by `spec` (see `load_backend_class`) with `kwargs`."""
    return load_backend_class(spec)(**kwargs)
