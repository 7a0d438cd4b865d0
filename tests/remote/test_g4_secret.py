"""Issue 11, finding 4 (G4): with a KV secret, a value planted in the shared Redis by a client
that can write to it (a changed payload re-sealed with an unkeyed checksum, or with the keyed
algorithm byte but unkeyed sums) is a counted miss, is deleted, and engine outputs stay
identical to offload off."""
from __future__ import annotations

import hashlib

import pytest
import redis

from checkpoints import random_prompt
from engine import LLM, SamplingParams
from kvstore.entry import ALG_BLAKE2B, ALG_HMAC_SHA256, ALG_XXH3, HEADER_SIZE, EntryCodec, encode_header
from kvstore.keys import extend_keys
from kvstore.remote import RedisBackend, RemoteConfig
from redis_procs import SERVER

pytestmark = pytest.mark.skipif(SERVER is None, reason="redis-server not installed")
NS = bytes(range(16))
SECRET = b"g4 fleet secret"


def key(tag: str) -> bytes:
    return hashlib.sha256(tag.encode()).digest()[:16]


def backend(url: str, secret: bytes | None = SECRET) -> RedisBackend:
    return RedisBackend(RemoteConfig(url, NS, timeout_s=0.5, secret=secret))


def planted(raw: bytes, how: str, at: int = 100) -> bytes:
    """`raw` with one payload byte changed and re-sealed the way someone without the secret can."""
    data = bytearray(raw)
    data[HEADER_SIZE + at] ^= 0x40
    ns, k, body = bytes(data[12:28]), bytes(data[28:44]), memoryview(data)[HEADER_SIZE:]
    if how == "xxh3":
        data[:HEADER_SIZE] = encode_header(ns, k, body, ALG_XXH3)
    elif how == "keyed-byte-unkeyed-sums":
        head = bytearray(encode_header(ns, k, body, ALG_BLAKE2B))
        head[8] = ALG_HMAC_SHA256
        head[-8:] = hashlib.sha256(bytes(head[:-8])).digest()[:8]  # no key: anyone can
        data[:HEADER_SIZE] = head
    elif how == "another-secret":
        data[:HEADER_SIZE] = EntryCodec(b"not ours").seal(ns, k, body)
    else:
        assert how == "header-kept"
    return bytes(data)


@pytest.mark.parametrize("how", ["xxh3", "keyed-byte-unkeyed-sums", "another-secret", "header-kept"])
def test_planted_value_is_a_counted_miss_and_deleted(redis_proc, how):
    b = backend(redis_proc.url)
    raw_client = redis.Redis(port=redis_proc.port)
    good = bytes(range(256)) * 64
    ks = [key("a"), key("b"), key("c")]
    assert b.put(ks, [good] * 3) == [True] * 3
    name = b._name(ks[1])
    raw = raw_client.get(name)
    assert raw[8] == ALG_HMAC_SHA256 and SECRET not in raw
    raw_client.set(name, planted(raw, how))
    assert b.get(ks) == [good, None, good]
    assert b.stats.corrupt == 1 and b.stats.hits == 2
    assert raw_client.get(name) is None  # deleted, not left to be re-read
    assert "g4 fleet secret" not in repr(b.cfg)
    b.close()


def test_unkeyed_and_keyed_values_are_misses_across_the_secret_boundary(redis_proc):
    keyed, plain = backend(redis_proc.url), backend(redis_proc.url, secret=None)
    keyed.put([key("k")], [b"keyed" * 100])
    plain.put([key("p")], [b"plain" * 100])
    assert plain.get([key("k")]) == [None] and plain.stats.corrupt == 1  # cannot verify a MAC
    assert keyed.get([key("p")]) == [None] and keyed.stats.corrupt == 1  # an unkeyed value is not trusted
    keyed.close()
    plain.close()


def test_engine_outputs_stay_identical_with_planted_g4_values(ckpt_dir, redis_proc, tmp_path):
    model = str(ckpt_dir("llama"))
    secret = tmp_path / "kv.secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [random_prompt(200, 6500), random_prompt(200, 6501)]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    off = LLM(model, dtype="float32", num_gpu_blocks=96)
    ref = [o.outputs[0].token_ids for o in off.generate(inputs, sp, use_tqdm=False)]
    off.close()
    kw = dict(dtype="float32", num_gpu_blocks=96, kv_offload_remote=redis_proc.url, kv_offload_secret_file=str(secret))
    a = LLM(model, **kw)
    try:
        assert [o.outputs[0].token_ids for o in a.generate(inputs, sp, use_tqdm=False)] == ref
        a.engine.flush_offload()
    finally:
        a.close()
    client = redis.Redis(port=redis_proc.port)
    bad = {}
    for prompt, block, how in ((prompts[0], 3, "xxh3"), (prompts[1], 5, "keyed-byte-unkeyed-sums")):
        keys: list = []
        extend_keys(keys, prompt, 16, None)
        (name,) = client.keys(f"kvtier:*:{keys[block].hex()}")
        value = planted(client.get(name), how, at=2000)
        client.set(name, value)
        bad[name] = (block, value)
    b = LLM(model, **kw)
    try:
        outs = b.generate(inputs, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert [o.cached_tokens_by_tier.get("G4", 0) for o in outs] == [16 * blk for blk, _ in bad.values()]
        assert b.engine.connector.tier("G4").backend.stats.corrupt == 2
        b.engine.flush_offload()
    finally:
        b.close()
    for name, (_, value) in bad.items():  # deleted; or rewritten by B from the recomputed KV, keyed
        now = client.get(name)
        assert now != value and (now is None or now[8] == ALG_HMAC_SHA256)


# -- issue 38, finding 5: a shared tier is safe by default -----------------------------------------
def test_serve_with_g4_and_no_secret_refuses_to_start(ckpt_dir, redis_proc, monkeypatch):
    """Without a secret and without --kv-offload-remote-trusted, `kvtier serve` exits 2 before
    it spawns the engine, naming both ways out; an explicit stack's redis tier and the offline
    API are refused the same way."""
    import os
    import subprocess
    import sys

    from server.launch import REPO_ROOT

    monkeypatch.delenv("KVTIER_KV_SECRET", raising=False)
    model = str(ckpt_dir("llama"))
    stack = '{"kv_connector_extra_config": {"tiers": [{"backend": "redis", "url": "%s"}]}}' % redis_proc.url
    for flags, what in (([model, "--kv-offload-remote", redis_proc.url], "G4"),
                        ([model, "--kv-transfer-config", stack], "G3 (redis)")):
        r = subprocess.run([sys.executable, "-m", "server.cli", "serve", *flags], cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        rc, err = r.returncode, r.stderr
        assert rc == 2, err[-2000:]
        assert f"{what}" in err and "shared store" in err and "--kv-offload-remote-trusted" in err, err[-2000:]
        assert "--kv-offload-secret-file" in err and "Traceback" not in err
    with pytest.raises(ValueError, match="--kv-offload-remote-trusted"):
        LLM(model, kv_offload_remote=redis_proc.url)


@pytest.mark.parametrize("mode", ["secret", "trusted"])
def test_serve_with_g4_says_which_mode_it_runs(ckpt_dir, redis_proc, tmp_path, monkeypatch, mode):
    from eager_servers import eager_unless_chosen
    from server.launch import launch

    monkeypatch.delenv("KVTIER_KV_SECRET", raising=False)
    secret = tmp_path / "kv.secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    flags = ["--kv-offload-secret-file", str(secret)] if mode == "secret" else ["--kv-offload-remote-trusted"]
    import httpx

    srv = launch(eager_unless_chosen([str(ckpt_dir("llama")), "--num-gpu-blocks", "64", "--kv-offload-remote", redis_proc.url, *flags]),
                 {"OMP_NUM_THREADS": "1"})
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": random_prompt(40, 3), "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        srv.proc.terminate()
        assert srv.proc.wait(60) == 0
    said = "entries MAC'd with the KV secret" if mode == "secret" else "TRUSTED store without a KV secret"
    assert f"G4: {said}" in "".join(srv.lines), "".join(srv.lines)[-3000:]
