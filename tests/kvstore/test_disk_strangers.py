"""Issue 38, finding 3: a FIFO, symlink, directory or device node planted at a live G3 entry's
path. A plain open() of a FIFO blocked the read thread forever (G3 then served nothing and
shutdown never finished). Each must be a miss, logged once, removed, and the tier must keep
serving its other entries; at start-up they are removed too, and one planted where a write
lands must not disable writes."""
from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore.disk import DiskBackend
from kvstore.disk_layout import NotRegularFile, entry_path, open_regular

NS = bytes.fromhex("00112233445566778899aabbccddeeff")
A, B = b"\xaa" * 16, b"\xbb" * 16
PAYLOAD = {A: b"a" * 4096, B: b"b" * 4096}
READ_DEADLINE_S = 5.0  # a blocked open() never returns; a good read takes microseconds


def _fifo(path: str, tmp: Path) -> None:
    os.mkfifo(path, 0o600)


def _symlink_to_entry(path: str, tmp: Path) -> None:
    """A link to a valid copy of the same entry: never followed, so never served."""
    copy = tmp / "elsewhere.kvb"
    os.replace(path, copy)
    os.symlink(copy, path)


def _symlink_to_system_file(path: str, tmp: Path) -> None:
    os.symlink("/etc/hostname" if os.path.exists("/etc/hostname") else "/etc/passwd", path)


def _directory(path: str, tmp: Path) -> None:
    os.mkdir(path)
    (Path(path) / "inside").write_bytes(b"x")


def _char_device(path: str, tmp: Path) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD")


STRANGERS: dict[str, Callable[[str, Path], None]] = {
    "fifo": _fifo, "symlink-to-entry": _symlink_to_entry, "symlink-to-system-file": _symlink_to_system_file,
    "directory": _directory, "char-device": _char_device,
}


def _plant(path: str, kind: str, tmp: Path) -> None:
    if kind != "symlink-to-entry":
        os.unlink(path)
    STRANGERS[kind](path, tmp)


def _bounded(fn: Callable[[], object]) -> object:
    """fn() on a daemon thread (its exception re-raised here); fails the test, instead of hanging
    it, if fn blocks."""
    out: list[object] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            err.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(READ_DEADLINE_S)
    assert not t.is_alive(), f"blocked for {READ_DEADLINE_S}s"
    if err:
        raise err[0]
    return out[0]


def _filled(root: Path) -> DiskBackend:
    b = DiskBackend(root, 1 << 20, NS, file_bytes=1)
    assert b.put([A, B], [PAYLOAD[A], PAYLOAD[B]]) == [True, True]
    return b


@pytest.mark.parametrize("kind", sorted(STRANGERS))
@pytest.mark.parametrize("read", ["get", "get_into"])
def test_a_stranger_at_a_live_entry_is_one_logged_miss_and_removed(tmp_path, caplog, kind, read) -> None:
    b = _filled(tmp_path / "g3")
    path = entry_path(b._dir, A)
    _plant(path, kind, tmp_path)
    fetch = (lambda k: b.get([k])[0]) if read == "get" else (
        lambda k: (buf := bytearray(len(PAYLOAD[k])), b.get_into([k], [buf])[0] and bytes(buf))[1])
    with caplog.at_level(logging.WARNING, logger="kvstore.disk"):
        assert not _bounded(lambda: fetch(A))
        assert not os.path.lexists(path), "the stranger is still there"
        assert not _bounded(lambda: fetch(A))  # now an index miss: nothing read, nothing logged
    logged = [r for r in caplog.records if path in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]
    assert b.stats.corrupt == 1 and not b.exists([A])[0]
    assert _bounded(lambda: fetch(B)) == PAYLOAD[B]  # the tier goes on serving
    b.check_integrity()
    assert b.put([A], [PAYLOAD[A]]) == [True] and b.get([A]) == [PAYLOAD[A]]  # and writing
    if kind == "symlink-to-entry":
        assert (tmp_path / "elsewhere.kvb").is_file()  # the link went, not what it pointed to


@pytest.mark.parametrize("kind", sorted(STRANGERS))
def test_strangers_at_entry_names_are_removed_at_start_up(tmp_path, caplog, kind) -> None:
    b = _filled(tmp_path / "g3")
    path = entry_path(b._dir, A)
    b.close()
    _plant(path, kind, tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvstore.disk"):
        again = _bounded(lambda: DiskBackend(tmp_path / "g3", 1 << 20, NS, file_bytes=1))
    assert isinstance(again, DiskBackend)
    assert not os.path.lexists(path)
    assert again.exists([A, B]) == [False, True] and again.get([B]) == [PAYLOAD[B]]
    assert any(path in r.getMessage() for r in caplog.records)
    again.check_integrity()


def test_a_directory_where_a_write_lands_is_removed_and_writes_go_on(tmp_path, caplog) -> None:
    """rename() cannot replace a directory: that failure used to disable every G3 write for 30 s."""
    b = DiskBackend(tmp_path / "g3", 1 << 20, NS, file_bytes=1)
    assert b.put([B], [PAYLOAD[B]]) == [True]
    path = entry_path(b._dir, A)
    os.makedirs(os.path.join(path, "sub"))
    with caplog.at_level(logging.WARNING, logger="kvstore.disk"):
        assert b.put([A], [PAYLOAD[A]]) == [True]
    assert b.writable and b.stats.write_errors == 0
    assert b.get([A, B]) == [PAYLOAD[A], PAYLOAD[B]]
    assert any("directory at entry path" in r.getMessage() for r in caplog.records)
    b.check_integrity()


def test_open_regular_refuses_without_blocking_or_following(tmp_path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"ok")
    fd, st = open_regular(str(f))
    os.close(fd)
    assert st.st_size == 2
    for kind in ("fifo", "symlink-to-system-file", "directory"):
        p = tmp_path / kind
        STRANGERS[kind](str(p), tmp_path)
        with pytest.raises(NotRegularFile, match="not a regular file"):
            _bounded(lambda: open_regular(str(p)))  # type: ignore[arg-type]
