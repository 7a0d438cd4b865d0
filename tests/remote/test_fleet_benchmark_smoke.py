"""benchmarks/fleet.py takes ~11 minutes at its defaults, so its --smoke mode runs here (a tiny random
model, a dozen requests; two replicas, a Redis Cluster and vllm-router per mode) to catch a change
that breaks the script, the router flags or what it reads from the replicas. Every routing mode runs
once: three closed-loop, and rr and kv_aware_g4 in the open-loop test (each mode costs ~30 s). CI
runs the disaggregated mode; the other two closed-loop modes and the open-loop test are marked slow
(`make test-all`): they check the benchmark and the router's flags, not the product, and took
~160 s of a 41-minute CI run on a 2-core AVX2 EPYC."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from redis_procs import CLI, SERVER
from router_procs import ROUTER

REPO = Path(__file__).resolve().parents[2]
CLOSED_MODES = ("rr_g4", "cache_aware_g4", "pd_g4")
OPEN_MODES = ("rr", "kv_aware_g4")

pytestmark = pytest.mark.skipif(SERVER is None or CLI is None, reason="redis-server/redis-cli not installed")


def _closed_loop(tmp_path, modes: tuple[str, ...]) -> tuple[dict, str]:
    if not os.path.exists(ROUTER):
        pytest.skip("vllm-router is not installed (pip install -e .[test])")
    out = tmp_path / "fleet.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fleet.py"), "--smoke", "--modes",
                           ",".join(modes), "--out", str(out)],
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["median"]) == set(modes)
    check_requests_found(doc)
    return doc, proc.stdout


def test_fleet_benchmark_runs_in_smoke_mode(tmp_path):
    """The disaggregated mode, which uses the most of the fleet (router, two roles, G4)."""
    doc, stdout = _closed_loop(tmp_path, ("pd_g4",))
    assert doc["median"]["pd_g4"]["G4_hit_tokens"] > 0  # the decode side loads every prompt from G4
    assert "pd_g4" in stdout and "target:" in stdout


@pytest.mark.slow
def test_the_other_closed_loop_modes_run_in_smoke_mode(tmp_path):
    """The router's other policies: ~30 s a mode, so under `make test-all` (the replicas' G4
    sharing itself is tests/remote/test_g4_fleet.py's)."""
    modes = tuple(m for m in CLOSED_MODES if m != "pd_g4")
    doc, _ = _closed_loop(tmp_path, modes)
    assert doc["median"]["rr_g4"]["G4_hit_tokens"] > 0  # the second replica finds the first one's prefixes


def check_requests_found(doc: dict) -> None:
    for mode, (run,) in doc["runs"].items():
        assert len(run["requests"]) == doc["workload"]["requests"], mode
        # every request was found in a replica's request log, by its prompt
        assert all(r["replica"] is not None for r in run["requests"]), mode
        assert sum(run["requests_per_replica"]) == doc["workload"]["requests"], mode  # pd_g4: the decode side


@pytest.mark.slow
def test_open_loop_replay_keeps_the_trace_times_and_the_turn_order(tmp_path):
    """--speedup (here so high that every request is due at once): each request goes at its trace
    time / speedup, or once its conversation's last turn has answered if that is later; never
    before either, and others go meanwhile."""
    if not os.path.exists(ROUTER):
        pytest.skip("vllm-router is not installed (pip install -e .[test])")
    out = tmp_path / "fleet.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fleet.py"), "--smoke", "--speedup", "1000",
                           "--modes", ",".join(OPEN_MODES), "--out", str(out)],
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["workload"]["speedup"] == 1000 and doc["workload"]["concurrency"] is None
    for mode, (run,) in doc["runs"].items():
        reqs = run["requests"]
        assert len(reqs) == doc["workload"]["requests"], mode
        last: dict[str, dict] = {}
        overlapped = False
        for r, s in zip(reqs, doc["workload"]["sessions"]):
            assert r["sent_s"] >= r["due_s"] - 0.05, (mode, r)
            if s in last:
                assert r["sent_s"] >= last[s]["done_s"] - 0.05, (mode, r, last[s])
            overlapped |= any(o["done_s"] > r["sent_s"] for o in last.values())
            last[s] = r
        assert overlapped, mode  # open loop: some request went out while another was in flight
    check_requests_found(doc)
    assert doc["median"]["rr"]["G4_hit_tokens"] == 0 and doc["median"]["rr"]["g4_bytes_read"] == 0  # no G4 there
    decisions = doc["runs"]["kv_aware_g4"][0]["kv_aware_decisions"]
    assert decisions["decisions"] == doc["workload"]["requests"]
    assert decisions["credited"] > 0, decisions  # the router saw the replicas' KV events and matched prompts
    assert "kv_aware_g4" in proc.stdout
