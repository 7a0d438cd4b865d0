"""KV events reach a ZMQ subscriber in vLLM 0.32's wire format, every tier's in G1 terms.

The reference is vLLM's own encoding (vllm/distributed/kv_events.py: msgspec structs,
`KVEventBatch` array_like, events tagged maps with omit_defaults). vLLM cannot be imported
here, so `test_wire_format_is_vllms` pins the exact keys, their order and the batch shape;
kvtier's payload was checked byte for byte against msgspec's encoding of vLLM's classes.
"""
from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from checkpoints import random_prompt
from engine import LLM, SamplingParams
from offload_helpers import g2_gib

STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name"]
EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "topic": "kvt"}


def _subscribe(llm: LLM) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(llm.engine.publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kvt")
    time.sleep(0.3)  # ZMQ's slow joiner: let the subscription reach the publisher first
    return sub


def _receive(sock: zmq.Socket, until: float) -> list[dict]:
    events, seqs = [], []
    while time.monotonic() < until:
        if not sock.poll(100):
            continue
        topic, seq, payload = sock.recv_multipart()
        assert topic == b"kvt" and len(seq) == 8
        seqs.append(int.from_bytes(seq, "big"))
        ts, batch, rank = msgpack.unpackb(payload, raw=False)  # vLLM's [ts, events, data_parallel_rank]
        assert isinstance(ts, float) and rank == 0
        assert all(isinstance(e, dict) and next(iter(e)) == "type" for e in batch), batch[:2]
        events.extend(batch)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True, "sequence numbers skip"
    return events


def _publish_pending(llm: LLM) -> None:
    """Offload events land on transfer threads after the last step published: flush them,
    then run a step (a prompt with no full block, so it adds no event) to publish them."""
    llm.engine.flush_offload()
    llm.generate([{"prompt_token_ids": random_prompt(5, 10)}], SamplingParams(max_tokens=1), use_tqdm=False)


def _stored(events: list[dict], medium: str, locality: str | None = None) -> list[dict]:
    return [e for e in events if e["type"] == "BlockStored" and e["medium"] == medium and e.get("locality") == locality]


def _check_g1_chain(gpu: list[dict], prompt: list[int], n: int) -> list[bytes]:
    """The first n G1 events are the prompt's blocks in order, each naming its parent; their hashes."""
    assert len(gpu) >= n, gpu[:2]
    hashes = []
    for i, e in enumerate(gpu[:n]):
        assert list(e) == STORED_KEYS  # G1 has no locality
        assert len(e["block_hashes"]) == 1 and isinstance(e["block_hashes"][0], bytes)
        assert e["parent_block_hash"] == (hashes[-1] if i else None)
        assert e["token_ids"] == prompt[16 * i:16 * (i + 1)] and e["block_size"] == 16
        assert e["lora_id"] is None and e["lora_name"] is None
        hashes.append(e["block_hashes"][0])
    return hashes


def _check_chunks(events: list[dict], g1: list[bytes], prompt: list[int], per_chunk: int, locality: str) -> None:
    """Offload events name the G1 blocks of their chunk, chained like the G1 events."""
    assert events
    for e in events:
        assert list(e) == [*STORED_KEYS, "locality"] and e["locality"] == locality
        j = g1.index(e["block_hashes"][0]) // per_chunk
        assert e["block_hashes"] == g1[j * per_chunk:(j + 1) * per_chunk]
        assert e["parent_block_hash"] == (g1[j * per_chunk - 1] if j else None)
        assert e["token_ids"] == prompt[16 * per_chunk * j:16 * per_chunk * (j + 1)] and e["block_size"] == 16


def test_wire_format_is_vllms():
    """Exact keys, in msgspec's order (tag first, then declaration order; omit_defaults drops
    defaulted fields that are None), the tier -> medium/locality mapping, and the batch."""
    from engine.kv.kv_events import encode, encode_batch
    from kvstore.events import BlockRemoved, BlockStored, ChunkBlocks, TierKind

    h = [bytes([i]) * 16 for i in range(3)]
    blocks = ChunkBlocks((h[1], h[2]), h[0], tuple(range(32)), 16)
    assert encode(BlockStored([h[0]], None, list(range(16)), 16, TierKind.DEVICE)) == {
        "type": "BlockStored", "block_hashes": [h[0]], "parent_block_hash": None, "token_ids": list(range(16)),
        "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    where = {TierKind.HOST: ("CPU", "LOCAL"), TierKind.LOCAL_STORAGE: ("STORAGE", "LOCAL"),
             TierKind.REMOTE_STORAGE: ("STORAGE", "REMOTE")}
    for tier, (medium, locality) in where.items():
        stored = encode(BlockStored.of(blocks, tier))
        assert list(stored) == [*STORED_KEYS, "locality"]
        assert stored == {"type": "BlockStored", "block_hashes": [h[1], h[2]], "parent_block_hash": h[0],
                          "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": medium,
                          "lora_name": None, "locality": locality}
        removed = encode(BlockRemoved([h[1], h[2]], tier))
        assert list(removed) == ["type", "block_hashes", "medium", "locality"]
        assert removed == {"type": "BlockRemoved", "block_hashes": [h[1], h[2]], "medium": medium, "locality": locality}
    assert encode(BlockRemoved([h[0]], TierKind.DEVICE)) == {"type": "BlockRemoved", "block_hashes": [h[0]],
                                                              "medium": "GPU"}
    payload = encode_batch([BlockRemoved([h[0]], TierKind.DEVICE)], 12.5)
    assert msgpack.unpackb(payload, raw=False) == [12.5, [{"type": "BlockRemoved", "block_hashes": [h[0]],
                                                           "medium": "GPU"}], 0]
    assert payload[0] == 0x93 and payload[1] == 0xCB  # a 3-array whose ts is a float64, as msgspec writes it
    assert b"\xc4\x10" + h[0] in payload  # hashes are msgpack bin (16 bytes), not str


def test_g2_announces_only_what_it_can_name():
    """An entry stored without its G1 blocks (a KV group's other than the first, a write-back)
    is neither announced nor, when evicted, removed; one stored with them is both."""
    from kvstore.events import BlockRemoved, BlockStored, ChunkBlocks, EventBuffer, TierKind
    from kvstore.host import HostTier
    from policies import make_policy

    g2 = HostTier(1, 64, make_policy("lru"), events=EventBuffer())
    a = ChunkBlocks((b"a" * 16, b"A" * 16), None, tuple(range(32)), 16)
    for key, blocks in [(b"A" * 16, a), (b"B" * 16, None), (b"C" * 16, a)]:
        assert g2.prepare_store(key, b"d" * 16) is not None  # evicts the one before
        g2.complete_store(key, True, None, blocks)
        g2.check_integrity()
    assert g2.events.drain() == [BlockStored.of(a, TierKind.HOST), BlockRemoved([b"a" * 16, b"A" * 16], TierKind.HOST),
                                 BlockStored.of(a, TierKind.HOST)]


def test_g1_g2_g3_events_name_the_same_g1_blocks(ckpt_dir, tmp_path):
    """G1 events chain block by block; each G2/G3 store of a 32-token offload block lists its two
    G1 hashes (equal to the G1 events'), its parent and tokens. A restarted engine promotes the
    disk's blocks into G2 on a load and announces them the same way, from the load's chunks."""
    model, prompt = str(ckpt_dir("qwen3")), random_prompt(100, 9)
    kw = {"dtype": "float32", "kv_offloading_size": 0.01, "kv_offload_block_size": 32,
          "kv_offload_disk": str(tmp_path / "g3"), "kv_events_config": EVENTS}
    llm = LLM(model, **kw)
    sub = _subscribe(llm)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    _publish_pending(llm)
    llm.engine.pool.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": random_prompt(5, 11)}], SamplingParams(max_tokens=1), use_tqdm=False)
    events = _receive(sub, time.monotonic() + 1.5)
    llm.close()
    sub.close()
    g1 = _check_g1_chain(_stored(events, "GPU"), prompt, 100 // 16)
    for medium, locality in [("CPU", "LOCAL"), ("STORAGE", "LOCAL")]:
        chunks = _stored(events, medium, locality)
        assert len(chunks) == 100 // 32, chunks  # each offload block once
        _check_chunks(chunks, g1, prompt, 2, locality)
    removed = {h for e in events if e["type"] == "BlockRemoved" and e["medium"] == "GPU" for h in e["block_hashes"]}
    assert set(g1) <= removed  # the reset evicted every cached G1 block
    assert all(list(e) == ["type", "block_hashes", "medium"] for e in events if e["type"] == "BlockRemoved")

    llm = LLM(model, **kw)  # same disk: the prompt's offload blocks load from G3 through G2
    sub = _subscribe(llm)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert out[0].cached_tokens_by_tier.get("G3") == 96, out[0].cached_tokens_by_tier
    _publish_pending(llm)
    events = _receive(sub, time.monotonic() + 1.5)
    llm.close()
    sub.close()
    promoted = _stored(events, "CPU", "LOCAL")
    assert len(promoted) == 3 and not _stored(events, "STORAGE", "LOCAL")  # already on the disk
    _check_chunks(promoted, g1, prompt, 2, "LOCAL")


def test_g2_eviction_removes_the_g1_blocks_it_announced(ckpt_dir):
    """A two-slot G2 storing a prompt's three offload blocks evicts the first: its BlockRemoved
    fans out to the same G1-granular hashes its BlockStored listed."""
    model = ckpt_dir("qwen3")
    llm = LLM(str(model), dtype="float32", kv_offloading_size=g2_gib(model, 2, ob=32), kv_offload_block_size=32,
              kv_events_config=EVENTS)
    assert llm.engine.connector.g2.num_slots == 2
    sub = _subscribe(llm)
    prompt = random_prompt(100, 9)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    _publish_pending(llm)
    events = _receive(sub, time.monotonic() + 1.5)
    llm.engine.connector.g2.check_integrity()
    llm.close()
    sub.close()
    g1 = _check_g1_chain(_stored(events, "GPU"), prompt, 100 // 16)
    stored = _stored(events, "CPU", "LOCAL")
    _check_chunks(stored, g1, prompt, 2, "LOCAL")
    removed = [e for e in events if e["type"] == "BlockRemoved" and e["medium"] == "CPU"]
    assert [list(e) for e in removed] == [["type", "block_hashes", "medium", "locality"]]
    assert removed[0]["locality"] == "LOCAL" and removed[0]["block_hashes"] == g1[0:2]  # LRU: the first chunk


def test_bad_events_config_is_a_value_error(ckpt_dir):
    with pytest.raises(ValueError, match="endpoint"):
        LLM(str(ckpt_dir("qwen3")), dtype="float32", kv_events_config={"enable_kv_cache_events": True})
    with pytest.raises(ValueError, match="unknown kv_events_config"):
        LLM(str(ckpt_dir("qwen3")), dtype="float32", kv_events_config={"enable_kv_cache_events": True, "bogus": 1})


def test_events_off_the_loopback_warn_that_they_reveal_prompts(caplog):
    """Events carry every stored block's token ids, salted tenants' too (issue 11, finding 8)."""
    import logging

    from engine.kv.kv_events import KVEventsConfig, ZmqEventPublisher, is_loopback

    assert is_loopback("tcp://127.0.0.1:5557") and is_loopback("tcp://[::1]:5557") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:5557") and not is_loopback("tcp://*:5557")
    for endpoint, warns in [("tcp://127.0.0.1:*", False), ("tcp://0.0.0.0:*", True)]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="engine"):
            pub = ZmqEventPublisher(KVEventsConfig(endpoint))
            pub.close()
        assert any("can read prompts" in r.message for r in caplog.records) == warns, endpoint


def test_unimplemented_event_keys_are_refused():
    from engine.kv.kv_events import KVEventsConfig

    with pytest.raises(ValueError, match="max_queue_size"):
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:1",
                                  "max_queue_size": 10})
    with pytest.raises(ValueError, match="buffer_steps"):
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:1", "buffer_steps": 0})
    assert KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoint": "tcp://x:1", "hwm": 10}).hwm == 10


def test_replay_answers_missed_batches_as_vllm_router_asks():
    """vLLM's replay protocol: a DEALER sends [b"", start_seq]; the ROUTER answers [b"", topic, seq,
    payload] for each kept batch from start_seq on, then [b"", b"", -1, b""]. Oracle: the batches
    the PUB socket sent, byte for byte; only the last buffer_steps are kept."""
    from engine.kv.kv_events import KVEventsConfig, ZmqEventPublisher
    from engine.kv.kv_events_replay import END_SEQ
    from kvstore.events import BlockRemoved, TierKind

    cfg = KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:*", "topic": "t",
                                    "replay_endpoint": "tcp://127.0.0.1:*", "buffer_steps": 4})
    pub = ZmqEventPublisher(cfg)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(pub.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)
    try:
        for i in range(6):
            pub.publish([BlockRemoved([bytes([i]) * 16], TierKind.DEVICE)])
        live = [sub.recv_multipart() for _ in range(6)]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay.endpoint)
        dealer.send_multipart([b"", (3).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            frames = dealer.recv_multipart()
            if frames[-2] == END_SEQ:
                break
            got.append(frames[1:])
        assert got == live[3:]  # seqs 3, 4, 5: all kept (4 kept: 2..5)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        again = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            if frames[-2] == END_SEQ:
                break
            again.append(frames[1:])
        assert again == live[2:]  # seqs 0 and 1 fell out of the 4-batch buffer
        dealer.close()
    finally:
        sub.close()
        pub.close()


def test_kv_groups_publish_one_event_per_token_block(ckpt_dir):
    """Gemma 3 lays G1 out in two KV groups: events still describe token blocks (the first
    group's), and every BlockRemoved names a block a BlockStored announced."""
    llm = LLM(str(ckpt_dir("gemma3")), dtype="float32", block_size=16, kv_events_config=EVENTS)
    assert len(llm.engine.kv.windows) == 2
    sub = _subscribe(llm)
    prompt = random_prompt(100, 11)  # past the 48-token window: the sliding group releases blocks
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    llm.engine.pool.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": random_prompt(5, 12)}], SamplingParams(max_tokens=1), use_tqdm=False)  # publishes
    events = _receive(sub, time.monotonic() + 1.5)
    stored = [e["block_hashes"][0] for e in events if e["type"] == "BlockStored"]
    removed = {h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]}
    assert len(stored) == len(set(stored)) == (100 + 4 - 1) // 16  # one per full token block
    assert removed == set(stored)
    llm.close()
    sub.close()
