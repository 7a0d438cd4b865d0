"""G3: the local-disk tier, a `StorageBackend` over one file per block.

Layout (`kvstore.disk_layout`): `{root}/{namespace.hex()}/{key.hex()[:2]}/{key.hex()}.kvb`,
directories 0700 and files 0600. `namespace` is the model fingerprint digest, so another model or dtype on the
same root lives in another directory and can never be served.
`namespace.json` in a namespace's directory says which model it is (`kvstore.namespace_info`, for
`kvtier kv inspect`); the tier writes it at start-up and never reads it.

Each file is one entry in the self-checking format of `kvstore.entry` (magic, version,
namespace, key, payload length and checksum, header checksum), keyed with a MAC when the
operator sets a KV secret (`secret`): then an entry this process cannot verify with that secret,
unkeyed ones included, is treated as corrupt, and so is a keyed entry when no secret is set.

Guarantees:
- Writes are atomic: a unique temp file in the entry's directory, optional fsync, then
  `os.replace`. A killed writer leaves at most a temp file, which start-up removes.
- Start-up rebuilds the index from the headers (magic, version, namespace, key matching the
  file name, header checksum, file size); bad files are counted in `stats.corrupt`, removed
  and logged. Entries re-enter the LRU order oldest write first.
- Every read verifies the payload checksum (or MAC); a mismatch, truncation or IO error is counted,
  removed, logged and reported as a miss. Bytes that failed verification are never served.
- Entries are opened without following links and without blocking (`disk_layout.open_regular`):
  a FIFO, device node, directory, socket or symlink at an entry's path is a miss, logged once and
  removed (at start-up too), never a read that blocks a tier thread. One planted where a write
  lands is removed and the write goes on; it does not disable writes.
- Any OSError on write (ENOSPC, EROFS, EACCES, ...) abandons that write and disables writes
  for `retry_after_s` (30 s by default); reads keep working. A read-only directory at
  start-up gives a read-only tier, not a crash.
- One process per directory: a second live process is not corrupted or served wrong bytes,
  but the two do not share an index, so their capacity accounting is independent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.backend import (BackendError, BackendStats, Buffer, StorageBackend, check_blocks, check_infos, check_keys,
                             check_outs)
from kvstore.disk_layout import (entry_key, entry_path, fsync_dir, list_files, open_regular, pid_alive, reason,
                                 remove_entry_path, temp_path, temp_writer, unlink_quietly, write_all)
# MAGIC, HEADER_SIZE and encode_header are also imported from here (the format's old home).
from kvstore.entry import HEADER_SIZE, MAGIC, CorruptEntry, EntryCodec, EntryHeader, check_secret, encode_header  # noqa: F401
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.namespace_info import check_info, write_disk_record
from policies import BlockInfo, PolicySpecLike, check_candidates, make_policy

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class DiskConfig:
    root: Path
    capacity_bytes: int  # header + payload bytes of all entries
    namespace: bytes  # 16-byte model fingerprint digest
    policy: PolicySpecLike = "lru"  # a policies.make_policy spec
    fsync: bool = False  # fsync file and directory per write: power-loss durability, slower
    retry_after_s: float = 30.0  # back-off before writing again after a write error
    # KV secret: entries carry keyed MACs and unkeyed ones are rejected (see kvstore.entry)
    secret: bytes | None = field(default=None, repr=False)
    # A typical entry's payload bytes: the policy's capacity is capacity_bytes // (header + this)
    # entries (approximate where entries differ, as with KV groups); None: unknown.
    entry_bytes: int | None = None
    # Reads count as uses. The connector turns it off: it reports each read that served a request
    # through touch_blocks, with the block's metadata, so no use counts twice.
    touch_on_read: bool = True
    # What the namespace is (model, dtype, ...): written to {root}/{namespace}/namespace.json for
    # the `kvtier kv` tools (kvstore.namespace_info); informational, never read back by the tier.
    info: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        check_secret(self.secret)
        check_info(self.info)
        if type(self.namespace) is not bytes or len(self.namespace) != KEY_BYTES:
            raise ValueError(f"namespace must be {KEY_BYTES} bytes (a fingerprint digest), got {self.namespace!r}")
        if self.capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {self.capacity_bytes}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if self.entry_bytes is not None and self.entry_bytes < 1:
            raise ValueError(f"entry_bytes must be >= 1 or None, got {self.entry_bytes}")


class DiskBackend(StorageBackend):
    """The G3 tier. See the module docstring for the format and guarantees."""

    name = "disk"  # its name in a tier stack (connectors.stack) and in /v1/kv/stats

    def __init__(
        self, root: Path | str, capacity_bytes: int, namespace: bytes, policy: PolicySpecLike = "lru",
        fsync: bool = False, retry_after_s: float = 30.0, secret: bytes | None = None,
        entry_bytes: int | None = None, touch_on_read: bool = True, info: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = DiskConfig(Path(root), capacity_bytes, namespace, policy, fsync, retry_after_s, secret,
                                 entry_bytes, touch_on_read, info)
        self._codec = EntryCodec(secret)
        self.directory = self.config.root / namespace.hex()
        self.stats = BackendStats()
        self._dir = str(self.directory)
        self._policy = make_policy(policy, None if entry_bytes is None else capacity_bytes // (HEADER_SIZE + entry_bytes))
        self._index: dict[BlockKey, int] = {}  # key -> file size (header + payload)
        self._used = 0  # bytes of indexed entries
        self._reserved = 0  # bytes claimed by writes in flight
        self._lock = threading.Lock()  # index, policy, counters, and publishing/unlinking files
        self._closed = False
        self._disabled_until: float | None = None  # writes refused until this monotonic time
        self._warned = False  # one warning per run of write failures
        self._shards: set[str] = set()  # shard directories known to exist
        self._open_directory()
        if info is not None and self.writable:
            write_disk_record(self._dir, namespace, info)
        self._scan()

    # ---- public ----------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._used

    def occupancy(self) -> tuple[int, int | None]:
        return self._used, self.config.capacity_bytes

    @property
    def writable(self) -> bool:
        return self._disabled_until is None

    def __len__(self) -> int:
        return len(self._index)

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        check_keys(keys)
        with self._lock:
            self._check_open()
            return [k in self._index for k in keys]

    def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        check_keys(keys)
        self._check_open()
        return [self._fetch(k, None) for k in keys]  # type: ignore[misc]

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[Buffer]) -> list[bool]:
        views = check_outs(keys, outs)
        self._check_open()
        return [self._fetch(k, v) is True for k, v in zip(keys, views)]

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Buffer]) -> list[bool]:
        views = check_blocks(keys, blocks)
        self._check_open()
        return [self._store(k, v, None) for k, v in zip(keys, views)]

    def put_blocks(self, keys: Sequence[BlockKey], blocks: Sequence[Buffer], infos: Sequence[BlockInfo]) -> list[bool]:
        """`put`, the policy getting each block's BlockInfo at its insert (not a later touch)."""
        check_infos(keys, infos)
        views = check_blocks(keys, blocks)
        self._check_open()
        return [self._store(k, v, i) for k, v, i in zip(keys, views, infos)]

    def delete(self, keys: Sequence[BlockKey]) -> None:
        check_keys(keys)
        with self._lock:
            self._check_open()
            for key in keys:
                if key in self._index:
                    self._drop(key)

    def close(self) -> None:
        # Writes are synchronous within `put`, so there is nothing pending to flush.
        with self._lock:
            self._closed = True

    def check_integrity(self) -> None:
        """Raise RuntimeError unless index, byte counts, policy and files on disk agree."""
        with self._lock:
            on_disk = {}
            for shard, name in self._listing():
                if (key := entry_key(name)) is not None:
                    on_disk[key] = os.path.getsize(os.path.join(shard, name))
            if on_disk != self._index:
                extra = sorted(k.hex() for k in on_disk.keys() - self._index.keys())
                missing = sorted(k.hex() for k in self._index.keys() - on_disk.keys())
                sizes = sorted(k.hex() for k in on_disk.keys() & self._index.keys() if on_disk[k] != self._index[k])
                raise RuntimeError(f"index and files differ: unindexed {extra}, missing {missing}, size {sizes}")
            if self._used != sum(self._index.values()):
                raise RuntimeError(f"used_bytes {self._used} != {sum(self._index.values())} indexed")
            if self._reserved < 0 or self._used + self._reserved > self.config.capacity_bytes:
                raise RuntimeError(f"{self._used} used + {self._reserved} reserved > {self.config.capacity_bytes}")
            check_candidates(self._policy, self._index.keys(), f"G3 {self._dir}")

    # ---- start-up --------------------------------------------------------------------

    def _open_directory(self) -> None:
        try:
            self.config.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                os.mkdir(self._dir, 0o700)
            except FileExistsError:
                pass
        except OSError as e:
            self._write_failed(e, f"cannot create {self._dir}")
            return
        if not os.access(self._dir, os.W_OK):
            self._write_failed(PermissionError(f"{self._dir} is not writable"), "read-only directory")

    def _scan(self) -> None:
        found: list[tuple[int, BlockKey, int]] = []  # (mtime, key, size)
        for shard, name in self._listing(regular_only=False):  # strangers at entry names are removed
            path = os.path.join(shard, name)
            if (key := entry_key(name)) is not None:
                try:
                    if name[:2] != os.path.basename(shard):
                        raise CorruptEntry("file in the wrong shard directory")
                    size, mtime = self._check_header_file(path, key)
                except FileNotFoundError:
                    continue
                except (CorruptEntry, OSError) as e:
                    self._remove_bad(path, reason(e))
                    continue
                found.append((mtime, key, size))
            elif (pid := temp_writer(name)) is not None:
                if pid != os.getpid() and pid_alive(pid):
                    continue  # another live process is writing it
                self._remove_bad(path, "temp file of an interrupted write")
            # anything else is not ours: left alone
        found.sort()
        for _, key, size in found:  # oldest write first, so LRU order survives a restart
            self._index[key] = size
            self._policy.insert(key)
            self._used += size
        while self._used > self.config.capacity_bytes and self._evict_one():
            pass  # the capacity shrank since the last run
        logger.info(
            "G3 %s: %d entries, %d bytes indexed; %d bad files removed%s",
            self._dir, len(self._index), self._used, self.stats.corrupt,
            "; entries MAC'd with the KV secret" if self._codec.keyed else "",
        )

    def _listing(self, regular_only: bool = True) -> list[tuple[str, str]]:
        """(shard directory, file name) of every file under the namespace directory."""
        out = list_files(self._dir, lambda path, e: logger.warning("G3 cannot list %s: %s", path, e), regular_only)
        self._shards.update(shard for shard, _ in out)
        return out

    def _check_header_file(self, path: str, key: BlockKey) -> tuple[int, int]:
        fd, st = open_regular(path)
        try:
            head = self._validate(os.read(fd, HEADER_SIZE), key, st.st_size)
        finally:
            os.close(fd)
        return HEADER_SIZE + head.payload_len, st.st_mtime_ns

    def _validate(self, raw: bytes, key: BlockKey, file_size: int) -> EntryHeader:
        head = self._codec.open_header(raw)
        if head.namespace != self.config.namespace:
            raise CorruptEntry("namespace (model fingerprint) differs from its directory's")
        if head.key != key:
            raise CorruptEntry(f"holds key {head.key.hex()}, not the one its name says")
        if file_size != HEADER_SIZE + head.payload_len:
            raise CorruptEntry(f"size {file_size}, header says {HEADER_SIZE + head.payload_len} (torn)")
        return head

    # ---- reads -----------------------------------------------------------------------

    def _fetch(self, key: BlockKey, out: memoryview | None) -> bytes | bool | None:
        """Bytes (get), True (get_into filled `out`), or None (miss)."""
        with self._lock:
            self._check_open()
            size = self._index.get(key)
            if size is None or (out is not None and HEADER_SIZE + out.nbytes != size):
                self.stats.misses += 1
                return None
        path = self._path(key)
        ident = None
        try:
            fd, st = open_regular(path)
            with open(fd, "rb") as f:
                ident = (st.st_dev, st.st_ino)
                head = self._validate(f.read(HEADER_SIZE), key, st.st_size)
                n = head.payload_len
                if out is None:
                    data = f.read(n)
                    got = len(data)
                elif out.nbytes != n:  # replaced since we looked: a different value, not damage
                    with self._lock:
                        self.stats.misses += 1
                    return None
                else:
                    data = out
                    got = f.readinto(out)  # buffered readinto loops until full or EOF
                if got != n:
                    raise CorruptEntry(f"truncated payload ({got} of {n} bytes)")
                self._codec.check_payload(head, data)
        except FileNotFoundError:
            self._vanished(key, path)
            return None
        except (CorruptEntry, OSError) as e:
            self._corrupt(key, path, ident, reason(e))
            return None
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_read += n
            if self.config.touch_on_read and key in self._policy:
                self._policy.touch(key)
        return data if out is None else True

    def touch(self, keys: Sequence[BlockKey], priority: int) -> None:
        """Passes the using request's priority to this tier's eviction policy."""
        check_keys(keys)
        self._check_open()
        with self._lock:
            for key in keys:
                if key in self._policy:
                    self._policy.touch(key, priority)

    def touch_blocks(self, keys: Sequence[BlockKey], infos: Sequence[BlockInfo]) -> None:
        """Passes each use, with the block's metadata, to this tier's eviction policy."""
        check_infos(keys, infos)
        self._check_open()
        with self._lock:
            for key, info in zip(keys, infos):
                if key in self._policy:
                    self._policy.touch_block(key, info)

    def _vanished(self, key: BlockKey, path: str) -> None:
        # Removed behind our back (not by us: we unlink under the lock): a plain miss.
        with self._lock:
            self.stats.misses += 1
            if key in self._index and not os.path.exists(path):
                self._drop(key, unlink=False)

    def _corrupt(self, key: BlockKey, path: str, ident: tuple[int, int] | None, reason: str) -> None:
        with self._lock:
            self.stats.misses += 1
            self.stats.corrupt += 1
            try:
                st = os.lstat(path)
                same = ident is None or (st.st_dev, st.st_ino) == ident
            except OSError:
                same = True
            # Remove only the file we read: a put may have published a good one since.
            if same and key in self._index:
                self._drop(key)
        logger.warning("G3 corrupt entry %s (served as a miss, removed): %s", path, reason)

    # ---- writes ----------------------------------------------------------------------

    def _store(self, key: BlockKey, view: memoryview, info: BlockInfo | None) -> bool:
        size = HEADER_SIZE + view.nbytes
        if size > self.config.capacity_bytes:
            return False
        header = self._codec.seal(self.config.namespace, key, view)  # hashing outside the lock
        with self._lock:
            self._check_open()
            if not self._writes_allowed() or not self._reserve(size):
                return False
        try:
            tmp = self._write_temp(key, header, view)
        except OSError as e:
            with self._lock:
                self._reserved -= size
                self._write_failed(e, "write")
            return False
        path = self._path(key)
        with self._lock:
            self._reserved -= size
            try:
                # Published under the lock so that the index and the files always agree.
                self._publish(tmp, path)
            except OSError as e:
                self._write_failed(e, "publish")
                unlink_quietly(tmp)
                return False
            old = self._index.get(key)
            if old is not None:
                self._used -= old
                self._policy.touch(key) if info is None else self._policy.touch_block(key, info)
            else:
                self._policy.insert(key) if info is None else self._policy.insert_block(key, info)
            self._index[key] = size
            self._used += size
            self.stats.bytes_written += view.nbytes  # payload bytes, as bytes_read counts them
            if self._warned:
                logger.info("G3 %s: writes work again", self._dir)
                self._warned = False
        if self.config.fsync:
            fsync_dir(os.path.dirname(path))
        return True

    def _publish(self, tmp: str, path: str) -> None:
        try:
            os.replace(tmp, path)
        except OSError as e:
            # A directory planted at the entry's path (rename cannot replace it): remove it and
            # publish, rather than count it as a failing disk and stop every write.
            if not os.path.isdir(path) or os.path.islink(path):
                raise
            self.stats.corrupt += 1
            logger.warning("G3 removing a directory at entry path %s (%s)", path, e.strerror or e)
            remove_entry_path(path)
            os.replace(tmp, path)

    def _write_temp(self, key: BlockKey, header: bytes, view: memoryview) -> str:
        tmp = temp_path(self._dir, key)
        shard = os.path.dirname(tmp)
        if shard not in self._shards:
            try:
                os.mkdir(shard, 0o700)
            except FileExistsError:
                pass
            self._shards.add(shard)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:
            self._shards.discard(shard)  # maybe removed behind our back: recreate next time
            raise
        try:
            try:
                write_all(fd, memoryview(header))
                write_all(fd, view)
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            unlink_quietly(tmp)
            raise
        return tmp

    def _writes_allowed(self) -> bool:
        if self._disabled_until is None:
            return True
        if time.monotonic() < self._disabled_until:
            return False
        self._disabled_until = None  # back-off over: try again; a new failure disables again
        return True

    def _write_failed(self, err: OSError, what: str) -> None:
        self.stats.write_errors += 1
        self._disabled_until = time.monotonic() + self.config.retry_after_s
        if not self._warned:
            self._warned = True
            logger.warning(
                "G3 %s: %s failed (%s); writes disabled, retrying after %.0f s; reads continue",
                self._dir, what, err, self.config.retry_after_s,
            )
        else:
            logger.debug("G3 %s: %s failed again (%s)", self._dir, what, err)

    def _reserve(self, size: int) -> bool:
        while self._used + self._reserved + size > self.config.capacity_bytes:
            if not self._evict_one():
                return False
        self._reserved += size
        return True

    # ---- helpers (callers hold the lock, except during __init__) -------------------------

    def _evict_one(self) -> bool:
        victims = self._policy.evict(1)
        if victims is None:
            return False
        self._drop(victims[0])
        self.stats.evictions += 1
        return True

    def _drop(self, key: BlockKey, unlink: bool = True) -> None:
        self._used -= self._index.pop(key)
        if key in self._policy:
            self._policy.remove(key)
        if unlink:
            try:
                remove_entry_path(self._path(key))
            except OSError as e:  # e.g. a read-only file system: the file outlives its entry
                logger.debug("G3 cannot remove %s: %s", self._path(key), e)

    def _remove_bad(self, path: str, reason: str) -> None:
        self.stats.corrupt += 1
        logger.warning("G3 removing bad file %s: %s", path, reason)
        try:
            remove_entry_path(path)
        except OSError as e:
            logger.debug("G3 cannot remove %s: %s", path, e)

    def _path(self, key: BlockKey) -> str:
        return entry_path(self._dir, key)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"DiskBackend {self._dir} is closed")

