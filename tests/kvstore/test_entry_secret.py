"""Issue 11, finding 4 at backend level: with a KV secret, G3 entries carry keyed MACs, and an
entry planted by someone who can write the directory (a changed payload with its unkeyed
checksum recomputed, an entry re-encoded with an unkeyed algorithm, an entry from another
secret) is a counted miss and is deleted. Without a secret, keyed entries are misses too.
Also: how the secret is read (file, environment), and that it never reaches a log or a repr.
"""
from __future__ import annotations

import hashlib
import logging
import os
import random
import struct
from pathlib import Path

import pytest

from kvstore.disk import DiskBackend, DiskConfig
from kvstore.entry import (
    ALG_BLAKE2B,
    ALG_HMAC_SHA256,
    ALG_XXH3,
    ENV_SECRET,
    HEADER_SIZE,
    EntryCodec,
    encode_header,
    load_secret,
)

NS = bytes.fromhex("00112233445566778899aabbccddeeff")
SECRET = b"correct horse battery staple"


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 4


def payload(k: bytes, size: int = 5000) -> bytes:
    return random.Random(k).randbytes(size)


def disk(tmp_path: Path, secret: bytes | None = SECRET) -> DiskBackend:
    return DiskBackend(tmp_path / "g3", capacity_bytes=64 << 20, namespace=NS, secret=secret, file_bytes=1)  # damage is planted per entry file


def entry_path(b: DiskBackend, k: bytes) -> Path:
    return b.directory / k.hex()[:2] / f"{k.hex()}.kvb"


def _planted(raw: bytes, alg: int) -> bytes:
    """The entry with its payload changed and every checksum recomputed the way someone
    without the secret can: with an unkeyed algorithm, or (alg 3 kept) with unkeyed hashes."""
    data = bytearray(raw)
    data[HEADER_SIZE + 1234] ^= 0x40
    ns, k, body = bytes(data[12:28]), bytes(data[28:44]), memoryview(data)[HEADER_SIZE:]
    if alg != ALG_HMAC_SHA256:
        return encode_header(ns, k, body, alg) + bytes(body)
    head = bytearray(encode_header(ns, k, body, ALG_BLAKE2B))
    head[8] = ALG_HMAC_SHA256  # claims to be keyed; the sums are unkeyed
    head[-8:] = hashlib.sha256(bytes(head[:-8])).digest()[:8]  # no key: anyone can
    return bytes(head) + bytes(body)


PLANT = {
    "payload-changed-xxh3-resealed": lambda raw: _planted(raw, ALG_XXH3),
    "payload-changed-blake2b-resealed": lambda raw: _planted(raw, ALG_BLAKE2B),
    "payload-changed-keyed-alg-unkeyed-sums": lambda raw: _planted(raw, ALG_HMAC_SHA256),
    "payload-changed-header-kept": lambda raw: raw[:HEADER_SIZE + 7] + bytes([raw[HEADER_SIZE + 7] ^ 1])
    + raw[HEADER_SIZE + 8:],
    "unchanged-but-unkeyed": lambda raw: encode_header(raw[12:28], raw[28:44], raw[HEADER_SIZE:]) + raw[HEADER_SIZE:],
    "sealed-with-another-secret": lambda raw: EntryCodec(b"another secret").seal(raw[12:28], raw[28:44],
                                                                                 raw[HEADER_SIZE:]) + raw[HEADER_SIZE:],
}


def test_keyed_entries_round_trip_and_carry_the_keyed_algorithm(tmp_path: Path) -> None:
    b = disk(tmp_path)
    keys = [key(i) for i in range(3)]
    assert b.put(keys, [payload(k) for k in keys]) == [True] * 3
    raw = entry_path(b, keys[0]).read_bytes()
    assert raw[8] == ALG_HMAC_SHA256 and raw[HEADER_SIZE:] == payload(keys[0])
    b.close()
    b = disk(tmp_path)  # the start-up scan accepts them, reads verify them
    assert len(b) == 3 and b.get(keys) == [payload(k) for k in keys] and b.stats.corrupt == 0
    buf = bytearray(5000)
    assert b.get_into([keys[1]], [buf]) == [True] and bytes(buf) == payload(keys[1])


@pytest.mark.parametrize("when", ["live", "restart"])
@pytest.mark.parametrize("plant", sorted(PLANT))
def test_planted_entry_is_a_counted_miss_and_deleted(tmp_path: Path, caplog, plant: str, when: str) -> None:
    keys = [key(i) for i in range(4)]
    bad = keys[1]
    b = disk(tmp_path)
    assert b.put(keys, [payload(k) for k in keys]) == [True] * 4
    if when == "restart":
        b.close()
    path = entry_path(b, bad)
    path.write_bytes(PLANT[plant](path.read_bytes()))
    with caplog.at_level(logging.DEBUG):
        if when == "restart":
            b = disk(tmp_path)
        got = b.get(keys)
    assert got == [None if k == bad else payload(k) for k in keys]
    assert b.stats.corrupt == 1 and b.stats.hits == 3
    assert not path.exists(), "a planted entry must be deleted"
    assert SECRET.decode() not in caplog.text
    b.check_integrity()


def test_without_a_secret_keyed_entries_are_misses(tmp_path: Path) -> None:
    """An engine without the secret cannot verify keyed entries: never served."""
    k = key(1)
    b = disk(tmp_path)
    b.put([k], [payload(k)])
    b.close()
    b = disk(tmp_path, secret=None)
    assert b.get([k]) == [None] and b.stats.corrupt == 1 and not entry_path(b, k).exists()
    assert b.put([k], [payload(k)]) == [True] and entry_path(b, k).read_bytes()[8] != ALG_HMAC_SHA256


def test_entries_from_before_the_secret_are_misses_once_it_is_set(tmp_path: Path) -> None:
    k = key(2)
    b = disk(tmp_path, secret=None)
    b.put([k], [payload(k)])
    b.close()
    b = disk(tmp_path)
    assert b.get([k]) == [None] and b.stats.corrupt == 1


def test_the_secret_is_in_no_repr(tmp_path: Path) -> None:
    b = disk(tmp_path)
    for obj in (b.config, b._codec, DiskConfig(tmp_path, 1, NS, secret=SECRET)):
        assert SECRET.decode() not in repr(obj) and SECRET.hex() not in repr(obj)
    with pytest.raises(ValueError):
        DiskConfig(tmp_path, 1, NS, secret=b"")
    with pytest.raises(ValueError):
        DiskConfig(tmp_path, 1, NS, secret="a str")  # type: ignore[arg-type]


def test_the_payload_mac_binds_namespace_and_key() -> None:
    """Moving a keyed payload under another key or model cannot keep its MAC valid."""
    c = EntryCodec(SECRET)
    head = c.seal(NS, key(1), b"kv bytes")
    parsed = c.open_header(head)
    c.check_payload(parsed, b"kv bytes")
    mac = parsed.payload_sum
    assert c.open_header(c.seal(NS, key(2), b"kv bytes")).payload_sum != mac
    assert c.open_header(c.seal(bytes(16), key(1), b"kv bytes")).payload_sum != mac
    assert struct.unpack_from("<Q", head, 44)[0] == len(b"kv bytes")


# ---- reading the secret -------------------------------------------------------------------

def _secret_file(tmp_path: Path, data: bytes, mode: int = 0o600) -> str:
    p = tmp_path / "kv.secret"
    p.write_bytes(data)
    os.chmod(p, mode)
    return str(p)


def test_secret_from_file_is_stripped_and_the_file_wins_over_the_environment(tmp_path: Path, caplog) -> None:
    path = _secret_file(tmp_path, SECRET + b"\n")
    with caplog.at_level(logging.DEBUG):
        assert load_secret(path, {}) == SECRET
        assert load_secret(path, {ENV_SECRET: "from the environment"}) == SECRET
    assert SECRET.decode() not in caplog.text and "from the environment" not in caplog.text


def test_secret_from_the_environment(tmp_path: Path) -> None:
    assert load_secret(None, {ENV_SECRET: " s3cret\n"}) == b"s3cret"
    assert load_secret(None, {}) is None


@pytest.mark.parametrize("case", ["missing", "empty", "whitespace", "a-directory", "empty-env"])
def test_missing_or_empty_secret_is_refused(tmp_path: Path, case: str) -> None:
    path = {"missing": str(tmp_path / "nope"), "empty": _secret_file(tmp_path, b""),
            "whitespace": _secret_file(tmp_path, b" \n\t\n"), "a-directory": str(tmp_path), "empty-env": None}[case]
    with pytest.raises(ValueError, match="secret") as e:
        load_secret(path, {ENV_SECRET: ""})
    assert "Traceback" not in str(e.value)


def test_group_or_world_readable_secret_file_warns(tmp_path: Path, caplog) -> None:
    path = _secret_file(tmp_path, SECRET, 0o644)
    with caplog.at_level(logging.WARNING, logger="kvstore.entry"):
        assert load_secret(path, {}) == SECRET
    assert "chmod 600" in caplog.text and SECRET.decode() not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore.entry"):
        load_secret(_secret_file(tmp_path, SECRET, 0o600), {})
    assert caplog.text == ""


@pytest.mark.parametrize("alg", ["xxh3", "blake2b"])
def test_unkeyed_payload_sums_are_the_formats_one_shot_digests(alg: str) -> None:
    """The payload sum is computed through a hasher object (its update releases the GIL); the
    stored sum must stay the one-shot digest earlier versions wrote (xxh3-128, blake2b-128), or
    every G3 directory and G4 store written before would read as damaged."""
    payload = random.Random(5).randbytes(300_000)
    if alg == "xxh3":
        xxhash = pytest.importorskip("xxhash")
        code, want = ALG_XXH3, xxhash.xxh3_128_digest(payload)
    else:
        code, want = ALG_BLAKE2B, hashlib.blake2b(payload, digest_size=16).digest()
    head = encode_header(b"n" * 16, b"k" * 16, payload, code)
    assert head[HEADER_SIZE - 8 - 16:HEADER_SIZE - 8] == want
    parsed = EntryCodec().open_header(head)
    EntryCodec().check_payload(parsed, payload)
