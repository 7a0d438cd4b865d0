"""`kvtier kv` on a G3 directory: inspect, verify, clear. Safe on a live server's directory.

What makes it safe beside a running `DiskBackend` (kvstore/disk.py), in this process or another:
- only kvtier's names are touched (`kvstore.disk_layout`): entries `{ns}/{xx}/{key}.kvb` and temp
  files of writers that are gone. Anything else, in the root, a namespace directory or a shard,
  is counted as foreign and left alone; so are symlinked namespace directories.
- a live writer's temp file (its pid running, or this process's own) is never touched;
- removal is `unlink` of a whole file, never a rewrite or truncation, and never of a directory
  (the tier remembers the shard directories it made). The tier treats a vanished file as a
  miss and drops it from its index when it next reads it (`DiskBackend._vanished`); until
  then its `used_bytes` still counts the file, and `check_integrity` reports it missing;
- a bad entry is removed only if it is still the file that was read (same device and inode): a
  tier that published a good entry under that name since keeps it. (Between that check and the
  unlink the tier could still replace it: the cost is a miss, never wrong bytes.)
- entries are read exactly as the tier reads them, with the same checks (`check_entry`).

Entries written while a clear runs may outlive it. Writers on other hosts sharing the directory
(NFS) cannot be seen: their temp files look stale once their pid is not running here.
"""
from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.disk_layout import NAMESPACE_RE, entry_key, list_files, open_regular, pid_alive, remove_entry_path, temp_writer
from kvstore.entry import HEADER_SIZE, CorruptEntry, EntryCodec, entry_length
from kvtools.inspect_report import (ClearReport, NamespaceUsage, Problem, Summary, TierUnavailable, Unverifiable,
                                    VerifyReport, check_entry)
from kvstore.keys import BlockKey
from kvstore.namespace_info import read_disk_record

TIER = "G3"


@dataclass(frozen=True)
class _File:
    """One file in a namespace directory's shards, classified by its name."""

    path: str
    name: str
    shard: str  # the shard directory's name
    key: BlockKey | None  # set for an entry
    writer: int | None  # set for a temp file: the writer's pid

    @property
    def is_entry(self) -> bool:
        return self.key is not None

    @property
    def live_temp(self) -> bool:
        # This process's own temp files may be a DiskBackend's writes in flight here.
        return self.writer is not None and (self.writer == os.getpid() or pid_alive(self.writer))


@dataclass
class _Walk:
    """The namespace directories under a root (optionally one), their files, and what was skipped."""

    namespaces: list[tuple[bytes, str]]  # (namespace, directory)
    foreign: int = 0
    errors: list[Problem] = field(default_factory=list)  # directories that could not be listed

    def files(self, ns_dir: str) -> list[_File]:
        def on_error(path: str, e: OSError) -> None:
            self.errors.append(Problem(path, f"cannot list: {e.strerror or e}"))

        out = []
        # Not regular files only: a FIFO or link at an entry's name is a problem verify reports.
        for shard, name in sorted(list_files(ns_dir, on_error, regular_only=False)):
            key = entry_key(name)
            writer = None if key is not None else temp_writer(name)
            if key is None and writer is None:
                self.foreign += 1
                continue
            out.append(_File(os.path.join(shard, name), name, os.path.basename(shard), key, writer))
        return out


def _walk(root: Path, only: bytes | None) -> _Walk:
    """Namespace directories under `root` (sorted); TierUnavailable if `root` cannot be listed."""
    walk = _Walk([])
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as e:
        raise TierUnavailable(f"cannot list {root}: {e.strerror or e}") from None
    for e in entries:
        if NAMESPACE_RE.fullmatch(e.name) and e.is_dir(follow_symlinks=False):
            ns = bytes.fromhex(e.name)
            if only is None or ns == only:
                walk.namespaces.append((ns, e.path))
        elif only is None:
            walk.foreign += 1
    return walk


def inspect_dir(root: Path, namespace: bytes | None = None, now: float | None = None) -> Summary:
    """Entries, bytes and ages (since written: the file's mtime) per namespace, from `stat` alone:
    nothing is read but the namespace records."""
    now = time.time() if now is None else now
    walk = _walk(root, namespace)
    usages, in_flight, stale = [], 0, 0
    for ns, ns_dir in walk.namespaces:
        usage = NamespaceUsage(ns.hex(), read_disk_record(ns_dir))
        for f in walk.files(ns_dir):
            if not f.is_entry:
                in_flight, stale = (in_flight + 1, stale) if f.live_temp else (in_flight, stale + 1)
                continue
            try:
                st = os.stat(f.path, follow_symlinks=False)
            except FileNotFoundError:  # evicted since the listing
                continue
            except OSError:
                walk.foreign += 1  # cannot even stat it: not counted as an entry
                continue
            if not stat.S_ISREG(st.st_mode):  # a FIFO, link or directory at an entry's name
                walk.foreign += 1
                continue
            usage.add(st.st_size, now - st.st_mtime, _count_entries(f.path, st.st_size))
        usages.append(usage)
    notes = tuple(f"{p.where}: {p.reason}" for p in walk.errors)
    return Summary(TIER, str(root), "written", tuple(usages), in_flight, stale, walk.foreign, notes)


Ident = tuple[int, int]  # (st_dev, st_ino): which file a path named when it was read


def _count_entries(path: str, size: int) -> int:
    """The entries a G3 file holds (a run of them, back to back), from their headers' length
    fields alone: 1 where the file cannot be read or walked."""
    try:
        fd, _ = open_regular(path)
    except OSError:
        return 1
    n, offset = 0, 0
    try:
        while offset < size and (length := entry_length(os.pread(fd, HEADER_SIZE, offset))) is not None:
            n, offset = n + 1, offset + length
    except OSError:
        pass  # counted so far; verify reports the damage
    finally:
        os.close(fd)
    return max(n, 1)


def _read_check(codec: EntryCodec, ns: bytes, f: _File) -> tuple[str | None, Ident | None, int]:
    """Read and check one G3 file's entries as the tier does: (None, its identity, entries) when
    all are good, (why, its identity if it was opened, entries) at the first bad one. Raises
    Unverifiable, and FileNotFoundError if it is gone."""
    if f.name[:2] != f.shard:
        return "file in the wrong shard directory", None, 1
    assert f.key is not None
    try:
        fd, st = open_regular(f.path)  # never blocks on a FIFO, never follows a link
    except FileNotFoundError:
        raise
    except OSError as e:
        return f"cannot open: {e.strerror or e}", None, 1
    n, offset = 0, 0
    with open(fd, "rb") as fh:
        ident = (st.st_dev, st.st_ino)
        try:
            while offset < st.st_size or n == 0:
                head = check_entry(codec, fh.read(HEADER_SIZE), ns, None if n else f.key, st.st_size - offset,
                                   exact=False)
                data = fh.read(head.payload_len)
                if len(data) != head.payload_len:
                    raise CorruptEntry(f"truncated payload ({len(data)} of {head.payload_len} bytes)")
                codec.check_payload(head, data)
                n, offset = n + 1, offset + HEADER_SIZE + head.payload_len
        except CorruptEntry as e:
            return (str(e) if not n else f"entry {n + 1} (byte {offset}): {e}"), ident, n + 1
        except OSError as e:  # EIO and the like: the tier removes such a file too
            return f"read error: {e.strerror or e}", ident, n + 1
    return None, ident, n


def _remove(path: str, ident: Ident | None) -> str | None:
    """Unlink `path` if it is still the file `ident` names (None: any); why not, or None when done."""
    try:
        if ident is not None:
            st = os.stat(path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != ident:
                return "replaced by a new file since it was read; left alone"
        remove_entry_path(path)
    except FileNotFoundError:  # gone already (the tier removed or evicted it)
        return None
    except OSError as e:
        return f"cannot remove: {e.strerror or e}"
    return None


def _bad(where: str, reason: str, ident: Ident | None, remove: bool) -> Problem:
    if not remove:
        return Problem(where, reason)
    why_not = _remove(where, ident)
    return Problem(where, reason if why_not is None else f"{reason} ({why_not})", removed=why_not is None)


def verify_dir(root: Path, codec: EntryCodec, remove: bool = False, namespace: bytes | None = None) -> VerifyReport:
    """Read and check every entry (and flag temp files whose writer is gone); with `remove`, unlink
    the bad ones (see the module docstring for what is never touched)."""
    walk = _walk(root, namespace)
    bad: list[Problem] = []
    unverified: list[str] = []
    checked = good = in_flight = 0
    for ns, ns_dir in walk.namespaces:
        for f in walk.files(ns_dir):
            if not f.is_entry:
                if f.live_temp:
                    in_flight += 1
                else:
                    bad.append(_bad(f.path, f"temp file of an interrupted write (pid {f.writer} is not running)",
                                    None, remove))
                continue
            try:
                reason, ident, entries = _read_check(codec, ns, f)
            except FileNotFoundError:  # evicted since the listing: not an entry any more
                continue
            except Unverifiable as e:
                checked += 1
                unverified.append(f"{f.path}: {e}")
                continue
            checked += entries
            if reason is None:
                good += entries
            else:
                bad.append(_bad(f.path, reason, ident, remove))
    bad.extend(walk.errors)  # a directory that could not be listed was not verified
    return VerifyReport(TIER, str(root), checked, good, tuple(bad), tuple(unverified), in_flight, walk.foreign)


def clear_dir(root: Path, namespace: bytes | None = None) -> ClearReport:
    """Unlink every entry (of one namespace, or all) and the temp files of writers that are gone.
    Namespace records and directories stay (a running tier keeps using them)."""
    walk = _walk(root, namespace)
    removed = nbytes = in_flight = 0
    failed: list[Problem] = []
    for _, ns_dir in walk.namespaces:
        for f in walk.files(ns_dir):
            if f.live_temp:
                in_flight += 1
                continue
            try:
                size = os.stat(f.path, follow_symlinks=False).st_size if f.is_entry else 0
                os.unlink(f.path)
            except FileNotFoundError:
                continue
            except OSError as e:
                failed.append(Problem(f.path, f"cannot remove: {e.strerror or e}"))
                continue
            removed += f.is_entry
            nbytes += size
    failed.extend(walk.errors)
    return ClearReport(TIER, str(root), removed, nbytes, in_flight, walk.foreign, tuple(failed))
