"""G3's native read loop (kvstore/native) against Python's reads, the oracle: the same payloads,
misses, corruption counts and logged reasons for every kind of damage; the native checks really
verify (good entries never fall back to Python); and where it cannot be built, Python reads."""
from __future__ import annotations

import ctypes
import logging
import os
import random
from pathlib import Path

import numpy as np
import pytest

import kvstore.disk_files as disk_files
import kvstore.entry as entry
from kvstore import native
from kvstore.backend import Scatter
from kvstore.disk import HEADER_SIZE, DiskBackend

NS = bytes.fromhex("0f1e2d3c4b5a69788796a5b4c3d2e1f0")
SIZE = 5000
KEYS = [bytes([0x30 + i]) * 16 for i in range(6)]
PER = HEADER_SIZE + SIZE

pytestmark = pytest.mark.skipif(native.reader() is None, reason="the native read loop is unavailable here")


# Pieces per key for the scattered reads: one entry's pieces exceed IOV_MAX (1024), so its read
# takes several preadv calls, and a run of entries exceeds it many times over.
PIECES = [1, 3, 1100, 2, 700, 5]


def payload(k: bytes) -> bytes:
    return random.Random(k).randbytes(SIZE)


def damage_payload(path: Path) -> None:
    _flip(path, 2 * PER + HEADER_SIZE + 7)  # entry 2's payload


def damage_header(path: Path) -> None:
    _flip(path, 4 * PER + 30)  # entry 4's key field: its header checksum fails


def tear(path: Path) -> None:
    os.truncate(path, 3 * PER + HEADER_SIZE + 100)  # inside entry 3: it and the rest come short


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def scattered(n: int, seed: int) -> tuple[ctypes.Array, Scatter]:
    """SIZE bytes as `n` pieces of random lengths, in order, with a gap after each (the pieces
    of G1 blocks an entry fills are not adjacent either)."""
    cuts = sorted(random.Random(seed).sample(range(1, SIZE), n - 1))
    bounds = [0, *cuts, SIZE]
    store = (ctypes.c_char * (SIZE + 3 * n))()
    at = ctypes.addressof(store)
    addrs = [at + a + 3 * j for j, a in enumerate(bounds[:-1])]
    return store, Scatter(np.array(addrs, np.int64), np.diff(np.array(bounds, np.int64)))


def gathered(s: Scatter) -> bytes:
    return b"".join(ctypes.string_at(int(a), int(n)) for a, n in zip(s.addresses, s.lengths))


def run(tmp: Path, io: str, damage, caplog, secret: bytes | None = None) -> tuple:
    b = DiskBackend(tmp / io, 64 << 20, NS, file_bytes=1 << 20, native_io=io == "native", secret=secret)
    assert b.put(KEYS, [payload(k) for k in KEYS]) == [True] * len(KEYS)
    (path,) = b.directory.rglob("*.kvb")
    if damage is not None:
        damage(path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore.disk"):
        stores, pieces = zip(*(scattered(n, j) for j, n in enumerate(PIECES)))
        scattered_ok = b.get_into(KEYS, list(pieces))  # first: it meets the damage
        got = b.get(KEYS)
        into = [bytearray(SIZE) for _ in KEYS]
        filled = b.get_into(KEYS, into)
    reasons = sorted(r.getMessage().replace(str(tmp / io), "ROOT") for r in caplog.records)
    if damage is not tear:  # a file cut behind the tier's back differs from its index until it goes
        b.check_integrity()
    return got, filled, [bytes(x) if ok else None for x, ok in zip(into, filled)], b.stats.corrupt, \
        b.stats.misses, b.stats.hits, reasons, [gathered(p) if ok else None for p, ok in zip(pieces, scattered_ok)]


@pytest.mark.parametrize("damage", [None, damage_payload, damage_header, tear],
                         ids=["clean", "payload", "header", "torn"])
@pytest.mark.parametrize("keyed", [False, True], ids=["xxh3", "keyed"])
def test_native_reads_give_pythons_results(tmp_path: Path, caplog, damage, keyed) -> None:
    secret = b"s3cret" if keyed else None
    py = run(tmp_path, "python", damage, caplog, secret)
    nat = run(tmp_path, "native", damage, caplog, secret)
    assert nat == py
    served = py[0]
    if damage is None:
        assert served == [payload(k) for k in KEYS] == py[7]
    else:
        assert None in served and py[3] >= 1 and py[6]  # damage is a logged miss, never served
        assert all(s is None or s == payload(k) for s, k in zip(served, KEYS))
        assert None in py[7] and all(s is None or s == payload(k) for s, k in zip(py[7], KEYS))


def test_good_entries_are_verified_natively(tmp_path: Path, monkeypatch) -> None:
    """A clean read never asks Python: the C checks pass on their own. (Were they a stub that sends
    every entry back to Python, the results above would still match.)"""
    asked: list[bytes] = []
    real = disk_files.entry_error
    monkeypatch.setattr(disk_files, "entry_error", lambda *a: asked.append(a[2]) or real(*a))
    b = DiskBackend(tmp_path / "g3", 64 << 20, NS, file_bytes=1 << 20)
    assert b._reader is not None
    assert b.put(KEYS, [payload(k) for k in KEYS]) == [True] * len(KEYS)
    assert b.get(KEYS) == [payload(k) for k in KEYS] and asked == []
    stores, pieces = zip(*(scattered(n, j) for j, n in enumerate(PIECES)))
    assert b.get_into(KEYS, list(pieces)) == [True] * len(KEYS) and asked == []  # the streamed sums too
    assert [gathered(p) for p in pieces] == [payload(k) for k in KEYS]
    damage_payload(next(b.directory.rglob("*.kvb")))
    assert b.get(KEYS)[2] is None and asked == [KEYS[2]]  # the failing entry alone is judged in Python


def test_entries_of_another_checksum_are_checked_in_python(tmp_path: Path, monkeypatch) -> None:
    """blake2b entries (written where xxhash was missing) are read natively and verified in Python."""
    b = DiskBackend(tmp_path / "g3", 64 << 20, NS, file_bytes=1 << 20)
    with monkeypatch.context() as m:
        m.setattr(entry, "DEFAULT_ALG", entry.ALG_BLAKE2B)
        assert b.put(KEYS, [payload(k) for k in KEYS]) == [True] * len(KEYS)
    assert b.get(KEYS) == [payload(k) for k in KEYS] and b.stats.corrupt == 0


def test_without_a_compiler_g3_reads_in_python_and_says_so(tmp_path: Path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native.reader.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="kvstore.native"):
            b = DiskBackend(tmp_path / "g3", 64 << 20, NS)
        assert b._reader is None
        assert any("G3 reads in Python" in r.getMessage() and "no-such-cc" in r.getMessage() for r in caplog.records)
        assert b.put(KEYS, [payload(k) for k in KEYS]) == [True] * len(KEYS)
        assert b.get(KEYS) == [payload(k) for k in KEYS]
    finally:
        native.reader.cache_clear()
