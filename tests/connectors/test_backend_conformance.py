"""The builtin backends pass the conformance kit."""

from __future__ import annotations

from connectors.conformance import BackendConformance
from kvstore.disk import DiskBackend
from kvstore.memory import MemoryBackend

NAMESPACE = bytes(range(16))


class TestMemoryBackend(BackendConformance):
    def make_backend(self, tmp_path):
        return MemoryBackend(capacity_bytes=64 << 20)


class TestDiskBackend(BackendConformance):
    def make_backend(self, tmp_path):
        return DiskBackend(tmp_path / "g3", capacity_bytes=64 << 20, namespace=NAMESPACE)


class TestDiskBackendFsync(BackendConformance):
    """fsync=True: the same paths plus fsync of file and directory (a shorter concurrent phase)."""

    ops_per_thread = 40
    test_many_keys_not_lost = None  # 600 fsyncs (seconds) to re-check what TestDiskBackend checks

    def make_backend(self, tmp_path):
        return DiskBackend(tmp_path / "g3", capacity_bytes=64 << 20, namespace=NAMESPACE, fsync=True)
