"""G4 (issue 6), acceptance 1 and 2: engines in separate processes share prefixes through one
Redis (or a 3-node Redis Cluster). Engine B, with cold G1/G2/G3, gets G4 hits for what engine
A served, and its tokens equal A's (and a no-offload run's); another cache_salt or another model
gets none."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import random_prompt
from kvstore.namespace_info import REDIS_SUFFIX
from kvstore.remote import RedisBackend, RemoteConfig
from redis_procs import SERVER, start_cluster

pytestmark = pytest.mark.skipif(SERVER is None, reason="redis-server not installed")
HERE = Path(__file__).resolve().parent
PROMPTS = [random_prompt(300, 6101), random_prompt(200, 6102)]


def engine(model: Path, url: str | None, *, salt: str | None = None, **llm) -> dict:
    args = {"prompts": PROMPTS, "salt": salt, "llm": {"num_gpu_blocks": 128, **llm}}
    if url:
        args["llm"].update(kv_offload_remote=url, kv_offload_remote_trusted=True)
    r = subprocess.run([sys.executable, str(HERE / "engine_proc.py"), str(model), json.dumps(args)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def g4_hits(out: dict) -> list[int]:
    return [t.get("G4", 0) for t in out["by_tier"]]


def test_engine_b_reuses_what_engine_a_served(ckpt_dir, redis_proc, tmp_path):
    model = ckpt_dir("llama")
    ref = engine(model, None)
    a = engine(model, redis_proc.url, kv_offloading_size=0.02, kv_offload_disk=str(tmp_path / "a-g3"))
    assert a["tokens"] == ref["tokens"] and g4_hits(a) == [0, 0]
    assert a["g4"]["written_blocks"] >= (300 + 200) // 16 - 2
    keys = redis_proc.cli("--scan", "--pattern", "kvtier:*").split()
    records = [k for k in keys if k.endswith(":" + REDIS_SUFFIX)]  # one per namespace: what kvtier kv shows
    assert len(records) == 1 and len(keys) - 1 == a["g4"]["written_blocks"]
    # B: a fresh process, its own empty G2 and G3; everything below G1 comes from G4.
    b = engine(model, redis_proc.url, kv_offloading_size=0.02, kv_offload_disk=str(tmp_path / "b-g3"))
    assert b["tokens"] == ref["tokens"]
    assert g4_hits(b) == [288, 192]  # every full 16-token block
    assert b["g4"]["hit_tokens"] == 288 + 192
    # B promoted the hits into its G3: C on B's directory hits G3 with G4 gone.
    c = engine(model, None, kv_offload_disk=str(tmp_path / "b-g3"))
    assert [t.get("G3", 0) for t in c["by_tier"]] == [288, 192] and c["tokens"] == ref["tokens"]


def test_no_sharing_across_salts_or_models(ckpt_dir, redis_proc):
    engine(ckpt_dir("llama"), redis_proc.url, salt="tenant-a")
    assert g4_hits(engine(ckpt_dir("llama"), redis_proc.url, salt="tenant-b")) == [0, 0]
    assert g4_hits(engine(ckpt_dir("llama"), redis_proc.url, salt="tenant-a")) == [288, 192]
    # Another model (and another dtype of the same model) reads nothing of these entries.
    assert g4_hits(engine(ckpt_dir("qwen3"), redis_proc.url, salt="tenant-a")) == [0, 0]
    assert g4_hits(engine(ckpt_dir("llama"), redis_proc.url, salt="tenant-a", dtype="bfloat16")) == [0, 0]


def test_redis_cluster_shares_and_spreads_keys(ckpt_dir, tmp_path):
    nodes = start_cluster(tmp_path / "cluster")
    try:
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)
        model = ckpt_dir("llama")
        a = engine(model, url)
        b = engine(model, url)
        assert b["tokens"] == a["tokens"] and g4_hits(b) == [288, 192]
        per_node = [int(n.cli("dbsize").strip()) for n in nodes]
        # The block entries and one namespace record (both engines write the same one).
        assert sum(per_node) == a["g4"]["written_blocks"] + 1 and all(k > 0 for k in per_node), per_node
        reads_in_place_per_node(url)
    finally:
        for n in nodes:
            n.stop()


def reads_in_place_per_node(url: str) -> None:
    """A cluster backend's get_into asks each key's node in one round trip per node, values
    received in place; a key asked of the wrong node (a stale slot map: MOVED) is asked again
    through redis-py, which follows the redirect."""
    ns = bytes(range(16))
    b = RedisBackend(RemoteConfig(url, ns))
    keys = [hashlib.sha256(b"%d" % i).digest()[:16] for i in range(12)]
    values = [bytes([i]) * (3000 + i % 2) for i in range(12)]
    assert b.put(keys, values) == [True] * 12
    bufs = [bytearray(len(v)) for v in values]
    assert b.get_into(keys, bufs) == [True] * 12 and bufs == [bytearray(v) for v in values]
    nodes = {b.client.get_node_from_key(b._name(k)).name for k in keys}
    assert len(nodes) > 1, "the keys should span nodes"
    one = b.client.get_node_from_key(b._name(keys[0]))
    b.client.get_node_from_key = lambda name, replica=False: one  # every key to one node
    bufs = [bytearray(len(v)) for v in values]
    assert b.get_into(keys, bufs) == [True] * 12 and bufs == [bytearray(v) for v in values]
    assert b.in_place and b.stats.corrupt == 0
    b.close()
