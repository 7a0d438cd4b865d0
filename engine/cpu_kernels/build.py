"""Builds the CPU kernels with the system C++ compiler, once per sources, compiler and CPU.

The library is cached under `$KVTIER_CACHE_DIR/cpu_kernels/<key>/`, where the key hashes the
source, the flags, the compiler's version and the CPU's feature flags (the code is built for this
CPU with -march=native, so a cache shared between machines must not mix them); `kvstore.clib`
publishes it atomically.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from pathlib import Path

from kvstore.cache_dir import cache_root
from kvstore.clib import BuildError, compiler, open_library, publish, run, version  # noqa: F401 (BuildError: this module's API)

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
FLAGS = ("-fopenmp", "-fPIC", "-std=c++17", "-fno-math-errno")
OPT = "-O3"
MARCH = "native"  # tests also build for a baseline x86-64 and for AVX2 to cover vec16.h's other paths
# Per-source flags: the elementwise ops must round like torch's (no fused multiply-adds).
SOURCES = {_HERE / "paged_attention.cpp": (), _HERE / "prefill_attention.cpp": (),
           _HERE / "elementwise.cpp": ("-ffp-contract=off",), _HERE / "linear_amx.cpp": (),
           _HERE / "linear_f32.cpp": ()}
ABI_VERSION = 11
BUILD_TIMEOUT_S = 120


def _compiler() -> str:
    return compiler("CXX", ("g++", "c++"))


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _flags(march: str, opt: str = OPT) -> tuple[str, ...]:
    return (opt, *FLAGS, f"-march={march}")


def _key(cxx: str, march: str, opt: str) -> str:
    h = hashlib.sha256()
    parts = [src.read_bytes() + " ".join(extra).encode() for src, extra in SOURCES.items()]
    parts += [h.read_bytes() for h in sorted(_HERE.glob("*.h"))]
    for part in (*parts, " ".join(_flags(march, opt)).encode(), version(cxx).encode(), _cpu_flags().encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def build(march: str = MARCH, opt: str = OPT) -> Path:
    """Path of the built library, compiling it if this machine has not yet. `opt` other than -O3
    only for tests: the kernels' results do not depend on it (no fast-math, no contraction under
    -std=c++17), and -O3 takes ~100 s over the portable code's lane loops."""
    cxx = _compiler()

    def make(work: Path, out: Path) -> None:
        objects = []
        for src, extra in SOURCES.items():
            obj = work / (src.stem + ".o")
            _run([cxx, *_flags(march, opt), *extra, "-c", str(src), "-o", str(obj)])
            objects.append(str(obj))
        _run([cxx, *_flags(march, opt), "-shared", *objects, "-o", str(out)])

    return publish(cache_root() / "cpu_kernels" / _key(cxx, march, opt) / "libkvtier_cpu.so", make)


def _run(cmd: list[str]) -> None:
    log.info("building the CPU kernels: %s", " ".join(cmd))
    run(cmd, BUILD_TIMEOUT_S)


def load(march: str = MARCH, opt: str = OPT) -> ctypes.CDLL:
    """Builds if needed and loads the library; raises `BuildError` with the reason otherwise."""
    import torch  # noqa: F401  (torch's libgomp must be loaded first: the kernel then shares its pool)

    lib = open_library(build(march, opt), "kvt_abi_version", ABI_VERSION)
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.kvt_paged_attention.restype = c_int
    lib.kvt_paged_attention.argtypes = [c_int, ptr, i64, ptr, ptr, i64, i64, ptr, i64, ptr, ptr, i64, ptr, i64,
                                        c_int, c_int, c_int, c_int, ctypes.c_float, i64, c_int]
    lib.kvt_prefill_attention.restype = c_int
    lib.kvt_prefill_attention.argtypes = [c_int, ptr, i64, ptr, ptr, i64, i64, ptr, i64, ptr, i64, ptr, i64, c_int,
                                          c_int, c_int, c_int, ctypes.c_float, i64, c_int, c_int]
    lib.kvt_prefill_bf16_kind.restype = c_int
    lib.kvt_prefill_bf16_kind.argtypes = []
    lib.kvt_rms_norm_apply.restype = None
    lib.kvt_rms_norm_apply.argtypes = [c_int, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, c_int]
    lib.kvt_linear_amx_ready.restype = c_int
    lib.kvt_linear_amx_ready.argtypes = []
    lib.kvt_linear_pack.restype = c_int
    lib.kvt_linear_pack.argtypes = [ptr, i64, i64, ptr, c_int]
    lib.kvt_linear.restype = c_int
    lib.kvt_linear.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, c_int]
    lib.kvt_linear_silu_mul.restype = c_int
    lib.kvt_linear_silu_mul.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, i64, c_int]
    lib.kvt_linear_f32_ready.restype = c_int
    lib.kvt_linear_f32_ready.argtypes = []
    lib.kvt_linear_f32_pack.restype = c_int
    lib.kvt_linear_f32_pack.argtypes = [ptr, i64, i64, ptr, c_int]
    lib.kvt_linear_f32.restype = c_int
    lib.kvt_linear_f32.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, c_int]
    lib.kvt_rope.restype = None
    lib.kvt_rope.argtypes = [c_int, ptr, i64, ptr, ptr, i64, c_int, c_int, c_int]
    return lib

