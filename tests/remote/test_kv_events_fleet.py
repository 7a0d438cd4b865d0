"""Issue 20, acceptance 4: `kvtier kv events` follows two real replicas (G1, G2, G3 and a shared
Redis G4) through a run, and its per-tier residency equals what each replica's /v1/kv/stats
reports afterwards. Oracle: the servers' own counts."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from redis_procs import SERVER, RedisProc, free_port
from router_procs import start_replica
from server.launch import REPO_ROOT
from test_router_fleet import complete, text

pytestmark = pytest.mark.skipif(SERVER is None, reason="redis-server not installed")


def test_the_residency_view_matches_each_replicas_stats(ckpt_dir, tmp_path):
    model = ckpt_dir("llama")
    redis = RedisProc(tmp_path / "redis", free_port()).start()
    replicas, watcher = [], None
    try:
        for name in ("a", "b"):
            # G1 small enough that it evicts (removal events), G2 of 24 offload blocks (evicts too).
            replicas.append(start_replica(model, "--served-model-name", "tiny", "--num-gpu-blocks", "32",
                                          "--kv-offloading-size", "0.0001", "--kv-offload-disk", str(tmp_path / name),
                                          "--kv-offload-remote", redis.url, "--kv-offload-remote-trusted", eager=True))
        cmd = [sys.executable, "-m", "server.cli", "kv", "events", *(f"{n}={r.events}" for n, r in zip("ab", replicas)),
               "--json", "--interval", "1"]
        for name, r in zip("ab", replicas):
            cmd += ["--stats-url", f"{name}={r.url}"]
        watcher = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert watcher.stdout is not None
        first = watcher.stdout.readline()  # its first summary: it has subscribed, and a view that
        assert first, watcher.stderr.read()[-2000:] if watcher.stderr else ""  # starts at batch 0 is exact
        time.sleep(0.5)  # ZMQ's slow joiner: the subscription reaches the publishers
        shared = text(60, 5)
        for i in range(12):  # both replicas, a shared prefix and private tails, G1 and G2 turning over
            for r in replicas:
                complete(r.url, shared + " " + text(40 + 10 * i, 100 + i), 4)
        time.sleep(3)  # the last steps' events and tier writes land
        watcher.send_signal(signal.SIGINT)
        out, err = watcher.communicate(timeout=60)
        assert watcher.returncode == 0, err[-2000:]
        final = json.loads((first + out).strip().splitlines()[-1])
        assert final["final"]
        for name in "ab":
            rep = final["replicas"][name]
            assert rep["state"] == "live", rep.get("stale_reasons")
            checks = rep["server"]
            assert set(checks) == {"G1", "G2", "G3", "G4"}, checks
            assert all(c["match"] is True for c in checks.values()), checks
            assert rep["tiers"]["G1"]["removes"] > 0 and rep["tiers"]["G2"]["removes"] > 0, rep["tiers"]  # evictions seen
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
        for r in replicas:
            r.stop()
        redis.stop()
