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
from kvstore.backend import Scatter, ScatterBatch
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


def as_batch(pieces: list[Scatter]) -> ScatterBatch:
    return ScatterBatch(np.cumsum([0, *(len(p.addresses) for p in pieces)]), np.concatenate([p.addresses for p in pieces]),
                        np.concatenate([p.lengths for p in pieces]))


def run(tmp: Path, io: str, damage, caplog, secret: bytes | None = None, batch: bool = False) -> tuple:
    b = DiskBackend(tmp / io, 64 << 20, NS, file_bytes=1 << 20, native_io=io == "native", secret=secret)
    assert b.put(KEYS, [payload(k) for k in KEYS]) == [True] * len(KEYS)
    (path,) = b.directory.rglob("*.kvb")
    if damage is not None:
        damage(path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore.disk"):
        stores, pieces = zip(*(scattered(n, j) for j, n in enumerate(PIECES)))
        # first: it meets the damage
        scattered_ok = b.get_into_batch(KEYS, as_batch(pieces), 2) if batch else b.get_into(KEYS, list(pieces))
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
@pytest.mark.parametrize("batch", [False, True], ids=["per-file", "batch"])
def test_native_reads_give_pythons_results(tmp_path: Path, caplog, damage, keyed, batch) -> None:
    """Python's per-key reads are the oracle for the native loop's, per file (`get_into`) and for
    a whole load in one call on its own threads (`get_into_batch`)."""
    secret = b"s3cret" if keyed else None
    py = run(tmp_path, "python", damage, caplog, secret)
    nat = run(tmp_path, "native", damage, caplog, secret, batch)
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
    stores, pieces = zip(*(scattered(n, j + 9) for j, n in enumerate(PIECES)))
    assert b.get_into_batch(KEYS, as_batch(list(pieces)), 2) == [True] * len(KEYS) and asked == []
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


@pytest.mark.parametrize("threads", [1, 3])
def test_a_batch_over_many_files_gives_each_keys_payload(tmp_path: Path, caplog, threads) -> None:
    """A load's keys spread over many files, asked out of file order, with misses, a wrong-size
    ask, a file removed behind the tier's back and a damaged one among them: every good key gets its
    own payload, the rest are misses, the damage is logged and dropped (per-key `get` the oracle)."""
    b = DiskBackend(tmp_path / "g3", 64 << 20, NS, file_bytes=2 * PER)  # two entries a file
    keys = [bytes([0x40 + i]) * 16 for i in range(20)]
    assert b.put(keys, [payload(k) for k in keys]) == [True] * len(keys)
    files = {p.name: p for p in b.directory.rglob("*.kvb")}
    os.unlink(files[keys[4].hex() + ".kvb"])  # keys 4 and 5
    _flip(files[keys[10].hex() + ".kvb"], PER + HEADER_SIZE + 9)  # key 11's payload
    asked = [keys[i] for i in (1, 0, 3, 2, 4, 5, 7, 6, 9, 8, 10, 11, 13, 12, 19)] + [b"\x99" * 16]
    sizes = [SIZE] * len(asked)
    sizes[asked.index(keys[13])] = SIZE - 1  # not what the tier holds: a miss, not damage
    stores = [ctypes.create_string_buffer(n) for n in sizes]
    batch = ScatterBatch(np.arange(len(asked) + 1), np.array([ctypes.addressof(x) for x in stores], np.int64),
                         np.array(sizes, np.int64))
    with caplog.at_level(logging.WARNING, logger="kvstore.disk"):
        got = b.get_into_batch(asked, batch, threads)
    want = [k not in (keys[4], keys[5], keys[11], keys[13], b"\x99" * 16) for k in asked]
    assert got == want
    assert all(x.raw == payload(k) for x, k, ok in zip(stores, asked, got) if ok)
    assert b.stats.corrupt == 1 and b.stats.hits == sum(want) and b.stats.misses == len(asked) - sum(want)
    # plain Python numbers: the stats cross from the engine core to the API server (a numpy float
    # there once failed the message encoding and took the core down)
    assert {type(v) for v in vars(b.stats).values()} <= {int, float}
    assert any("corrupt entry " + keys[11].hex() in r.getMessage() for r in caplog.records)
    assert b.get(asked[:-1]) == [payload(k) if k not in (keys[4], keys[5], keys[11]) else None for k in asked[:-1]]
    b.check_integrity()


def test_a_file_replaced_by_a_put_during_a_batch_is_read_anew(tmp_path: Path, monkeypatch) -> None:
    """A block stored again while a load's batch is being read (the engine rewrites a prompt's
    last block after recomputing its last token) replaces its file between the plan and the read:
    those keys are read again from the new file, not reported as misses or as damage."""
    b = DiskBackend(tmp_path / "g3", 64 << 20, NS, file_bytes=2 * PER)  # two entries a file
    keys = [bytes([0x60 + i]) * 16 for i in range(6)]
    assert b.put(keys, [payload(k) for k in keys]) == [True] * len(keys)
    fresh = {k: payload(k[::-1] + b"x") for k in keys[2:4]}
    real = b._reader.read_batch

    def racing(*args, **kw):
        assert b.put(list(fresh), list(fresh.values())) == [True, True]
        return real(*args, **kw)

    monkeypatch.setattr(b._reader, "read_batch", racing)
    stores = [ctypes.create_string_buffer(SIZE) for _ in keys]
    batch = ScatterBatch(np.arange(len(keys) + 1), np.array([ctypes.addressof(x) for x in stores], np.int64),
                         np.full(len(keys), SIZE, np.int64))
    assert b.get_into_batch(keys, batch, 2) == [True] * len(keys)
    assert [x.raw for x in stores] == [fresh.get(k, payload(k)) for k in keys]
    assert b.stats.corrupt == 0 and b.stats.misses == 0
    b.check_integrity()
