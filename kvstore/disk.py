"""G3: the local-disk tier, a `StorageBackend` over files of I/O size, each a run of blocks.

Layout (`kvstore.disk_layout`): `{root}/{namespace.hex()}/{key.hex()[:2]}/{key.hex()}.kvb`,
directories 0700 and files 0600. A file holds the entries one `put` call stored, back to back, up
to `file_bytes` (`IO_BYTES` by default), and is named by its first key (`kvstore.disk_index`): the
OS and the disk see MiB-sized files and reads, while every key stays its own entry, found, checked
and served on its own (a prefix hits at block granularity inside a file). A `get_into` of several
keys reads each run of neighbouring entries of one file in one `preadv`, straight into the
caller's buffers. `namespace` is the model fingerprint digest, so another model or dtype on the
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
- Start-up rebuilds the index from the headers (magic, version, namespace, the first key matching
  the file name, header checksum, sizes); bad files are counted in `stats.corrupt`, removed and
  logged, and a file damaged after its first entry keeps the entries before the damage. Entries
  re-enter the LRU order oldest write first.
- Eviction removes the victim's whole file; a key deleted, replaced or found damaged alone leaves
  a hole counted in `used_bytes` until its file's last entry goes.
- A write never drops other keys: a new file is named by one of its keys that names no file
  holding others, and where none can, the file it replaces has its other entries carried over.
- Every read verifies the payload checksum (or MAC); a mismatch, truncation or IO error is counted,
  removed, logged and reported as a miss. Bytes that failed verification are never served.
- A file's reads and checks run in one call of a native loop without the GIL (`kvstore.native`),
  or in Python where it cannot be built: the same checks, the same results.
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstore.backend import (IO_BYTES, BackendError, BackendStats, Buffer, Scatter, ScatterBatch, ScatterReads,
                             StorageBackend, check_blocks, check_infos, check_keys, check_scatter_outs)
from kvstore.disk_files import (Checked, Target, file_ident, read_batch_native, read_entries, read_file_native,
                                read_file_python, scan_directory)
from kvstore.disk_index import DiskIndex, FileName, Ident, Loc
from kvstore.disk_layout import (entry_key, fsync_dir, reason,
                                 unlink_quietly)
# MAGIC, HEADER_SIZE and encode_header are also imported from here (the format's old home).
from kvstore.entry import HEADER_SIZE, MAGIC, CorruptEntry, EntryCodec, EntryHeader, check_secret, encode_header  # noqa: F401
from kvstore.disk_config import DiskConfig  # noqa: F401 - re-exported: kvstore.disk.DiskConfig
from kvstore import native
from kvstore.keys import BlockKey
from kvstore.namespace_info import write_disk_record
from kvstore.disk_dir import NamespaceDir
from kvstore.write_gate import WriteGate
from policies import BlockInfo, PolicySpecLike, check_candidates, make_policy

logger = logging.getLogger(__name__)



class DiskBackend(StorageBackend, ScatterReads):
    """The G3 tier. See the module docstring for the format and guarantees."""

    name = "disk"  # its name in a tier stack (connectors.stack) and in /v1/kv/stats

    def __init__(
        self, root: Path | str, capacity_bytes: int, namespace: bytes, policy: PolicySpecLike = "lru",
        fsync: bool = False, retry_after_s: float = 30.0, secret: bytes | None = None,
        entry_bytes: int | None = None, touch_on_read: bool = True, info: Mapping[str, Any] | None = None,
        file_bytes: int = IO_BYTES, native_io: bool = True,
    ) -> None:
        self.config = DiskConfig(Path(root), capacity_bytes, namespace, policy, fsync, retry_after_s, secret,
                                 entry_bytes, touch_on_read, info, file_bytes, native_io)
        self._codec = EntryCodec(secret)
        self._reader = native.reader() if native_io else None
        self.directory = self.config.root / namespace.hex()
        self.stats = BackendStats()
        self._files = NamespaceDir(self.config.root, namespace)
        self._dir = self._files.path
        self._gate = WriteGate(self._dir, retry_after_s)  # the write back-off
        self._policy = make_policy(policy, None if entry_bytes is None else capacity_bytes // (HEADER_SIZE + entry_bytes))
        self._index = DiskIndex()
        self._reserved = 0  # bytes claimed by writes in flight
        self._lock = threading.Lock()  # index, policy, counters, and publishing/unlinking files
        self._closed = False
        if (err := self._files.create()) is not None:
            self._write_failed(err, "opening the directory")
        fs = self._reader.local_filesystem(self._dir) if self._reader is not None else None
        self._scatter = fs is not None
        logger.info("G3 at %s: %s", self._dir, f"reads land in G1 ({fs})" if fs else
                    "reads go through buffers (no native read loop)" if self._reader is None else
                    "reads go through buffers (not a local filesystem)")
        if info is not None and self.writable:
            write_disk_record(self._dir, namespace, info)
        self._scan()

    # ---- public ----------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return self._index.used

    def occupancy(self) -> tuple[int, int | None]:
        return self._index.used, self.config.capacity_bytes

    @property
    def writable(self) -> bool:
        return self._gate.open

    def __len__(self) -> int:
        return len(self._index)

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        check_keys(keys)
        with self._lock:
            self._check_open()
            return [k in self._index for k in keys]

    def get(self, keys: Sequence[BlockKey]) -> list[bytes | None]:
        check_keys(keys)
        got = self._read(keys, None)
        return [bytes(g) if g is not None else None for g in got]

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[Buffer | Scatter]) -> list[bool]:
        views = check_scatter_outs(keys, outs)
        return [g is not None for g in self._read(keys, views)]

    @property
    def scatter_reads(self) -> bool:
        return self._scatter

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Buffer]) -> list[bool]:
        views = check_blocks(keys, blocks)
        self._check_open()
        return self._store(keys, views, None)

    def put_blocks(self, keys: Sequence[BlockKey], blocks: Sequence[Buffer], infos: Sequence[BlockInfo]) -> list[bool]:
        """`put`, the policy getting each block's BlockInfo at its insert (not a later touch)."""
        check_infos(keys, infos)
        views = check_blocks(keys, blocks)
        self._check_open()
        return self._store(keys, views, infos)

    def delete(self, keys: Sequence[BlockKey]) -> None:
        check_keys(keys)
        with self._lock:
            self._check_open()
            for key in keys:
                if key in self._index:
                    self._drop_key(key)

    def close(self) -> None:
        # Writes are synchronous within `put`, so there is nothing pending to flush.
        with self._lock:
            self._closed = True

    def check_integrity(self) -> None:
        """Raise RuntimeError unless index, byte counts, policy and files on disk agree."""
        with self._lock:
            on_disk = {}
            for shard, name in self._files.listing():
                if (key := entry_key(name)) is not None:
                    on_disk[key] = os.path.getsize(os.path.join(shard, name))
            self._index.check_integrity(on_disk)
            if self._reserved < 0 or self._index.used + self._reserved > self.config.capacity_bytes:
                raise RuntimeError(f"{self._index.used} used + {self._reserved} reserved > {self.config.capacity_bytes}")
            check_candidates(self._policy, self._index.keys(), f"G3 {self._dir}")

    # ---- start-up --------------------------------------------------------------------

    def _scan(self) -> None:
        found, bad = scan_directory(self._files.listing(regular_only=False), self._codec, self.config.namespace)
        self.stats.corrupt += bad
        for f in sorted(found, key=lambda f: f.mtime):  # oldest write first, so LRU order survives a restart
            self._add_file(f.name, f.size, f.entries, None, f.ident)
        while self._index.used > self.config.capacity_bytes and self._evict_one():
            pass  # the capacity shrank since the last run
        logger.info(
            "G3 %s: %d entries in %d files, %d bytes indexed; %d bad files removed%s",
            self._dir, len(self._index), len(self._index.files()), self._index.used, self.stats.corrupt,
            "; entries MAC'd with the KV secret" if self._codec.keyed else "",
        )

    # ---- reads -----------------------------------------------------------------------

    def _read(self, keys: Sequence[BlockKey], outs: Sequence[Target] | None) -> list[Target | bytearray | None]:
        """Each key's payload, read into outs[i] (get_into) or a new buffer (get); None = miss.
        Neighbouring entries of one file are read together."""
        got: list[memoryview | bytearray | None] = [None] * len(keys)
        by_file, idents = self._locate(keys, None if outs is None else [HEADER_SIZE + o.nbytes for o in outs])
        good: list[int] = []
        for name, wanted in by_file.items():
            targets = {i: (outs[i] if outs is not None else memoryview(bytearray(loc.size - HEADER_SIZE)))
                       for i, loc in wanted}
            for i in self._read_file(name, wanted, targets, keys, idents[name]):
                got[i] = targets[i] if outs is not None else targets[i].obj
                good.append(i)
        self._served(keys, good, sum(outs[i].nbytes if outs is not None else len(got[i]) for i in good))  # type: ignore[arg-type]
        return got

    def get_into_batch(self, keys: Sequence[BlockKey], batch: ScatterBatch, threads: int = 1) -> list[bool]:
        """A load's values in one call of the native loop, its files spread over up to `threads`
        threads of the loop's own: no Python per entry between the reads. `get_into`'s results."""
        check_keys(keys)
        if len(keys) != len(batch):
            raise ValueError(f"get_into_batch got {len(keys)} keys but {len(batch)} values")
        if self._reader is None:
            return super().get_into_batch(keys, batch, threads)
        by_file, idents = self._locate(keys, (batch.value_bytes + HEADER_SIZE).tolist())
        names = list(by_file)  # in the keys' order: a prefix's first files are read first
        paths = [self._files.entry(name) for name in names]
        wanted = list(by_file.values())
        results, read_s, check_s = read_batch_native(self._reader, paths, wanted, batch, keys, self._codec,
                                                     self.config.namespace, threads)
        good: list[int] = []
        for name, path, ws, res in zip(names, paths, wanted, results):
            if isinstance(res, OSError):
                self._lost(name, path, len(ws), res)
                continue
            settled = self._settle(name, path, ws, keys, *res, idents[name])
            if settled is None:  # replaced by a put since planned (a block stored again): read it anew
                again = [i for i, _ in ws]
                settled = [i for i, hit in zip(again, self.get_into([keys[i] for i in again],
                                                                    [batch.scatter(i) for i in again])) if hit]
            good += settled
        with self._lock:
            self.stats.read_seconds += read_s
            self.stats.check_seconds += check_s
        self._served(keys, good, int(batch.value_bytes[good].sum()) if good else 0)
        hit = [False] * len(keys)
        for i in good:
            hit[i] = True
        return hit

    def _locate(self, keys: Sequence[BlockKey], sizes: list[int] | None) -> tuple[dict[FileName, list[tuple[int, Loc]]],
                                                                             dict[FileName, Ident | None]]:
        """`DiskIndex.locate` (the misses counted), with each file's identity as indexed."""
        with self._lock:
            self._check_open()
            by_file, misses = self._index.locate(keys, sizes)
            self.stats.misses += misses
            return by_file, {name: self._index.ident(name) for name in by_file}

    def _served(self, keys: Sequence[BlockKey], good: list[int], nbytes: int) -> None:
        """Counts the hits `good` (indices into `keys`) of `nbytes` and tells the policy of them."""
        with self._lock:
            self.stats.hits += len(good)
            self.stats.bytes_read += nbytes
            if self.config.touch_on_read:
                for i in sorted(good):  # uses in the caller's order
                    if keys[i] in self._policy:
                        self._policy.touch(keys[i])

    def _read_file(self, name: FileName, wanted: list[tuple[int, Loc]], targets: dict[int, Target],
                   keys: Sequence[BlockKey], expected: tuple[int, int] | None) -> list[int]:
        """Reads `wanted` (by offset) of one file, each run of adjacent entries in one preadv;
        returns the indices that were read and verified. `expected`: the file's identity when
        the reads were planned; another file there now (replaced since) is a miss, not damage."""
        path = self._files.entry(name)
        try:
            if self._reader is not None:
                ident, checked, read_s, check_s = read_file_native(self._reader, path, wanted, targets, keys,
                                                                   self._codec, self.config.namespace)
            else:
                ident, checked, read_s, check_s = read_file_python(path, wanted, targets, keys, self._codec,
                                                                   self.config.namespace)
        except OSError as e:
            self._lost(name, path, len(wanted), e)
            return []
        with self._lock:
            self.stats.read_seconds += read_s
            self.stats.check_seconds += check_s
        settled = self._settle(name, path, wanted, keys, ident, checked, expected)
        if settled is None:
            with self._lock:
                self.stats.misses += len(wanted)
        return settled or []

    def _lost(self, name: FileName, path: str, n: int, e: OSError) -> None:
        """A file that could not be opened: gone (misses), or a stranger at the path (NotRegularFile)
        or an I/O error (the file is lost)."""
        if isinstance(e, FileNotFoundError):
            self._vanished(name, path, n)
        else:
            self._file_lost(name, path, n, reason(e))

    def _settle(self, name: FileName, path: str, wanted: list[tuple[int, Loc]], keys: Sequence[BlockKey],
                ident: tuple[int, int], checked: Checked, expected: tuple[int, int] | None) -> list[int] | None:
        """The verified indices among one file's `checked` entries; the bad ones are dropped. None
        (nothing counted) when the file read was a replacement the index already knows of, put by
        this process since the reads were planned: not damage, and its offsets may be others."""
        if expected is not None and ident != expected:
            with self._lock:
                if self._index.ident(name) != expected:
                    return None
        # (another identity put there by something outside this process: the checks judge it)
        good = []
        for i, loc, err in checked:
            if err is None:
                good.append(i)
            else:
                self._corrupt(keys[i], loc, path, ident, err)
        return good

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

    def _vanished(self, name: FileName, path: str, n: int) -> None:
        # Removed behind our back (not by us: we unlink under the lock): misses.
        with self._lock:
            self.stats.misses += n
            if self._index.has_file(name) and not os.path.exists(path):
                for key in self._index.drop_file(name):
                    self._policy.remove(key)

    def _file_lost(self, name: FileName, path: str, n: int, reason: str) -> None:
        with self._lock:
            self.stats.misses += n
            self.stats.corrupt += n
            if self._index.has_file(name):
                for key in self._index.drop_file(name):
                    self._policy.remove(key)
                self._files.unlink(name)
        logger.warning("G3 unreadable file %s (its entries are misses, removed): %s", path, reason)

    def _corrupt(self, key: BlockKey, loc: Loc, path: str, ident: tuple[int, int] | None, reason: str) -> None:
        with self._lock:
            self.stats.misses += 1
            self.stats.corrupt += 1
            try:
                st = os.lstat(path)
                same = ident is None or (st.st_dev, st.st_ino) == ident
            except OSError:
                same = True
            # Drop only the entry we read: a put may have published a good one since.
            if same and self._index.get(key) == loc:
                self._drop_key(key)
        logger.warning("G3 corrupt entry %s in %s (served as a miss, removed): %s", key.hex(), path, reason)

    # ---- writes ----------------------------------------------------------------------

    def _store(self, keys: Sequence[BlockKey], views: list[memoryview], infos: Sequence[BlockInfo] | None) -> list[bool]:
        """Writes the blocks as files of up to `file_bytes` each, in the order given."""
        out = [False] * len(keys)
        limit = min(self.config.file_bytes, self.config.capacity_bytes)
        group: list[int] = []
        in_group: set[BlockKey] = set()  # a repeated key starts a new file: the later value wins
        size = 0
        for i, (key, view) in enumerate(zip(keys, views)):
            n = HEADER_SIZE + view.nbytes
            if group and (size + n > limit or key in in_group):
                self._store_file(group, keys, views, infos, out)
                group, size = [], 0
                in_group.clear()
            group.append(i)
            in_group.add(key)
            size += n
        if group:
            self._store_file(group, keys, views, infos, out)
        return out

    def _store_file(self, group: list[int], keys: Sequence[BlockKey], views: list[memoryview],
                    infos: Sequence[BlockInfo] | None, out: list[bool]) -> None:
        size = sum(HEADER_SIZE + views[i].nbytes for i in group)
        if size > self.config.capacity_bytes:
            return
        headers = {i: self._codec.seal(self.config.namespace, keys[i], views[i]) for i in group}  # hashing outside the lock
        with self._lock:
            self._check_open()
            # Named by a key whose name no file with other entries has: a rewritten key that
            # named a file of several (a prompt's last block, stored again) must not drop the rest.
            first = self._index.pick_name([keys[i] for i in group])
            group = [group[first], *group[:first], *group[first + 1:]]
            name = keys[group[0]]
            # Only when no key could name it: read under the lock (rare since the engine skips keys
            # a tier holds), so the entries cannot move before they are copied.
            carry = self._index.foreign(name, {keys[i] for i in group})
            carried = read_entries(self._files.entry(name), [loc for _, loc in carry]) if carry else []
            need = size + sum(map(len, carried or ()))
            if need > self.config.capacity_bytes:  # no room to carry them: they go with their file
                carried, need = None, size
            if not self._gate.allowed() or not self._reserve(need):
                return
        parts = [b for i in group for b in (memoryview(headers[i]), views[i])] + [memoryview(b) for b in carried or ()]
        try:
            tmp = self._files.write(name, parts, self.config.fsync)
        except OSError as e:
            with self._lock:
                self._reserved -= need
                self._write_failed(e, "write")
            return
        path = self._files.entry(name)
        with self._lock:
            self._reserved -= need
            try:
                # Published under the lock so that the index and the files always agree.
                self.stats.corrupt += self._files.publish(tmp, path)  # a stranger at the path, removed
            except OSError as e:
                self._write_failed(e, "publish")
                unlink_quietly(tmp)
                return
            entries, offset = [], 0
            for i in group:
                entries.append((keys[i], offset, HEADER_SIZE + views[i].nbytes))
                offset += HEADER_SIZE + views[i].nbytes
            for (key, loc), _ in zip(carry, carried or ()):  # still where they were read: not deleted or rewritten since
                if self._index.get(key) == loc:
                    entries.append((key, offset, loc.size))
                offset += loc.size
            self._add_file(name, need, entries, None if infos is None else [infos[i] for i in group], file_ident(path),
                           fresh=len(group))
            self.stats.bytes_written += size - HEADER_SIZE * len(group)  # payload bytes, as bytes_read counts them
            self._gate.worked()
        if self.config.fsync:
            fsync_dir(os.path.dirname(path))
        for i in group:
            out[i] = True

    def _add_file(self, name: FileName, size: int, entries: list[tuple[BlockKey, int, int]],
                  infos: Sequence[BlockInfo] | None, ident: tuple[int, int] | None, fresh: int | None = None) -> None:
        """Index a file. Its first `fresh` entries (all by default), which `infos` describe, are
        touched or inserted in the policy; the ones after them were carried over from the file
        it replaces, and keep their place."""
        gone, emptied = self._index.add_file(name, size, entries, ident)
        for key in gone:
            self._policy.remove(key)
        for f in emptied:
            self._files.unlink(f)
        for j, (key, _, _) in enumerate(entries[:fresh]):
            info = None if infos is None else infos[j]
            if key in self._policy:
                self._policy.touch(key) if info is None else self._policy.touch_block(key, info)
            else:
                self._policy.insert(key) if info is None else self._policy.insert_block(key, info)

    def _write_failed(self, err: OSError, what: str) -> None:
        self.stats.write_errors += 1
        self._gate.failed(err, what)

    def _reserve(self, size: int) -> bool:
        while self._index.used + self._reserved + size > self.config.capacity_bytes:
            if not self._evict_one():
                return False
        self._reserved += size
        return True

    # ---- helpers (callers hold the lock, except during __init__) -------------------------

    def _evict_one(self) -> bool:
        """Evicts the policy's victim with the rest of its file."""
        victims = self._policy.evict(1)
        if victims is None:
            return False
        name = self._index.get(victims[0]).file  # type: ignore[union-attr]
        keys = self._index.drop_file(name)
        for key in keys:
            if key != victims[0]:
                self._policy.remove(key)
        self._files.unlink(name)
        self.stats.evictions += len(keys)
        return True

    def _drop_key(self, key: BlockKey) -> None:
        if key in self._policy:
            self._policy.remove(key)
        if (emptied := self._index.drop_key(key)) is not None:
            self._files.unlink(emptied)

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"DiskBackend {self._dir} is closed")

