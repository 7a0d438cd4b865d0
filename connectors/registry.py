"""Find a storage backend by builtin name, `kvtier.backends` entry point, or `module:Class`."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any

from connectors.backend import StorageBackend
from plugins import load_plugin_class

BACKEND_GROUP = "kvtier.backends"

# name -> "module:Class", imported on use so that naming one backend never imports the others.
_BUILTIN_BACKENDS = {
    "disk": "kvstore.disk:DiskBackend",
    "memory": "kvstore.memory:MemoryBackend",
    "redis": "kvstore.remote:RedisBackend",  # as a tier, built by connectors.factory from the stack's options
}


def _plugins(group: str) -> dict[str, EntryPoint]:
    # Looked up at call time: a package pip-installed after start-up is found too.
    return {ep.name: ep for ep in entry_points(group=group)}


def available_backends() -> list[str]:
    """Builtin and installed-plugin backend names, sorted."""
    return sorted(_BUILTIN_BACKENDS.keys() | _plugins(BACKEND_GROUP).keys())


def load_backend_class(spec: str) -> type[StorageBackend]:
    """Resolve `spec`: a builtin name ("disk", "memory", "redis"), a `kvtier.backends` entry-point
    name, or a `module:Class` path. Raises ValueError naming the available backends."""
    return load_plugin_class(spec, StorageBackend, "storage backend", _BUILTIN_BACKENDS, _plugins(BACKEND_GROUP),
                             short="backend")


def load_backend(spec: str, **kwargs: Any) -> StorageBackend:
    """Instantiate the backend named by `spec` (see `load_backend_class`) with `kwargs`."""
    return load_backend_class(spec)(**kwargs)
