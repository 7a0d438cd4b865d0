"""G3 files holding runs of entries (issue 43): every entry found, read and checked on its own,
neighbours read in one call, damage confined to the entry it hits, restart reuse, whole-file eviction."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

import kvstore.disk_files as disk_files
from kvstore import native
from kvstore.disk import HEADER_SIZE, DiskBackend

NS = bytes.fromhex("00112233445566778899aabbccddeeff")
SIZE = 3000
KEYS = [bytes([i + 1]) * 16 for i in range(8)]


def payload(k: bytes) -> bytes:
    return random.Random(k).randbytes(SIZE)


@pytest.fixture(params=["native", "python"], autouse=True)
def io(request: pytest.FixtureRequest) -> str:
    """Every test here runs with the native read loop (kvstore/native) and with Python's reads."""
    if request.param == "native" and native.reader() is None:
        pytest.skip("the native read loop is unavailable here")
    return request.param


def disk(tmp_path: Path, io: str, **kw) -> DiskBackend:
    kw.setdefault("file_bytes", 1 << 20)
    return DiskBackend(tmp_path / "g3", capacity_bytes=kw.pop("capacity", 64 << 20), namespace=NS,
                       native_io=io == "native", **kw)


def file_of(b: DiskBackend, first: bytes) -> Path:
    return b.directory / first.hex()[:2] / f"{first.hex()}.kvb"


@pytest.fixture
def stored(tmp_path: Path, io: str) -> DiskBackend:
    b = disk(tmp_path, io)
    assert b.put(KEYS, [payload(k) for k in KEYS]) == [True] * 8
    assert list(b.directory.rglob("*.kvb")) == [file_of(b, KEYS[0])]  # one file of eight entries
    return b


def count_preadv(monkeypatch: pytest.MonkeyPatch, b: DiskBackend) -> list[int]:
    """The bytes of each preadv a read makes: Python's calls, or the runs the native loop is given
    (it reads each run of adjacent entries in one preadv)."""
    calls: list[int] = []
    if b._reader is None:
        real = os.preadv

        def counting(fd, buffers, offset, *a):
            calls.append(sum(memoryview(x).nbytes for x in buffers))
            return real(fd, buffers, offset, *a)

        monkeypatch.setattr(disk_files.os, "preadv", counting)
        return calls
    real_read = b._reader.read

    def runs_of(path, offsets, sizes, *a):
        for o, n in zip(offsets, sizes):
            if calls and o == end[0]:
                calls[-1] += n
            else:
                calls.append(n)
            end[0] = o + n
        return real_read(path, offsets, sizes, *a)

    end = [-1]
    monkeypatch.setattr(b._reader, "read", runs_of)
    return calls


def test_every_entry_of_a_file_is_found_and_read_alone(stored: DiskBackend, monkeypatch) -> None:
    calls = count_preadv(monkeypatch, stored)
    assert stored.exists(KEYS) == [True] * 8
    for n in range(1, 9):  # a prefix ending at every entry boundary inside the file
        bufs = [bytearray(SIZE) for _ in range(n)]
        assert stored.get_into(KEYS[:n], bufs) == [True] * n
        assert [bytes(x) for x in bufs] == [payload(k) for k in KEYS[:n]]
    assert calls == [n * (HEADER_SIZE + SIZE) for n in range(1, 9)]  # one read per call, only the bytes asked for
    calls.clear()
    assert stored.get(KEYS[3:6]) == [payload(k) for k in KEYS[3:6]]  # a middle run: its byte range only
    assert calls == [3 * (HEADER_SIZE + SIZE)]
    calls.clear()
    assert stored.get([KEYS[1], KEYS[6], KEYS[2]]) == [payload(KEYS[i]) for i in (1, 6, 2)]
    assert sorted(calls) == [HEADER_SIZE + SIZE, 2 * (HEADER_SIZE + SIZE)]  # 1-2 adjacent, 6 alone
    stored.check_integrity()


def test_a_damaged_entry_is_a_miss_and_its_neighbours_are_served(stored: DiskBackend) -> None:
    path = file_of(stored, KEYS[0])
    with open(path, "r+b") as f:
        f.seek(3 * (HEADER_SIZE + SIZE) + HEADER_SIZE + 100)  # inside entry 3's payload
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    got = stored.get(KEYS)
    assert got == [None if i == 3 else payload(k) for i, k in enumerate(KEYS)]
    assert stored.stats.corrupt == 1 and stored.exists(KEYS)[3] is False
    assert len(stored) == 7 and stored.used_bytes == path.stat().st_size  # a hole until the file goes
    stored.check_integrity()
    assert stored.put([KEYS[3]], [payload(KEYS[3])]) == [True]  # stored again: a file of its own
    assert stored.get(KEYS) == [payload(k) for k in KEYS]
    stored.check_integrity()


def test_restart_reuses_files_of_several_entries(tmp_path: Path, stored: DiskBackend, io: str) -> None:
    more = [bytes([0x40 + i]) * 16 for i in range(3)]
    assert stored.put(more, [payload(k) for k in more]) == [True] * 3
    stored.close()
    again = disk(tmp_path, io)
    assert len(again) == 11 and again.stats.corrupt == 0
    assert again.get(KEYS + more) == [payload(k) for k in KEYS + more]
    again.check_integrity()


def test_a_torn_file_keeps_the_entries_before_the_tear(tmp_path: Path, stored: DiskBackend, io: str) -> None:
    stored.close()
    path = file_of(stored, KEYS[0])
    os.truncate(path, 5 * (HEADER_SIZE + SIZE) + HEADER_SIZE + 10)  # inside entry 5
    again = disk(tmp_path, io)
    assert again.stats.corrupt == 1 and len(again) == 5
    assert again.get(KEYS) == [payload(k) for k in KEYS[:5]] + [None] * 3
    assert path.stat().st_size == 5 * (HEADER_SIZE + SIZE)  # the torn tail is cut off
    again.check_integrity()


def test_a_stranger_at_a_files_path_loses_its_entries_only(tmp_path: Path, stored: DiskBackend) -> None:
    other = [bytes([0x60 + i]) * 16 for i in range(2)]
    assert stored.put(other, [payload(k) for k in other]) == [True] * 2
    path = file_of(stored, KEYS[0])
    path.unlink()
    os.mkfifo(path, 0o600)  # opened without blocking, never read
    assert stored.get([KEYS[2], *other]) == [None, *(payload(k) for k in other)]
    assert not path.exists() and stored.exists(KEYS) == [False] * 8
    stored.check_integrity()


def test_eviction_removes_the_victims_whole_file(tmp_path: Path, io: str) -> None:
    per = HEADER_SIZE + SIZE
    b = disk(tmp_path, io, capacity=10 * per, file_bytes=4 * per)
    assert b.put(KEYS, [payload(k) for k in KEYS]) == [True] * 8  # files of 4 + 4
    b.get(KEYS[:4])  # the first file's entries are the most recently used
    newer = [bytes([0x70 + i]) * 16 for i in range(3)]
    assert b.put(newer, [payload(k) for k in newer]) == [True] * 3  # needs 3 entries' room: one file goes
    assert b.exists(KEYS) == [True] * 4 + [False] * 4  # the second file held the least recently used entry
    b.get(KEYS[1:2])  # just used, but its file holds the least recently used entry (KEYS[0])
    last = [bytes([0x78 + i]) * 16 for i in range(4)]
    assert b.put(last, [payload(k) for k in last]) == [True] * 4
    assert b.exists(KEYS) == [False] * 8 and b.exists(newer + last) == [True] * 7
    assert b.stats.evictions == 8 and b.used_bytes == 7 * per
    b.check_integrity()


def test_a_put_is_cut_into_files_of_at_most_file_bytes(tmp_path: Path, io: str) -> None:
    per = HEADER_SIZE + SIZE
    b = disk(tmp_path, io, file_bytes=3 * per)
    assert b.put(KEYS, [payload(k) for k in KEYS]) == [True] * 8
    sizes = sorted(p.stat().st_size for p in b.directory.rglob("*.kvb"))
    assert sizes == [2 * per, 3 * per, 3 * per]
    assert b.get(KEYS) == [payload(k) for k in KEYS]
    b.check_integrity()


def test_a_file_replaced_by_a_put_after_a_read_was_planned_is_a_miss_not_damage(tmp_path: Path, monkeypatch,
                                                                                 io: str) -> None:
    """A put that replaces a file (its first key stored again, alone) between a read's planning and
    its open: the new file is another one. A miss, not corruption; and the replaced file's other
    entries are carried over into the new one, so nothing valid is dropped."""
    import kvstore.disk as disk_module

    b = disk(tmp_path, io)
    assert b.put(KEYS[:4], [payload(k) for k in KEYS[:4]]) == [True] * 4
    name = "read_file_native" if io == "native" else "read_file_python"
    real, fired = getattr(disk_module, name), []
    fresh = payload(KEYS[0])[::-1]

    def racing(*a):
        if not fired:
            fired.append(a)
            assert b.put([KEYS[0]], [fresh]) == [True]  # the same file name
        return real(*a)

    monkeypatch.setattr(disk_module, name, racing)
    assert b.get([KEYS[2]]) == [None] and fired
    assert b.stats.corrupt == 0
    assert b.get(KEYS[:4]) == [fresh] + [payload(k) for k in KEYS[1:4]]
    assert len(list(b.directory.rglob("*.kvb"))) == 1
    b.check_integrity()
