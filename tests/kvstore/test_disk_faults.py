"""DiskBackend (G3) under faults: a writer killed with SIGKILL, a full disk, a read-only
directory, and failing system calls. Each becomes misses or refused writes plus a log line."""

from __future__ import annotations

import errno
import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore.write_gate as write_gate
from kvstore.disk import DiskBackend

NS = bytes.fromhex("00112233445566778899aabbccddeeff")
REPO = Path(__file__).resolve().parents[2]

# Writes entries forever, printing each index once its put returned. The payload is a pure
# function of the key, so the test can check every byte served after the kill. With a
# `stall` index it writes half of that entry's file and then waits to be killed.
WRITER = r"""
import os, random, sys, time
import kvstore.disk as disk
import kvstore.disk_files as files
root, ns, start, stall = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
b = disk.DiskBackend(root, 1 << 40, ns)
write_all = files.write_all
def stalling(fd, view):
    if view.nbytes > 1000:
        write_all(fd, view[: view.nbytes // 2])
        print("stalled", flush=True)
        time.sleep(60)
    write_all(fd, view)
i = start
while True:
    if i == stall:
        files.write_all = stalling
    k = i.to_bytes(16, "little")
    assert b.put([k], [random.Random(k).randbytes(64 * 1024 + (i * 7919) % (1 << 20))]) == [True]
    print(i, flush=True)
    i += 1
"""


def crash_key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def crash_payload(i: int) -> bytes:
    return random.Random(crash_key(i)).randbytes(64 * 1024 + (i * 7919) % (1 << 20))


def run_and_kill(root: Path, start: int, kill_after: int, stall: int = -1) -> int:
    """Start the writer, SIGKILL it after `kill_after` acknowledged puts (or once stalled);
    return the last acknowledged index (start - 1 if none)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), NS.hex(), str(start), str(stall)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )
    assert proc.stdout is not None
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if lines[-1] == "stalled" or len(lines) >= kill_after:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()  # reaped, so its pid is no longer alive for the temp-file check
        lines += proc.stdout.read().split()  # acknowledged after we stopped reading, before the kill
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, f"writer exited on its own ({proc.returncode})"
    return max([int(x) for x in lines if x != "stalled"], default=start - 1)


def check_after_crash(root: Path, acknowledged: set[int], upto: int) -> DiskBackend:
    torn = list(root.rglob("*.tmp"))
    b = DiskBackend(root, 1 << 40, NS, file_bytes=1)
    assert not list(root.rglob("*.tmp")), "start-up must remove the temp files of interrupted writes"
    assert b.stats.corrupt == len(torn)
    served = 0
    for i in range(upto + 1):
        got = b.get([crash_key(i)])[0]
        if i in acknowledged:  # a killed process loses nothing it had published
            assert got is not None, f"entry {i} was acknowledged before the kill but is gone"
        if got is not None:
            assert got == crash_payload(i), f"entry {i} served with wrong bytes after the crash"
            served += 1
    assert served == len(b) and b.stats.corrupt == len(torn)
    b.check_integrity()
    return b


def test_sigkill_mid_write_never_serves_bad_bytes(tmp_path: Path) -> None:
    root = tmp_path / "g3"
    last = run_and_kill(root, 0, kill_after=random.Random(1).randint(3, 12))  # wherever it lands
    acked = set(range(last + 1))
    check_after_crash(root, acked, last + 1).close()
    # Deterministically inside a write: the file is half written when the kill lands.
    stall = last + 4
    last2 = run_and_kill(root, last + 2, kill_after=10**9, stall=stall)
    assert last2 == stall - 1
    assert len(list(root.rglob("*.tmp"))) == 1, "the stalled write should have left one temp file"
    b = check_after_crash(root, acked | set(range(last + 2, stall)), stall)
    assert b.stats.corrupt == 1 and b.get([crash_key(stall)]) == [None]


@pytest.mark.slow
def test_sigkill_many_rounds(tmp_path: Path) -> None:
    root, start, rng, acked = tmp_path / "g3", 0, random.Random(0), set()
    for _ in range(20):
        last = run_and_kill(root, start, kill_after=rng.randint(1, 8))
        acked |= set(range(start, last + 1))
        check_after_crash(root, acked, last + 1).close()
        start = last + 2


# ---- failing system calls ----------------------------------------------------------------


class FakeClock:
    """Stands in for the `time` module inside kvstore.write_gate: back-offs without sleeping."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _fail(err: int, only_writes: bool = False):
    def raiser(*args, **kwargs):
        if only_writes and not (args[1] & (os.O_WRONLY | os.O_RDWR)):
            return real_open(*args, **kwargs)
        raise OSError(err, os.strerror(err))

    real_open = os.open
    return raiser


@pytest.mark.parametrize(
    ("call", "err"),
    [("write", errno.ENOSPC), ("open", errno.EACCES), ("replace", errno.EROFS), ("mkdir", errno.EDQUOT)],
)
def test_write_fault_disables_writes_and_reads_continue(tmp_path: Path, monkeypatch, caplog, call, err) -> None:
    clock = FakeClock()
    monkeypatch.setattr(write_gate, "time", clock)
    b = DiskBackend(tmp_path / "g3", 64 << 20, NS, retry_after_s=30)
    kept, new, later = (bytes([i]) * 16 for i in range(3))
    assert b.put([kept], [b"kept" * 1000]) == [True]
    with monkeypatch.context() as m, caplog.at_level(logging.DEBUG, logger="kvstore.disk"):
        m.setattr(os, call, _fail(err, only_writes=call == "open"))
        assert b.put([new], [b"new" * 1000]) == [False]
        assert b.put([later], [b"later"]) == [False]  # refused at once: no second attempt
        assert b.get([kept]) == [b"kept" * 1000], "reads must keep working"
    assert not b.writable and b.stats.write_errors == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "writes disabled" in warnings[0].getMessage()
    assert os.strerror(err) in warnings[0].getMessage()
    assert not list(b.directory.rglob("*.tmp")), "an abandoned write must not leave its temp file"
    assert b.exists([new, later]) == [False, False]
    b.check_integrity()
    clock.now += 29.9
    assert b.put([new], [b"new" * 1000]) == [False], "writes must stay off for the whole back-off"
    clock.now += 0.2  # the back-off is over: writes are tried again, and work
    with caplog.at_level(logging.INFO, logger="kvstore.disk"):
        assert b.put([new], [b"new" * 1000]) == [True]
    assert b.writable and b.get([new]) == [b"new" * 1000] and "writes work again" in caplog.text
    b.check_integrity()


def test_root_that_is_a_file_gives_an_empty_read_only_tier(tmp_path: Path, caplog) -> None:
    root = tmp_path / "not-a-dir"
    root.write_text("occupied")
    with caplog.at_level(logging.WARNING, logger="kvstore.disk"):
        b = DiskBackend(root, 1 << 20, NS)
    assert not b.writable and len(b) == 0 and "writes disabled" in caplog.text
    assert b.put([bytes(16)], [b"x"]) == [False] and b.get([bytes(16)]) == [None]


# ---- a real full disk and a real read-only directory ---------------------------------------


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mnt = tmp_path / "mnt"
    if not _mount_tmpfs(mnt, "1m"):
        pytest.skip("cannot mount a tmpfs here (needs root); the ENOSPC path is covered by monkeypatching")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_turns_into_refused_writes(small_tmpfs: Path, caplog) -> None:
    b = DiskBackend(small_tmpfs, 64 << 20, NS, retry_after_s=0)  # capacity far above the disk's 1 MiB
    stored = []
    with caplog.at_level(logging.WARNING, logger="kvstore.disk"):
        for i in range(20):
            k = crash_key(i)
            if b.put([k], [crash_payload(0)[: 200_000]]) != [True]:
                break
            stored.append(k)
        assert b.put([crash_key(99)], [b"y" * 300_000]) == [False]  # tried again (no back-off), fails again
    assert 2 <= len(stored) < 20 and b.stats.write_errors == 2
    assert caplog.text.count("writes disabled") == 1 and os.strerror(errno.ENOSPC) in caplog.text
    assert b.get(stored) == [crash_payload(0)[:200_000]] * len(stored), "reads must keep working"
    assert not list(small_tmpfs.rglob("*.tmp"))
    b.check_integrity()
    b.delete(stored[:2])  # room again: the next put succeeds
    assert b.put([crash_key(50)], [b"z" * 1000]) == [True] and b.writable


@pytest.fixture
def read_only(tmp_path: Path, monkeypatch):
    """(root, make_read_only): a real read-only tmpfs remount as root, chmod 0500 otherwise,
    or, where neither is possible, system calls that fail with EROFS as on a read-only mount."""
    root = tmp_path / "ro"
    if _mount_tmpfs(root, "16m"):
        yield root, lambda: subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        subprocess.run(["umount", "-l", str(root)], check=False)
        return
    if os.geteuid() != 0:
        def chmod_ro() -> None:
            for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
                d.chmod(0o500)
        yield root, chmod_ro
        for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            d.chmod(0o700)
        return

    def simulate() -> None:
        erofs = _fail(errno.EROFS)
        real_mkdir = os.mkdir
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: not mode & os.W_OK)
        monkeypatch.setattr(os, "open", _fail(errno.EROFS, only_writes=True))
        monkeypatch.setattr(os, "replace", erofs)
        monkeypatch.setattr(os, "unlink", erofs)
        monkeypatch.setattr(
            os, "mkdir", lambda p, *a, **kw: real_mkdir(p) if os.path.exists(p) else erofs(p)
        )
    yield root, simulate


def test_read_only_directory_at_startup(read_only, caplog) -> None:
    root, make_read_only = read_only
    keys = [crash_key(i) for i in range(4)]
    b = DiskBackend(root, 64 << 20, NS, file_bytes=1)
    assert b.put(keys, [crash_payload(i)[:5000] for i in range(4)]) == [True] * 4
    b.close()
    bad = b.directory / keys[3].hex()[:2] / f"{keys[3].hex()}.kvb"
    bad.write_bytes(b"garbage" + bad.read_bytes()[7:])
    make_read_only()
    with caplog.at_level(logging.WARNING, logger="kvstore.disk"):
        b = DiskBackend(root, 64 << 20, NS, file_bytes=1)  # a read-only tier, not a crash
    assert not b.writable and "writes disabled" in caplog.text
    assert b.stats.corrupt == 1 and "bad magic" in caplog.text  # counted and logged, even if not removable
    assert b.get(keys) == [crash_payload(i)[:5000] for i in range(3)] + [None]
    assert b.put([crash_key(9)], [b"new"]) == [False]
    b.delete([keys[0]])  # cannot remove the file, but forgets it and does not raise
    assert b.get([keys[0]]) == [None]
