"""KV events reach a ZMQ subscriber as msgpack, tagged with the tier that changed."""
from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from checkpoints import random_prompt
from engine import LLM, SamplingParams


def _receive(sock: zmq.Socket, until: float) -> list[list]:
    events, seqs = [], []
    while time.monotonic() < until:
        if not sock.poll(100):
            continue
        topic, seq, payload = sock.recv_multipart()
        assert topic == b"kvt"
        seqs.append(int.from_bytes(seq, "big"))
        ts, batch = msgpack.unpackb(payload, raw=False)
        events.extend(batch)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True, "sequence numbers skip"
    return events


def test_events_report_g1_and_g2_changes(ckpt_dir):
    llm = LLM(str(ckpt_dir("qwen3")), dtype="float32", kv_offloading_size=0.01, kv_offload_block_size=32,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": "tcp://127.0.0.1:*", "topic": "kvt"})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(llm.engine.publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvt")
    time.sleep(0.3)  # ZMQ's slow joiner: let the subscription reach the publisher first
    prompt = random_prompt(100, 9)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    llm.engine.flush_offload()
    llm.engine.pool.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": random_prompt(5, 10)}], SamplingParams(max_tokens=1), use_tqdm=False)
    events = _receive(sub, time.monotonic() + 1.5)
    stored_gpu = [e for e in events if e[0] == "BlockStored" and e[5] == "GPU"]
    assert len(stored_gpu) >= 100 // 16, events[:3]
    first = stored_gpu[0]
    assert first[2] is None and first[3] == prompt[:16] and first[4] == 16  # root block: no parent
    assert stored_gpu[1][2] == first[1][0]  # chained: the next block names its parent
    assert any(e[0] == "BlockStored" and e[5] == "CPU" for e in events)
    removed = {h for e in events if e[0] == "BlockRemoved" and e[2] == "GPU" for h in e[1]}
    assert {e[1][0] for e in stored_gpu} <= removed  # the reset evicted every cached G1 block
    llm.close()
    sub.close()


def test_bad_events_config_is_a_value_error(ckpt_dir):
    with pytest.raises(ValueError, match="endpoint"):
        LLM(str(ckpt_dir("qwen3")), dtype="float32", kv_events_config={"enable_kv_cache_events": True})
    with pytest.raises(ValueError, match="unknown kv_events_config"):
        LLM(str(ckpt_dir("qwen3")), dtype="float32", kv_events_config={"enable_kv_cache_events": True, "bogus": 1})


def test_events_off_the_loopback_warn_that_they_reveal_prompts(caplog):
    """Events carry every stored block's token ids, salted tenants' too (issue 11, finding 8)."""
    import logging

    from engine.kv_events import KVEventsConfig, ZmqEventPublisher, is_loopback

    assert is_loopback("tcp://127.0.0.1:5557") and is_loopback("tcp://[::1]:5557") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:5557") and not is_loopback("tcp://*:5557")
    for endpoint, warns in [("tcp://127.0.0.1:*", False), ("tcp://0.0.0.0:*", True)]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="engine"):
            pub = ZmqEventPublisher(KVEventsConfig(endpoint))
            pub.close()
        assert any("can read prompts" in r.message for r in caplog.records) == warns, endpoint


def test_unimplemented_event_keys_are_refused():
    import pytest

    from engine.kv_events import KVEventsConfig

    with pytest.raises(ValueError, match="replay_endpoint"):
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:1",
                                  "replay_endpoint": "tcp://127.0.0.1:2"})
    assert KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoint": "tcp://x:1", "hwm": 10}).hwm == 10


def test_kv_groups_publish_one_event_per_token_block(ckpt_dir):
    """Gemma 3 lays G1 out in two KV groups: events still describe token blocks (the first
    group's), and every BlockRemoved names a block a BlockStored announced."""
    llm = LLM(str(ckpt_dir("gemma3")), dtype="float32", block_size=16,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                "endpoint": "tcp://127.0.0.1:*", "topic": "kvt"})
    assert len(llm.engine.kv.windows) == 2
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(llm.engine.publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvt")
    time.sleep(0.3)
    prompt = random_prompt(100, 11)  # past the 48-token window: the sliding group releases blocks
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    llm.engine.pool.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": random_prompt(5, 12)}], SamplingParams(max_tokens=1), use_tqdm=False)  # publishes
    events = _receive(sub, time.monotonic() + 1.5)
    stored = [e[1][0] for e in events if e[0] == "BlockStored"]
    removed = {h for e in events if e[0] == "BlockRemoved" for h in e[1]}
    assert len(stored) == len(set(stored)) == (100 + 4 - 1) // 16  # one per full token block
    assert removed == set(stored)
    llm.close()
    sub.close()
