"""G4 (issue 6), acceptance 3 and 4: a killed, restarted or paused Redis becomes misses with
one log line and one timeout per cool-down, hits resume when it is back; a wrong password
disables G4 with a warning; values under the wrong key, truncated, damaged or written by
another model are never served, and are counted."""
from __future__ import annotations

import hashlib
import logging
import time

import pytest
import redis

from checkpoints import random_prompt
from engine import LLM, SamplingParams
from kvstore import resp
from kvstore.keys import extend_keys
from kvstore.namespace_info import REDIS_SUFFIX
from kvstore.remote import BreakerState, RedisBackend, RemoteConfig, redact
from redis_procs import SERVER, RedisProc, free_port

G4_LOGGERS = {"connectors.remote_tier", "kvstore.remote"}  # the G4 tier's log lines

pytestmark = pytest.mark.skipif(SERVER is None, reason="redis-server not installed")
NS, OTHER_NS = bytes(range(16)), bytes(range(1, 17))


def key(tag: str) -> bytes:
    return hashlib.sha256(tag.encode()).digest()[:16]


def backend(url: str, ns: bytes = NS, in_place: bool = True, **kw) -> RedisBackend:
    return RedisBackend(RemoteConfig(url, ns, timeout_s=kw.pop("timeout_s", 0.3), cooldown_s=kw.pop("cooldown_s", 1.0),
                                     **kw), in_place=in_place)


def g4_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name in G4_LOGGERS and r.levelno >= logging.WARNING]


def read(b: RedisBackend, keys: list[bytes], via: str, size: int) -> list[bytes | None]:
    """b.get, or b.get_into buffers of `size` bytes (values received in place, kvstore.resp)."""
    if via == "get":
        return b.get(keys)
    bufs = [bytearray(size) for _ in keys]
    return [bytes(buf) if ok else None for ok, buf in zip(b.get_into(keys, bufs), bufs)]


@pytest.mark.parametrize("via", ["get", "get_into"])
def test_bad_values_are_misses_and_counted(redis_proc, via):
    b = backend(redis_proc.url)
    raw_client = redis.Redis(port=redis_proc.port)
    name = b._name
    good = bytes(range(256)) * 64
    assert b.put([key("a"), key("m")], [good, good]) == [True, True]
    raw = raw_client.get(name(key("a")))
    raw_client.set(name(key("wrong-key")), raw)  # another key's value
    raw_client.set(name(key("short")), raw[:-7])  # truncated
    flipped = bytearray(raw)
    flipped[-100] ^= 0xFF
    raw_client.set(name(key("flipped")), bytes(flipped))  # damaged payload
    raw_client.set(name(key("junk")), b"not an entry at all")
    other = backend(redis_proc.url, OTHER_NS)  # another model writes under our name
    other.put([key("m")], [b"x" * 100])
    raw_client.set(name(key("m")), raw_client.get(other._name(key("m"))))
    bad = [key(t) for t in ("wrong-key", "short", "flipped", "junk", "m")]
    # One batch, good and bad interleaved: each bad value is judged and the stream stays in step.
    mixed = [key("a"), *bad[:2], key("a"), *bad[2:], key("a")]
    assert read(b, mixed, via, len(good)) == [good, None, None, good, None, None, None, good]
    assert b.stats.corrupt == 5
    assert all(raw_client.get(name(k)) is None for k in bad)  # removed, not left to be re-read
    assert read(b, [key("a")], via, len(good)) == [good]  # the good one is untouched
    b.close()
    other.close()


def test_get_into_misses_values_it_cannot_fill_and_keeps_intact_ones(redis_proc):
    b = backend(redis_proc.url)
    raw_client = redis.Redis(port=redis_proc.port)
    good, longer = bytes(range(256)) * 64, bytes(range(256)) * 65
    assert b.put([key("a"), key("long")], [good, longer]) == [True, True]
    raw_client.lpush(b._name(key("list")), b"x")  # GET answers WRONGTYPE: an error reply mid-batch
    assert read(b, [key("long"), key("list"), key("gone"), key("a")], "get_into", len(good)) == [None, None, None, good]
    assert b.stats.corrupt == 0 and (b.stats.hits, b.stats.misses) == (1, 3)  # the re-asked key counted once
    assert b.get([key("long")]) == [longer]  # an intact entry of another size is not damage
    assert b.in_place


def test_get_into_falls_back_to_redis_py_when_a_reply_is_out_of_step(redis_proc, monkeypatch, caplog):
    b = backend(redis_proc.url)
    good = bytes(range(256)) * 64
    assert b.put([key("a")], [good]) == [True]

    def out_of_step(self, head, body):
        raise resp.ProtocolError("not a GET reply: b'>3'")

    monkeypatch.setattr(resp.BulkReader, "reply", out_of_step)
    assert read(b, [key("a")], "get_into", len(good)) == [good]  # this call already reads the other way
    assert not b.in_place and b.breaker.state is BreakerState.CLOSED
    assert any("going through redis-py from now on" in m for m in g4_warnings(caplog))
    assert read(b, [key("a")], "get_into", len(good)) == [good]
    b.close()


@pytest.mark.parametrize("via", ["get", "get_into"])
def test_dead_redis_costs_one_timeout_per_cooldown_and_logs_once(tmp_path, caplog, via):
    caplog.set_level(logging.INFO)
    r = RedisProc(tmp_path / "redis", free_port()).start()
    b = backend(r.url, cooldown_s=1.0)
    assert b.put([key("x")], [b"v" * 1000]) == [True]
    r.kill()
    t0 = time.monotonic()
    for _ in range(200):
        assert read(b, [key("x")], via, 1000) == [None]
        assert b.put([key("y")], [b"v"]) == [False]
    assert time.monotonic() - t0 < 0.9, "an open breaker must not touch the network"
    assert b.breaker.state is BreakerState.OPEN
    assert len(g4_warnings(caplog)) == 1, g4_warnings(caplog)
    r.start()  # same port, empty (no persistence)
    time.sleep(1.1)
    assert b.put([key("x")], [b"v" * 1000]) == [True]  # the probe succeeds: closed again
    assert read(b, [key("x")], via, 1000) == [b"v" * 1000]
    assert b.breaker.state is BreakerState.CLOSED
    assert any("reachable again" in m for m in g4_warnings(caplog))
    b.close()
    r.stop()


@pytest.mark.parametrize("via", ["get", "get_into"])
def test_paused_redis_times_out_once_then_misses(redis_proc, caplog, via):
    caplog.set_level(logging.INFO)
    b = backend(redis_proc.url, timeout_s=0.3, cooldown_s=1.0)
    assert b.put([key("p")], [b"payload"]) == [True]
    redis_proc.pause()
    try:
        t0 = time.monotonic()
        assert read(b, [key("p")], via, 7) == [None]  # one socket timeout
        first = time.monotonic() - t0
        t0 = time.monotonic()
        assert b.exists([key("p")] * 50) == [False] * 50
        assert 0.25 <= first < 2.0 and time.monotonic() - t0 < 0.1
    finally:
        redis_proc.resume()
    time.sleep(1.1)
    assert read(b, [key("p")], via, 7) == [b"payload"]  # back, and the data survived the pause
    assert len([m for m in g4_warnings(caplog) if "failed" in m]) == 1
    b.close()


def test_wrong_password_disables_g4_with_a_warning(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    r = RedisProc(tmp_path / "redis", free_port(), ("--requirepass", "s3cret-pw")).start()
    try:
        port = r.port
        bad = backend(f"redis://:wrong-pw@127.0.0.1:{port}")
        assert bad.disabled and bad.put([key("k")], [b"v"]) == [False] and bad.get([key("k")]) == [None]
        warnings = g4_warnings(caplog)
        assert len(warnings) == 1 and "disabled" in warnings[0]
        good = backend(f"redis://:s3cret-pw@127.0.0.1:{port}")
        assert good.put([key("k")], [b"v"]) == [True] and good.get([key("k")]) == [b"v"]
        monkeypatch.setenv("KVTIER_REDIS_PASSWORD", "s3cret-pw")
        from_env = backend(f"redis://127.0.0.1:{port}")
        assert from_env.get([key("k")]) == [b"v"]
        for b in (bad, good, from_env):
            assert "s3cret-pw" not in repr(b.describe()) and "wrong-pw" not in repr(b.describe())
            b.close()
        assert not any("s3cret-pw" in rec.getMessage() or "wrong-pw" in rec.getMessage() for rec in caplog.records)
        assert redact("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"
    finally:
        r.stop()


@pytest.mark.parametrize("outage", ["kill", "pause"])
def test_engine_keeps_serving_through_a_redis_outage(ckpt_dir, tmp_path, caplog, outage):
    """kill: connections refused; pause (SIGSTOP): accepted but never answered. Either way the
    requests complete with the right tokens, the outage costs one socket timeout and one log line
    (not one per request or block), and G4 hits resume once Redis is back (empty, after a kill)."""
    caplog.set_level(logging.INFO)
    model = str(ckpt_dir("llama"))
    r = RedisProc(tmp_path / "redis", free_port()).start()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [random_prompt(120, 6200 + i) for i in range(8)]
    extra = {"kv_connector_extra_config": {"g4_timeout_s": 0.3}}
    ref = [o.outputs[0].token_ids for o in LLM(model, dtype="float32", num_gpu_blocks=96).generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]

    def run(llm, ps):
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp,
                                                             use_tqdm=False)]

    a = LLM(model, dtype="float32", num_gpu_blocks=96, kv_offload_remote=r.url, kv_offload_remote_trusted=True,
            kv_transfer_config=extra)
    try:
        assert run(a, prompts[:2]) == ref[:2]
        r.kill() if outage == "kill" else r.pause()
        t0 = time.monotonic()
        assert [run(a, [p])[0] for p in prompts[2:6]] == ref[2:6]  # misses, same tokens
        # One timeout and one log line per cool-down the outage spans: on a quiet machine the four
        # requests fit in one (2 s); on a loaded one (CI beside other jobs) they may span two.
        periods = 1 + int((time.monotonic() - t0) // a.engine.connector.tier("G4").backend.cfg.cooldown_s)
        failed = len([m for m in g4_warnings(caplog) if "failed" in m])
        assert 1 <= failed <= periods, f"{failed} outage warnings over {periods} cool-down period(s)"
        r.start() if outage == "kill" else r.resume()
        # Until the breaker's next probe: a probe that failed during the outage doubled the wait,
        # so a fixed cool-down sleep left G4 skipped for these writes in about one run in ten.
        time.sleep(a.engine.connector.tier("G4").backend.breaker.next_probe_in() + 0.2)
        assert run(a, prompts[6:]) == ref[6:]
        a.engine.flush_offload()
    finally:
        r.resume()
        a.close()
    b = LLM(model, dtype="float32", num_gpu_blocks=96, kv_offload_remote=r.url, kv_offload_remote_trusted=True)
    try:
        outs = b.generate([{"prompt_token_ids": p} for p in prompts[6:]], sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref[6:]
        assert all(o.cached_tokens_by_tier.get("G4", 0) == 112 for o in outs)  # hits resumed
    finally:
        b.close()
        r.stop()


def test_a_missing_block_mid_prompt_stops_the_g4_load_there(ckpt_dir, redis_proc):
    """Blocks 0-4 come from G4, block 5 is gone, so the rest (the batch already in flight
    included) is recomputed, with the same tokens; nothing after the gap is scattered."""
    model = str(ckpt_dir("llama"))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = random_prompt(600, 6400)  # 37 full blocks: three G4 batches of 16
    a = LLM(model, dtype="float32", num_gpu_blocks=96, kv_offload_remote=redis_proc.url, kv_offload_remote_trusted=True)
    ref = a.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
    a.engine.flush_offload()
    a.close()
    client = redis.Redis(port=redis_proc.port)
    names = sorted(k for k in client.keys("kvtier:*") if not k.endswith(b":" + REDIS_SUFFIX.encode()))
    assert len(names) == 37  # block entries; the namespace's record key aside
    b = LLM(model, dtype="float32", num_gpu_blocks=96, kv_offload_remote=redis_proc.url, kv_offload_remote_trusted=True)
    try:
        keys: list = []
        extend_keys(keys, prompt, 16, None)  # the offload block keys (offload block = G1 block here)
        client.delete(b.engine.connector.tier("G4").backend._name(keys[5]))
        out = b.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref
        assert out.cached_tokens_by_tier.get("G4", 0) == 5 * 16
    finally:
        b.close()


def test_put_sends_the_bytes_redis_py_would_with_the_ttl(redis_proc):
    """put sends header and payload as they are (kvstore.resp): the stored value equals the one a
    redis-py pipeline stores (the old path as the oracle), and the TTL is set."""
    raw_client = redis.Redis(port=redis_proc.port)
    b = backend(redis_proc.url, ttl_s=100.0)
    payloads = [bytes([i]) * (70_000 + i) for i in range(3)] + [b""]
    keys = [key(f"t{i}") for i in range(4)]
    assert b.put(keys, payloads) == [True] * 4
    direct = [raw_client.get(b._name(k)) for k in keys]
    assert all(0 < raw_client.pttl(b._name(k)) <= 100_000 for k in keys)
    raw_client.delete(*[b._name(k) for k in keys])
    b = backend(redis_proc.url, ttl_s=100.0, in_place=False)
    assert b.put(keys, payloads) == [True] * 4
    assert [raw_client.get(b._name(k)) for k in keys] == direct
    assert b.get(keys) == payloads
    b.close()


def test_a_refused_put_is_counted_and_logged_once_per_batch(redis_proc, caplog):
    raw_client = redis.Redis(port=redis_proc.port)
    b = backend(redis_proc.url)
    raw_client.config_set("maxmemory-policy", "noeviction")
    raw_client.config_set("maxmemory", str(int(raw_client.info("memory")["used_memory"])))  # full: OOM
    assert b.put([key(f"o{i}") for i in range(8)], [bytes(100_000)] * 8) == [False] * 8
    assert b.stats.write_errors == 8 and b.in_place
    assert len([m for m in g4_warnings(caplog) if "refused" in m]) == 1
    assert b.breaker.state is BreakerState.CLOSED  # a refusal is not an outage
    raw_client.config_set("maxmemory", "0")
    assert b.put([key("o0")], [bytes(100_000)]) == [True]
    b.close()
