"""G4 (issue 6): the Redis backend keeps the storage-backend contract (the conformance kit,
against a real redis-server), never serves a bad value, and turns a dead or paused server into
misses with one timeout per cool-down."""
from __future__ import annotations

import hashlib

import pytest

from connectors.conformance import BackendConformance
from kvstore.remote import RedisBackend, RemoteConfig
from redis_procs import SERVER, RedisProc, free_port

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))


def key(tag: str) -> bytes:
    return hashlib.sha256(tag.encode()).digest()[:16]


@pytest.mark.skipif(SERVER is None, reason="redis-server not installed")
class TestRedisBackend(BackendConformance):
    @pytest.fixture(autouse=True)
    def _server(self, tmp_path):
        self.redis = RedisProc(tmp_path / "redis", free_port()).start()
        yield
        self.redis.stop()

    def make_backend(self, tmp_path):
        return RedisBackend(RemoteConfig(self.redis.url, NS, timeout_s=5.0))
