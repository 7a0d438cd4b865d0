"""load_backend: builtin names, `module:Class` paths, and clear errors."""

from __future__ import annotations

import pytest

from connectors.backend import StorageBackend
from connectors.registry import available_backends, load_backend
from kvstore.disk import DiskBackend
from kvstore.memory import MemoryBackend

THIS = __name__


class NotABackend:
    pass


def test_builtin_names(tmp_path) -> None:
    assert {"disk", "memory"} <= set(available_backends())
    assert isinstance(load_backend("memory", capacity_bytes=1 << 20), MemoryBackend)
    b = load_backend("disk", root=tmp_path, capacity_bytes=1 << 20, namespace=bytes(16))
    assert isinstance(b, DiskBackend) and b.put([bytes(16)], [b"x"]) == [True]


def test_module_path() -> None:
    assert isinstance(load_backend("kvstore.memory:MemoryBackend"), MemoryBackend)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no-such-backend", r"unknown storage backend 'no-such-backend'; available: .*disk.*memory"),
        ("no_such_module:X", r"cannot load backend 'no_such_module:X'"),
        ("kvstore.memory:Nope", r"cannot load backend"),
        (f"{THIS}:NotABackend", r"not a StorageBackend subclass"),
        ("connectors.backend:StorageBackend", r"abstract class StorageBackend"),
        (":X", r"expected 'module:Class'"),
    ],
)
def test_errors_are_value_errors(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_backend(spec)


def test_constructor_errors_propagate(tmp_path) -> None:
    with pytest.raises(ValueError, match="namespace"):
        load_backend("disk", root=tmp_path, capacity_bytes=1, namespace=b"short")
    assert issubclass(DiskBackend, StorageBackend)
