"""KV events of G4 (Redis): each block this engine writes is a BlockStored on remote storage,
named by its G1 blocks like every other tier's (tests/connectors/test_kv_events.py has the
format and the other tiers); Redis's own removals cannot be seen, so none is announced."""
from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from checkpoints import random_prompt
from engine import LLM, SamplingParams
from redis_procs import SERVER

pytestmark = pytest.mark.skipif(SERVER is None, reason="redis-server not installed")
EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "topic": "kvt"}
KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "locality"]


def _run(llm: LLM, prompt: list[int]) -> tuple[list[dict], dict[str, int]]:
    """The events `prompt`'s generation publishes (its offload writes flushed), and its hits by tier."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(llm.engine.publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvt")
    time.sleep(0.3)  # ZMQ's slow joiner
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    llm.engine.flush_offload()  # G4 writes land on the tier's writer thread: the next step publishes them
    llm.generate([{"prompt_token_ids": random_prompt(5, 10)}], SamplingParams(max_tokens=1), use_tqdm=False)
    events, until = [], time.monotonic() + 1.5
    while time.monotonic() < until:
        if sub.poll(100):
            _, _, payload = sub.recv_multipart()
            events += msgpack.unpackb(payload, raw=False)[1]
    sub.close()
    return events, out[0].cached_tokens_by_tier


def _chunks(events: list[dict], medium: str, locality: str) -> list[dict]:
    return [e for e in events if e["type"] == "BlockStored" and e["medium"] == medium and e.get("locality") == locality]


def test_g4_writes_are_announced_as_remote_storage(ckpt_dir, redis_proc):
    model, prompt = str(ckpt_dir("qwen3")), random_prompt(100, 9)
    kw = {"dtype": "float32", "kv_offload_block_size": 32, "kv_offload_remote": redis_proc.url,
          "kv_offload_remote_trusted": True, "kv_events_config": EVENTS}
    a = LLM(model, **kw)  # G4 alone: stores go straight from G1 to Redis
    events, _ = _run(a, prompt)
    a.close()
    gpu = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "GPU"]
    g1 = [e["block_hashes"][0] for e in gpu[:100 // 16]]
    assert [e["token_ids"] for e in gpu[:6]] == [prompt[16 * i:16 * (i + 1)] for i in range(6)]
    g4 = sorted(_chunks(events, "STORAGE", "REMOTE"), key=lambda e: g1.index(e["block_hashes"][0]))
    assert len(g4) == 3 and all(list(e) == KEYS for e in g4)
    for j, e in enumerate(g4):  # self-describing: G1-granular hashes, parent, tokens, G1's block size
        assert e["block_hashes"] == g1[2 * j:2 * j + 2] and e["parent_block_hash"] == (g1[2 * j - 1] if j else None)
        assert e["token_ids"] == prompt[32 * j:32 * (j + 1)] and e["block_size"] == 16
    assert not [e for e in events if e["type"] == "BlockRemoved" and e.get("locality") == "REMOTE"]

    b = LLM(model, kv_offloading_size=0.01, **kw)  # a fresh engine: loads from Redis through its G2
    events, hits = _run(b, prompt)
    b.close()
    assert hits.get("G4") == 96, hits
    assert not _chunks(events, "STORAGE", "REMOTE")  # B wrote nothing: Redis had it all
    promoted = _chunks(events, "CPU", "LOCAL")
    assert sorted(h for e in promoted for h in e["block_hashes"]) == sorted(g1)
