"""Issue 11, finding 4, engine level (G3): with a KV secret, entries planted in the G3 directory
are counted misses, are deleted, and the outputs stay identical to offload off.

Engine A (with the secret) fills G3. Then three entries get a changed KV payload, each sealed
the ways someone without the secret can:
  - payload changed, keyed header kept: caught when read (payload MAC);
  - payload changed, re-encoded with the unkeyed xxh3 algorithm: caught at start-up (a secret
    accepts only keyed entries);
  - payload changed, the keyed algorithm byte kept but both sums recomputed without a key:
    caught at start-up (header MAC).
Engine B, with the same secret, must serve each prompt up to its planted block only. Without a
secret the re-encoded entry would be served, and would change the outputs: see
test_offload_corruption.test_control_resealed_damage_would_change_the_outputs.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from kvstore.entry import ALG_BLAKE2B, ALG_HMAC_SHA256, ALG_XXH3, HEADER_SIZE, encode_header
from kvstore.keys import chain_keys
from offload_helpers import OB, check_integrity, hit_tokens, load_kinds, offload_llm, reference, run, tokens, workload

PROMPTS = workload()  # 300, 520, 641 tokens: 4, 8 and 10 reusable offload blocks
SECRET = "a fleet-wide kv secret"
PLANTS = {(0, 1): "header-kept", (1, 3): "xxh3", (2, 2): "keyed-byte-unkeyed-sums"}


# One entry per G3 file (g3_io_mib below one block), as these tests damage single entries by their
# files (tests/connectors/test_offload_files.py covers files holding runs of blocks).
PER_ENTRY_FILES = {"kv_transfer_config": {"kv_connector_extra_config": {"g3_io_mib": 1e-4}}}


@pytest.fixture(scope="module")
def ref(model_dir):
    return reference(model_dir, PROMPTS)


@pytest.fixture
def secret_file(tmp_path) -> str:
    p = tmp_path / "kv.secret"
    p.write_text(SECRET + "\n")
    p.chmod(0o600)
    return str(p)


def entry_path(disk: Path, prompt: list[int], chunk: int) -> Path:
    key = chain_keys(prompt, 16)[(chunk + 1) * (OB // 16) - 1]
    (ns,) = [d for d in disk.iterdir() if d.is_dir()]
    return ns / key.hex()[:2] / f"{key.hex()}.kvb"


def plant(path: Path, how: str) -> None:
    """Change one float32 of the KV payload by 2^128 and re-seal the entry as `how` says."""
    from connectors.codec import HEADER_BYTES

    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + HEADER_BYTES + 4 * 1000 + 3] ^= 0x40
    ns, key, body = bytes(raw[12:28]), bytes(raw[28:44]), memoryview(raw)[HEADER_SIZE:]
    if how == "xxh3":
        raw[:HEADER_SIZE] = encode_header(ns, key, body, ALG_XXH3)
    elif how == "keyed-byte-unkeyed-sums":
        head = bytearray(encode_header(ns, key, body, ALG_BLAKE2B))
        head[8] = ALG_HMAC_SHA256
        head[-8:] = hashlib.sha256(bytes(head[:-8])).digest()[:8]  # no key: anyone can
        raw[:HEADER_SIZE] = head
    path.write_bytes(bytes(raw))


def fill(model_dir, disk: Path, ref, secret_file: str) -> None:
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), **PER_ENTRY_FILES, kv_offload_secret_file=secret_file)
    try:
        assert tokens(run(llm, PROMPTS)) == ref
    finally:
        llm.close()


def test_planted_g3_entries_are_counted_misses_and_deleted(model_dir, ref, tmp_path, secret_file, caplog):
    disk = tmp_path / "g3"
    fill(model_dir, disk, ref, secret_file)
    planted = {}
    for (p, j), how in PLANTS.items():
        path = entry_path(disk, PROMPTS[p], j)
        assert path.read_bytes()[8] == ALG_HMAC_SHA256  # A wrote keyed entries
        plant(path, how)
        planted[path] = path.read_bytes()
    caplog.set_level(logging.DEBUG)
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), **PER_ENTRY_FILES, kv_offload_secret_file=secret_file)
    try:
        assert llm.engine.connector.tier("G3").backend.stats.corrupt == 2  # the two re-sealed headers, at start-up
        outs = run(llm, PROMPTS)
        assert tokens(outs) == ref
        assert load_kinds(outs) == [{"G3": j * OB} for (_, j) in PLANTS]  # served up to the planted block
        tiers = llm.get_stats().tiers
        assert tiers["G3"]["corrupt"] == 3
        llm.engine.connector.flush()
        for path, data in planted.items():  # deleted; or rewritten from the recomputed KV
            assert not path.exists() or path.read_bytes() != data
        check_integrity(llm)
    finally:
        llm.close()
    assert SECRET not in caplog.text
    # the recomputed blocks were written back, keyed: a third engine is served every block
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), **PER_ENTRY_FILES, kv_offload_secret_file=secret_file)
    try:
        outs = run(llm, PROMPTS)
        assert tokens(outs) == ref
        assert load_kinds(outs) == [{"G3": hit_tokens(len(p))} for p in PROMPTS]
        assert llm.get_stats().tiers["G3"]["corrupt"] == 0
    finally:
        llm.close()


def test_engine_without_the_secret_is_not_served_keyed_entries(model_dir, ref, tmp_path, secret_file, monkeypatch):
    monkeypatch.delenv("KVTIER_KV_SECRET", raising=False)
    disk = tmp_path / "g3"
    fill(model_dir, disk, ref, secret_file)
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), **PER_ENTRY_FILES)
    try:
        outs = run(llm, PROMPTS)
        assert tokens(outs) == ref and load_kinds(outs) == [{}, {}, {}]
        assert llm.get_stats().tiers["G3"]["corrupt"] == sum(hit_tokens(len(p)) // OB for p in PROMPTS)
    finally:
        llm.close()


def test_secret_from_the_environment_reads_what_the_file_wrote(model_dir, ref, tmp_path, secret_file, monkeypatch):
    """$KVTIER_KV_SECRET and a file holding the same secret (plus a newline) are one key."""
    disk = tmp_path / "g3"
    fill(model_dir, disk, ref, secret_file)
    monkeypatch.setenv("KVTIER_KV_SECRET", SECRET)
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), **PER_ENTRY_FILES)
    try:
        outs = run(llm, PROMPTS)
        assert tokens(outs) == ref
        assert load_kinds(outs) == [{"G3": hit_tokens(len(p))} for p in PROMPTS]
    finally:
        llm.close()
