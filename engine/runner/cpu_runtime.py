"""Process set-up for CPU serving: a faster malloc, and a start-up line saying what runs.

glibc's malloc returns large blocks to the kernel on free, so the activations a step allocates
fault their pages in again every step; tcmalloc keeps them. Like vLLM's CPU build, `kvtier`
preloads it when the system has it (Debian: `libtcmalloc-minimal4`). `LD_PRELOAD` only
works at exec time, so the CLI re-executes itself once with it set (`reexec_env`); the engine logs
what it runs with (`describe`). `KVTIER_MALLOC=system` keeps glibc; `KVTIER_MALLOC=/path/lib.so`
names the library.

Threads are not bound to cores by default (vLLM's CPU build binds them): with OpenMP binding the
main thread is pinned to the first core, and every thread it starts afterwards (KV transfers,
tokenizer pool, HTTP server) inherits that one core. Set `OMP_PROC_BIND`/`OMP_PLACES` to bind anyway.
"""
from __future__ import annotations

import ctypes.util
import functools
import os
from dataclasses import dataclass
from pathlib import Path

MALLOC_ENV = "KVTIER_MALLOC"
_DONE_ENV = "_KVTIER_REEXECED"  # set in the re-executed process so it never loops
# Not jemalloc: preloaded here it made 2k-token prefills 17% slower than glibc (tcmalloc: equal on
# prefill, 19% faster on a batch-64 decode step). KVTIER_MALLOC=/path/libjemalloc.so.2 still works.
_CANDIDATES = ("tcmalloc_minimal", "tcmalloc")
_MARKERS = ("libtcmalloc", "libjemalloc")


def find_allocator(env: dict[str, str]) -> str | None:
    """The allocator library to preload (a path or a soname the loader finds), or None."""
    choice = env.get(MALLOC_ENV, "")
    if choice == "system":
        return None
    if choice:
        if not Path(choice).is_file():
            raise ValueError(f"{MALLOC_ENV}={choice!r}: no such file (use a library path, or 'system')")
        return choice
    for name in _CANDIDATES:
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def reexec_env(env: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-execute this process with, or None when it should go on as it is:
    already re-executed, an allocator already preloaded, or none chosen/found."""
    if env.get(_DONE_ENV) or any(m in env.get("LD_PRELOAD", "") for m in _MARKERS):
        return None
    lib = find_allocator(env)
    if lib is None:
        return None
    new = dict(env)
    new["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    new[_DONE_ENV] = "1"
    return new


def describe() -> str:
    """One line for the start-up log: the allocator and the thread binding this process runs with."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    alloc = next((line.split()[-1] for line in maps.splitlines() if any(m in line for m in _MARKERS)), None)
    what = f"allocator {'tcmalloc' if 'tcmalloc' in alloc else 'jemalloc'} ({alloc})" if alloc else (
        f"allocator glibc malloc ({'chosen by ' + MALLOC_ENV if os.environ.get(MALLOC_ENV) == 'system' else 'no tcmalloc found: install libtcmalloc-minimal4 for faster CPU decode steps'})")
    bind = os.environ.get("OMP_PROC_BIND")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return f"{what}; OpenMP binding {bind or 'none'}, {len(cpus)} usable cpus"


@dataclass(frozen=True)
class CpuIsa:
    """The vector ISA the CPU offers for the forward, widest first (from /proc/cpuinfo's flags)."""

    amx_bf16: bool  # AMX tiles with bf16 (Sapphire Rapids and later): oneDNN's brgemm AMX kernels
    avx512_bf16: bool  # vdpbf16ps (Cooper Lake, Zen 4)
    avx512: bool
    avx2: bool

    @property
    def name(self) -> str:
        if self.amx_bf16:
            return "AMX-BF16"
        if self.avx512_bf16:
            return "AVX512-BF16"
        return "AVX-512" if self.avx512 else "AVX2" if self.avx2 else "no AVX2"

    @property
    def native_bf16(self) -> bool:
        """bf16 products run in hardware (else oneDNN emulates them through float32)."""
        return self.amx_bf16 or self.avx512_bf16


def parse_isa(flags: set[str]) -> CpuIsa:
    return CpuIsa(amx_bf16={"amx_bf16", "amx_tile"} <= flags, avx512_bf16="avx512_bf16" in flags,
                  avx512="avx512f" in flags, avx2="avx2" in flags)


@functools.cache
def cpu_isa() -> CpuIsa:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return parse_isa(set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return parse_isa(set())
