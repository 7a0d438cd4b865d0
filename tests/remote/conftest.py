"""G4 fixtures: real Redis processes. Tests skip only when no server binary is installed
(`.ci/run` installs one)."""
from __future__ import annotations

import pytest

from redis_procs import SERVER, RedisProc, free_port

needs_redis = pytest.mark.skipif(SERVER is None, reason="redis-server/valkey-server not installed (make test installs it)")


@pytest.fixture
def redis_proc(tmp_path):
    if SERVER is None:
        pytest.skip("redis-server/valkey-server not installed")
    r = RedisProc(tmp_path / "redis", free_port()).start()
    yield r
    r.stop()
