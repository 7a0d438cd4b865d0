"""Keeps CPython from mapping and unmapping a frame-stack chunk on every call of a hot loop.

CPython 3.11+ keeps frames in chunks of at least 16 KiB from its arena allocator (mmap) and
unmaps a chunk as soon as the last frame in it returns. A loop whose calls cross a chunk's edge
then maps, faults in and unmaps 16 KiB on every call (gh-142183, fixed upstream only after 3.14),
and each unmap interrupts the other forward threads to flush their TLBs. Whether the engine's step
crosses an edge depends only on how deep its caller's stack is: on a 2-core AMX Xeon the same
float32 workload took 40-41 s called from a short script and 44-45 s from `benchmarks/throughput.py`,
with 100k page faults against 300.

`install()` puts `stack_chunks.c` in front of the arena allocator: freed blocks up to 256 KiB (stack
chunks; pymalloc's arenas are 1 MiB) wait in four slots and are handed back on the next request of
that size. Built with the system C compiler on first use and cached under `$KVTIER_CACHE_DIR`, like
G3's read loop. Not installed on a free-threaded build (the slots rely on the GIL) or off CPython;
`KVTIER_STACK_CHUNK_CACHE=off` leaves CPython's allocator alone (to compare the two).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from kvstore.cache_dir import cache_root
from kvstore.clib import BuildError, compiler, open_library, publish, run, version

log = logging.getLogger(__name__)

ENV = "KVTIER_STACK_CHUNK_CACHE"
_SOURCE = Path(__file__).with_name("stack_chunks.c")
_FLAGS = ("-O2", "-fPIC", "-shared", "-std=c11")
_ABI = 1
_BUILD_TIMEOUT_S = 60


class _Arena(ctypes.Structure):
    """CPython's PyObjectArenaAllocator."""

    _fields_ = [("ctx", ctypes.c_void_p), ("alloc", ctypes.c_void_p), ("free", ctypes.c_void_p)]


@dataclass(frozen=True)
class ChunkCounts:
    reused: int  # blocks handed back from a slot
    passed: int  # blocks the previous allocator made


class ChunkCache:
    """The installed cache; `counts()` says how many allocations it served."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def counts(self) -> ChunkCounts:
        get = functools.partial(ctypes.c_longlong.in_dll, self._lib)
        return ChunkCounts(get("kvt_stack_reused").value, get("kvt_stack_passed").value)


def _build() -> Path:
    cc = compiler("CC", ("gcc", "cc"))
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + version(cc).encode()).hexdigest()[:16]
    return publish(cache_root() / "stack_chunks" / key / "libkvtier_stack.so",
                   lambda work, out: run([cc, *_FLAGS, str(_SOURCE), "-o", str(out)], _BUILD_TIMEOUT_S))


def _unsupported() -> str | None:
    if sys.implementation.name != "cpython" or sys.version_info < (3, 11):
        return f"{sys.implementation.name} {sys.version.split()[0]} has no chunked frame stack"
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return "a free-threaded build (the cache relies on the GIL)"
    return None


@functools.cache
def install() -> ChunkCache | None:
    """Installs the cache once per process; None (and one log line saying why) where it is not."""
    choice = os.environ.get(ENV, "on")
    if choice not in ("on", "off"):
        raise ValueError(f"{ENV}={choice!r}: use 'on' (the default) or 'off'")
    why = f"{ENV}=off" if choice == "off" else _unsupported()
    if why is None:
        try:
            lib = open_library(_build(), "kvt_stack_abi", _ABI)
        except BuildError as e:
            why = str(e)
    if why is not None:
        log.info("Python frame-stack chunks: CPython's allocator (%s)", why)
        return None
    api = ctypes.pythonapi  # a PyDLL: these calls hold the GIL, so no frame is pushed meanwhile
    api.PyObject_GetArenaAllocator.argtypes = api.PyObject_SetArenaAllocator.argtypes = [ctypes.POINTER(_Arena)]
    api.PyObject_GetArenaAllocator(ctypes.byref(_Arena.in_dll(lib, "kvt_stack_prev")))
    lib.kvt_stack_init()
    api.PyObject_SetArenaAllocator(ctypes.byref(_Arena.in_dll(lib, "kvt_stack_ours")))
    log.info("Python frame-stack chunks: cached (a loop crossing a chunk's edge no longer maps one per call)")
    return ChunkCache(lib)
