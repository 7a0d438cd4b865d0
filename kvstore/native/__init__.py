"""G3's native read loop (`read_entries.c`): a file's reads and checks in one call without the GIL.

Built with the system C compiler on first use and cached under `$KVTIER_CACHE_DIR/native_io/<key>/`
(the key hashes the source, flags and compiler version; plain C, no CPU-specific flags). Where it
cannot be built or loaded (no compiler, no `xxhash`, a self-test that fails), `reader()` is None,
the reason is logged once, and G3 reads in Python as before: same results, slower on fast media.
`KVTIER_NATIVE_IO=off` chooses Python's reads (to compare the two, or to rule the loop out).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvstore.backend import Scatter, ScatterBatch
from kvstore.cache_dir import cache_root
from kvstore.clib import BuildError, compiler, open_library, publish, run, version
from kvstore.entry import HEADER_SIZE, EntryCodec
from kvstore.keys import KEY_BYTES

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "read_entries.c"
_FLAGS = ("-O2", "-fPIC", "-shared", "-std=c11", "-D_GNU_SOURCE", "-pthread")
_ABI = 3
_BUILD_TIMEOUT_S = 60
ENV = "KVTIER_NATIVE_IO"

ENTRY_OK, ENTRY_SHORT, ENTRY_UNCHECKED = 0, 1, 2  # as in read_entries.c
# statfs(2) magics of local filesystems, where a read always returns: only there may G3 read
# straight into G1 (a read outliving its timeout is waited for before the blocks are reused, and
# on a hung network mount it might never end). linux/magic.h.
LOCAL_FILESYSTEMS = {
    0x01021994: "tmpfs", 0x858458F6: "ramfs", 0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs",
    0xF2F52010: "f2fs", 0x2FC12FC1: "zfs", 0xCA451A4E: "bcachefs", 0x794C7630: "overlayfs",
}
FILE_NOT_REGULAR = 1


class FileRead(NamedTuple):
    """What one call did to one file. `code`: 0, FILE_NOT_REGULAR, or -errno of lstat/open/fstat
    (then nothing was read); `status[i]`: ENTRY_OK (read and verified), ENTRY_SHORT (not all its
    bytes came: `errno` says why, 0 = end of file) or ENTRY_UNCHECKED (read; Python must check it)."""

    code: int
    status: list[int]
    errno: int
    ident: tuple[int, int]  # (st_dev, st_ino); st_mode in [0] when code == FILE_NOT_REGULAR
    heads: bytes  # the entries' headers, HEADER_SIZE bytes each
    read_s: float
    check_s: float


class BatchRead(NamedTuple):
    """What one `read_batch` call did: per file j, `code[j]` and `errno[j]` (as FileRead's) and
    `ident[j]`; per entry (in the call's order), `status` and its header (`heads[i]`)."""

    code: np.ndarray  # int32 [files]
    errno: np.ndarray  # int32 [files]
    ident: np.ndarray  # uint64 [files, 2]
    status: np.ndarray  # int8 [entries]
    heads: np.ndarray  # uint8 [entries, HEADER_SIZE]
    read_s: float  # summed over the threads
    check_s: float


class _Fns(ctypes.Structure):
    """read_entries.c's xxh_fns: the `xxhash` package's XXH3 functions."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("h64", "create", "reset", "update", "digest", "release")]


class NativeReader:
    def __init__(self, lib: ctypes.CDLL, fns: _Fns) -> None:
        self._fn = lib.kvt_read_entries
        self._batch = lib.kvt_read_batch
        self._fs_magic = lib.kvt_fs_magic
        self._fns = fns

    def read(self, path: str, offsets: Sequence[int], sizes: Sequence[int], targets: Sequence[memoryview | Scatter],
             keys: Sequence[bytes], namespace: bytes, check: bool) -> FileRead:
        """Reads entry i (`offsets[i]`, `sizes[i]` bytes with its header) of the file at `path`, its
        payload into `targets[i]` (a writable buffer, or pieces of memory, of `sizes[i] - HEADER_SIZE`
        bytes), and with `check` verifies it holds `keys[i]` of `namespace` (unkeyed xxh3 entries only)."""
        n = len(offsets)
        anchors, addrs, lens, nseg = [], [], [], np.zeros(n, dtype=np.int32)
        for i, t in enumerate(targets):
            if isinstance(t, Scatter):
                addrs.append(t.addresses)
                lens.append(t.lengths)
                nseg[i] = len(t.addresses)
            elif t.nbytes:
                anchors.append(ctypes.c_char.from_buffer(t))  # pins the buffer for the call
                addrs.append(np.array([ctypes.addressof(anchors[-1])], dtype=np.int64))
                lens.append(np.array([t.nbytes], dtype=np.int64))
                nseg[i] = 1
        ptrs = np.ascontiguousarray(np.concatenate(addrs) if addrs else np.zeros(1, np.int64), dtype=np.int64)
        lengths = np.ascontiguousarray(np.concatenate(lens) if lens else np.zeros(1, np.int64), dtype=np.int64)
        heads = ctypes.create_string_buffer(n * HEADER_SIZE)
        status = (ctypes.c_int8 * n)()
        err, ident, spent = ctypes.c_int(0), (ctypes.c_uint64 * 2)(), (ctypes.c_int64 * 2)()
        code = self._fn(os.fsencode(path), n, (ctypes.c_int64 * n)(*offsets), (ctypes.c_int64 * n)(*sizes),
                        nseg.ctypes.data, ptrs.ctypes.data, lengths.ctypes.data, heads, b"".join(keys), namespace,
                        int(check), ctypes.byref(self._fns), status, ctypes.byref(err), ident, spent)
        del anchors
        return FileRead(code, list(status), err.value, (ident[0], ident[1]), heads.raw, spent[0] / 1e9, spent[1] / 1e9)

    def read_batch(self, paths: Sequence[str], first: np.ndarray, offsets: np.ndarray, sizes: np.ndarray,
                   pieces: ScatterBatch, values: np.ndarray, keys: bytes, namespace: bytes, check: bool,
                   threads: int) -> BatchRead:
        """Reads the entries of many files in one call, on up to `threads` threads of its own: file
        j's entries are i in `first[j]:first[j + 1]`, entry i (`offsets[i]`, `sizes[i]` bytes with
        its header) holding `keys[16 i:16 (i + 1)]`, its payload read into value `values[i]` of
        `pieces`. `read`'s checks, per entry."""
        n, nf = len(offsets), len(paths)
        i64 = lambda a: np.ascontiguousarray(a, dtype=np.int64)  # noqa: E731
        first, offsets, sizes = i64(first), i64(offsets), i64(sizes)
        seg_start, nseg = i64(pieces.starts[values]), np.ascontiguousarray(np.diff(pieces.starts)[values], np.int32)
        ptrs, lens = i64(pieces.addresses), i64(pieces.lengths)
        heads = np.zeros((n, HEADER_SIZE), np.uint8)
        status = np.zeros(n, np.int8)
        code, err, ident = np.zeros(nf, np.int32), np.zeros(nf, np.int32), np.zeros((nf, 2), np.uint64)
        spent = np.zeros(2, np.int64)
        c_paths = (ctypes.c_char_p * nf)(*map(os.fsencode, paths))
        self._batch(nf, c_paths, first.ctypes.data, offsets.ctypes.data, sizes.ctypes.data, seg_start.ctypes.data,
                    nseg.ctypes.data, ptrs.ctypes.data, lens.ctypes.data, heads.ctypes.data, keys, namespace,
                    int(check), ctypes.byref(self._fns), max(1, threads), status.ctypes.data, code.ctypes.data,
                    err.ctypes.data, ident.ctypes.data, spent.ctypes.data)
        return BatchRead(code, err, ident, status, heads, int(spent[0]) / 1e9, int(spent[1]) / 1e9)  # plain floats: stats cross processes

    def local_filesystem(self, path: str) -> str | None:
        """The name of the local filesystem `path` is on (LOCAL_FILESYSTEMS); None for any other
        (a network or FUSE mount) or when statfs fails."""
        got = self._fs_magic(os.fsencode(path))
        return LOCAL_FILESYSTEMS.get(got) if got >= 0 else None


def _build() -> Path:
    cc = compiler("CC", ("gcc", "cc"))
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + version(cc).encode()).hexdigest()[:16]
    return publish(cache_root() / "native_io" / key / "libkvtier_io.so",
                   lambda work, out: run([cc, *_FLAGS, str(_SOURCE), "-o", str(out)], _BUILD_TIMEOUT_S))


def _xxh3_functions() -> _Fns:
    """XXH3_64bits and the XXH3-128 streaming functions of the `xxhash` package's extension: the
    same code that computes the sums G3 writes."""
    try:
        import xxhash._xxhash as ext
    except ImportError as e:
        raise BuildError(f"no xxhash extension ({e})") from e
    try:
        so = ctypes.CDLL(ext.__file__)
        names = ("XXH3_64bits", "XXH3_createState", "XXH3_128bits_reset", "XXH3_128bits_update",
                 "XXH3_128bits_digest", "XXH3_freeState")
        return _Fns(*(ctypes.cast(getattr(so, name), ctypes.c_void_p).value for name in names))
    except (OSError, AttributeError) as e:
        raise BuildError(f"xxhash's extension does not export the XXH3 functions G3 checks with ({e})") from e


def _self_test(reader: NativeReader) -> None:
    """Reads one sealed entry from a temp file: whole and in three pieces it must verify and hold
    the payload, and with a flipped payload byte it must not verify."""
    ns, key, payload = bytes(range(KEY_BYTES)), bytes(range(1, KEY_BYTES + 1)), os.urandom(4096)
    entry = EntryCodec().seal(ns, key, payload) + payload
    pieces = [ctypes.create_string_buffer(n) for n in (1000, 96, 3000)]
    scatter = Scatter(np.array([ctypes.addressof(b) for b in pieces], dtype=np.int64),
                      np.array([len(b) for b in pieces], dtype=np.int64))
    with tempfile.TemporaryDirectory() as d:
        good, bad = os.path.join(d, "good"), os.path.join(d, "bad")
        Path(good).write_bytes(entry)
        Path(bad).write_bytes(entry[:-1] + bytes([entry[-1] ^ 1]))
        got = [reader.read(p, [0], [len(entry)], [t], [key], ns, True).status
               for p, t in ((good, memoryview(bytearray(len(payload)))), (good, scatter), (bad, scatter))]
        whole = memoryview(bytearray(len(payload)))
        into = ctypes.c_char.from_buffer(whole)
        batch = ScatterBatch(np.array([0, 3, 4]), np.concatenate([scatter.addresses, [ctypes.addressof(into)]]),
                             np.concatenate([scatter.lengths, [len(payload)]]), keep=whole)
        both = reader.read_batch([bad, good], np.array([0, 1, 2]), np.zeros(2), np.full(2, len(entry)), batch,
                                 np.array([0, 1]), key * 2, ns, True, 2)
        del into
    if got != [[ENTRY_OK], [ENTRY_OK], [ENTRY_UNCHECKED]] or b"".join(b.raw for b in pieces) != payload[:-1] + bytes([payload[-1] ^ 1]):
        raise BuildError(f"self-test failed (statuses {got}, expected [[0], [0], [2]], or the pieces' bytes differ)")
    if both.status.tolist() != [ENTRY_UNCHECKED, ENTRY_OK] or both.code.tolist() != [0, 0] or bytes(whole) != payload:
        raise BuildError(f"batch self-test failed (statuses {both.status.tolist()}, expected [2, 0], files "
                         f"{both.code.tolist()}, or the bytes differ)")


@functools.cache
def reader() -> NativeReader | None:
    """The native reader, built and self-tested once per process; None where it is unavailable."""
    choice = os.environ.get(ENV, "on")
    if choice not in ("on", "off"):
        raise ValueError(f"{ENV}={choice!r}: use 'on' (the default) or 'off'")
    if choice == "off":
        log.info("G3 reads in Python: %s=off", ENV)
        return None
    try:
        path = _build()
        lib = open_library(path, "kvt_read_abi", _ABI)
        p = ctypes.c_void_p
        lib.kvt_read_entries.restype = ctypes.c_int
        lib.kvt_read_entries.argtypes = [ctypes.c_char_p, ctypes.c_int, p, p, p, p, p, p, ctypes.c_char_p,
                                         ctypes.c_char_p, ctypes.c_int, p, p, p, p, p]
        lib.kvt_read_batch.restype = None
        lib.kvt_read_batch.argtypes = [ctypes.c_int, p, p, p, p, p, p, p, p, p, ctypes.c_char_p, ctypes.c_char_p,
                                       ctypes.c_int, p, ctypes.c_int, p, p, p, p, p]
        lib.kvt_fs_magic.restype = ctypes.c_int64
        lib.kvt_fs_magic.argtypes = [ctypes.c_char_p]
        out = NativeReader(lib, _xxh3_functions())
        _self_test(out)
    except BuildError as e:
        log.warning("G3 reads in Python (slower on fast media): the native read loop is unavailable: %s", e)
        return None
    log.debug("G3 native read loop: %s", path)
    return out
