"""G3's file I/O: scanning the directory at start-up, reading a file's entries (in Python, or in
the native loop of kvstore/native), writing a file.

No bookkeeping: `kvstore.disk` decides what to read and write and keeps the index.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from kvstore.backend import Buffer, Scatter, ScatterBatch
from kvstore.disk_index import FileName, Ident, Loc
from kvstore.disk_layout import (entry_key, not_regular, open_regular, pid_alive, reason, remove_entry_path, temp_path,
                                 temp_writer, write_all)
from kvstore.entry import HEADER_SIZE, CorruptEntry, EntryCodec, EntryHeader
from kvstore.keys import BlockKey
from kvstore.native import ENTRY_OK, ENTRY_SHORT, FILE_NOT_REGULAR, NativeReader

logger = logging.getLogger("kvstore.disk")  # the tier's own logger: its warnings read as the tier's

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
MAX_RUN = max(1, IOV_MAX // 2)  # entries one preadv reads: two iovecs each (header, payload) unless scattered


def check_entry(head: EntryHeader, namespace: bytes, key: BlockKey | None, offset: int, file_size: int) -> None:
    """CorruptEntry unless the entry at `offset` belongs to `namespace`, holds `key` (None: any)
    and fits in a file of `file_size` bytes."""
    if head.namespace != namespace:
        raise CorruptEntry("namespace (model fingerprint) differs from its directory's")
    if key is not None and head.key != key:
        raise CorruptEntry(f"holds key {head.key.hex()}, not the one its name says")
    if offset + HEADER_SIZE + head.payload_len > file_size:
        raise CorruptEntry(f"file size {file_size}, header says {offset + HEADER_SIZE + head.payload_len} (torn)")


def scan_file(codec: EntryCodec, namespace: bytes, path: str,
              name: FileName) -> tuple[int, int, list[tuple[BlockKey, int, int]], str | None]:
    """(size, mtime, entries as (key, offset, size), damage) of a file, from its headers.
    CorruptEntry if its first entry is bad; damage further in ends the entries there and is
    described in `damage`."""
    fd, st = open_regular(path)
    entries: list[tuple[BlockKey, int, int]] = []
    offset, damage = 0, None
    try:
        while offset < st.st_size:
            try:
                head = codec.open_header(os.pread(fd, HEADER_SIZE, offset))
                check_entry(head, namespace, name if offset == 0 else None, offset, st.st_size)
            except CorruptEntry as e:
                if not entries:
                    raise
                damage = f"entries from byte {offset} on are unreadable ({e})"
                break
            entries.append((BlockKey(head.key), offset, HEADER_SIZE + head.payload_len))
            offset += HEADER_SIZE + head.payload_len
    finally:
        os.close(fd)
    if not entries:
        raise CorruptEntry("empty file")
    return st.st_size, st.st_mtime_ns, entries, damage


class ScannedFile(NamedTuple):
    name: FileName
    size: int
    mtime: int  # ns
    entries: list[tuple[BlockKey, int, int]]  # (key, offset, size)
    ident: tuple[int, int] | None


def scan_directory(listing: list[tuple[str, str]], codec: EntryCodec, namespace: bytes) -> tuple[list[ScannedFile], int]:
    """Start-up: the good G3 files among `listing` ((shard directory, file name) pairs), and how many
    bad ones were found. Bad files (and temp files of writers that are gone) are removed and logged;
    a file damaged after its first entry keeps the entries before the damage and loses the rest
    (cut off: files are never appended to). Names that are not kvtier's are left alone."""
    found: list[ScannedFile] = []
    bad = 0

    def remove(path: str, why: str) -> None:
        nonlocal bad
        bad += 1
        logger.warning("G3 removing bad file %s: %s", path, why)
        try:
            remove_entry_path(path)
        except OSError as e:
            logger.debug("G3 cannot remove %s: %s", path, e)

    for shard, name in listing:
        path = os.path.join(shard, name)
        if (key := entry_key(name)) is not None:
            try:
                if name[:2] != os.path.basename(shard):
                    raise CorruptEntry("file in the wrong shard directory")
                size, mtime, entries, damage = scan_file(codec, namespace, path, key)
            except FileNotFoundError:
                continue
            except (CorruptEntry, OSError) as e:
                remove(path, reason(e))
                continue
            if damage is not None:
                bad += 1
                size = entries[-1][1] + entries[-1][2]
                logger.warning("G3 %s: %s; keeping the %d entries before it", path, damage, len(entries))
                try:
                    os.truncate(path, size)
                except OSError as e:
                    remove(path, f"cannot cut its damaged tail: {reason(e)}")
                    continue
            found.append(ScannedFile(key, size, mtime, entries, file_ident(path)))
        elif (pid := temp_writer(name)) is not None:
            if pid != os.getpid() and pid_alive(pid):
                continue  # another live process is writing it
            remove(path, "temp file of an interrupted write")
    return found, bad


def file_ident(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the file at `path` (not following a link); None if it cannot be stat'ed."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def runs(wanted: list[tuple[int, Loc]]) -> list[list[tuple[int, Loc]]]:
    """`wanted` (sorted by offset) cut into runs of adjacent entries: one preadv each."""
    out: list[list[tuple[int, Loc]]] = []
    for w in wanted:
        last = out[-1][-1][1] if out else None
        if last is not None and last.offset + last.size == w[1].offset and len(out[-1]) < MAX_RUN:
            out[-1].append(w)
        else:
            out.append([w])
    return out


def read_entries(path: str, locs: Sequence[Loc]) -> list[bytes] | None:
    """The raw entries (header and payload) at `locs` in the file at `path`, for a file replacing
    it to carry over; None if they cannot all be read (they are then dropped with the file). Their
    checksums travel with them: a read of the new file checks them as it checks any entry."""
    try:
        fd, _ = open_regular(path)
    except OSError as e:
        logger.debug("G3 cannot open %s to carry its entries over: %s", path, e)
        return None
    try:
        out = [os.pread(fd, loc.size, loc.offset) for loc in locs]
    except OSError as e:
        logger.debug("G3 cannot read %s to carry its entries over: %s", path, e)
        return None
    finally:
        os.close(fd)
    return out if all(len(b) == loc.size for b, loc in zip(out, locs)) else None


def write_temp(ns_dir: str, name: FileName, parts: list[memoryview], fsync: bool, shards: set[str]) -> str:
    """Writes `parts` to a fresh temp file in file `name`'s shard directory (made if not in
    `shards`, the shard directories known to exist) and returns its path, for the caller to
    publish. Raises OSError, leaving no temp file behind."""
    tmp = temp_path(ns_dir, name)
    shard = os.path.dirname(tmp)
    if shard not in shards:
        try:
            os.mkdir(shard, 0o700)
        except FileExistsError:
            pass
        shards.add(shard)
    try:
        write_file(tmp, parts, fsync)
    except OSError:
        shards.discard(shard)  # maybe removed behind our back: recreate next time
        raise
    return tmp


def write_file(path: str, parts: list[memoryview], fsync: bool) -> None:
    """Creates `path` (which must not exist) holding `parts` in order; removes it on failure."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            for part in parts:
                write_all(fd, part)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        try:
            os.unlink(path)
        except OSError:
            pass
        raise


Checked = list[tuple[int, Loc, str | None]]  # (index, loc, None if verified else why not)
Target = memoryview | Scatter  # where an entry's payload goes: one buffer, or pieces of memory


def pieces(target: Target) -> list[memoryview]:
    return target.views() if isinstance(target, Scatter) else [target]


def read_file_python(path: str, wanted: list[tuple[int, Loc]], targets: dict[int, Target],
                     keys: Sequence[BlockKey], codec: EntryCodec, namespace: bytes) -> tuple[Ident, Checked, float, float]:
    """Reads `wanted` (sorted by offset) of the file at `path`, each run of adjacent entries in one
    preadv straight into `targets`, and checks each: (the file's identity, the entries checked,
    seconds reading, seconds checking). OSError (NotRegularFile, FileNotFoundError, ...) if the
    file cannot be opened, having read nothing."""
    fd, st = open_regular(path)
    checked: Checked = []
    read_s = check_s = 0.0
    try:
        for run in runs(wanted):
            heads = [bytearray(HEADER_SIZE) for _ in run]
            parts = [pieces(targets[i]) for i, _ in run]
            iov = [b for h, p in zip(heads, parts) for b in (h, *p)]
            start = run[0][1].offset
            t0 = time.perf_counter()
            n, err = preadv_all(fd, iov, start)
            t1 = time.perf_counter()
            for (i, loc), h, p in zip(run, heads, parts):
                short = loc.offset + loc.size - start > n
                checked.append((i, loc, err if short else entry_error(h, p, keys[i], codec, namespace, loc)))
            read_s, check_s = read_s + t1 - t0, check_s + time.perf_counter() - t1
    finally:
        os.close(fd)
    return (st.st_dev, st.st_ino), checked, read_s, check_s


def preadv_all(fd: int, iov: list[memoryview | bytearray], offset: int) -> tuple[int, str]:
    """preadv of `iov` at `offset`, in calls of at most IOV_MAX pieces (a scattered entry may have
    more): (the bytes read up to the first short call, why it was short)."""
    done = 0
    for j in range(0, len(iov), IOV_MAX):
        part = iov[j:j + IOV_MAX]
        try:
            n = os.preadv(fd, part, offset + done)
        except OSError as e:
            return done, e.strerror or str(e)
        done += n
        if n < sum(memoryview(b).nbytes for b in part):
            return done, "truncated"
    return done, "truncated"


def read_file_native(reader: NativeReader, path: str, wanted: list[tuple[int, Loc]], targets: dict[int, Target],
                     keys: Sequence[BlockKey], codec: EntryCodec, namespace: bytes) -> tuple[Ident, Checked, float, float]:
    """`read_file_python`'s contract, in one call of the native loop (kvstore/native): it opens,
    reads and checks the file without the GIL. Entries it could not verify are checked here, so
    the reasons are Python's own."""
    got = reader.read(path, [loc.offset for _, loc in wanted], [loc.size for _, loc in wanted],
                      [targets[i] for i, _ in wanted], [keys[i] for i, _ in wanted], namespace, not codec.keyed)
    if (e := file_error(path, got.code, got.ident[0])) is not None:
        raise e
    t0 = time.perf_counter()
    checked = native_checked(wanted, got.status, got.errno, lambda j: got.heads[j * HEADER_SIZE:(j + 1) * HEADER_SIZE],
                             lambda i: pieces(targets[i]), keys, codec, namespace)
    return got.ident, checked, got.read_s, got.check_s + time.perf_counter() - t0


def file_error(path: str, code: int, mode: int) -> OSError | None:
    """The error the native loop's file `code` stands for (None: the file was read); `mode`: its
    st_mode when it is not a regular file."""
    if code == FILE_NOT_REGULAR:
        return not_regular(path, mode)
    if code < 0:
        return OSError(-code, os.strerror(-code), path)  # FileNotFoundError for ENOENT
    return None


def native_checked(wanted: list[tuple[int, Loc]], status: Sequence[int], errno: int, head: Callable[[int], Buffer],
                   payload: Callable[[int], list[memoryview]], keys: Sequence[BlockKey], codec: EntryCodec,
                   namespace: bytes) -> Checked:
    """The native loop's verdicts on one file's `wanted` entries (`status[j]`, `head(j)` their
    headers), those it left unchecked judged here from `payload(i)`, so the reasons are Python's."""
    checked: Checked = []
    for j, ((i, loc), st) in enumerate(zip(wanted, status)):
        if st == ENTRY_OK:
            checked.append((i, loc, None))
        elif st == ENTRY_SHORT:
            checked.append((i, loc, os.strerror(errno) if errno else "truncated"))
        else:
            checked.append((i, loc, entry_error(head(j), payload(i), keys[i], codec, namespace, loc)))
    return checked


def entry_error(head: Buffer, payload: list[memoryview], key: BlockKey, codec: EntryCodec, namespace: bytes,
                loc: Loc) -> str | None:
    """None if the entry read at `loc` (its header bytes, its payload's pieces) is `key`'s, else why not."""
    try:
        h = codec.open_header(head)
        check_entry(h, namespace, key, 0, loc.size)
        codec.check_pieces(h, payload)
    except CorruptEntry as e:
        return str(e)
    return None


def read_batch_native(reader: NativeReader, paths: list[str], wanted: list[list[tuple[int, Loc]]], batch: ScatterBatch,
                      keys: Sequence[BlockKey], codec: EntryCodec, namespace: bytes,
                      threads: int) -> tuple[list[tuple[Ident, Checked] | OSError], float, float]:
    """`read_file_native` for many files (`wanted[j]`, sorted by offset, of the file at `paths[j]`)
    in one call of the native loop on up to `threads` threads of its own, entry i's payload read
    into value i of `batch`. Per file: (its identity, the entries checked), or the OSError that
    kept it from being read; then the seconds reading and checking, summed over the threads."""
    flat = [w for ws in wanted for w in ws]
    first = np.cumsum([0, *map(len, wanted)])
    got = reader.read_batch(paths, first, np.array([loc.offset for _, loc in flat], np.int64),
                            np.array([loc.size for _, loc in flat], np.int64), batch,
                            np.array([i for i, _ in flat], np.int64), b"".join(keys[i] for i, _ in flat), namespace,
                            not codec.keyed, threads)
    out: list[tuple[Ident, Checked] | OSError] = []
    for j, path in enumerate(paths):
        lo, hi = int(first[j]), int(first[j + 1])
        if (e := file_error(path, int(got.code[j]), int(got.ident[j, 0]))) is not None:
            out.append(e)
            continue
        status = got.status[lo:hi]
        checked = [(i, loc, None) for i, loc in wanted[j]] if (status == ENTRY_OK).all() else native_checked(
            wanted[j], status.tolist(), int(got.errno[j]), lambda k: got.heads[lo + k],
            lambda i: batch.scatter(i).views(), keys, codec, namespace)
        out.append(((int(got.ident[j, 0]), int(got.ident[j, 1])), checked))
    return out, got.read_s, got.check_s
