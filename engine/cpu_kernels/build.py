"""Builds the CPU kernels with the system C++ compiler, once per sources, compiler and CPU.

The library is cached under `$KVTIER_CACHE_DIR/cpu_kernels/<key>/`, where the key hashes the
source, the flags, the compiler's version and the CPU's feature flags (the code is built for this
CPU with -march=native, so a cache shared between machines must not mix them). It is written to a
temporary name and renamed, so concurrent builds (test workers, serve + extract) are safe.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvstore.cache_dir import cache_root

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
FLAGS = ("-fopenmp", "-fPIC", "-std=c++17", "-fno-math-errno")
OPT = "-O3"
MARCH = "native"  # tests also build for a baseline x86-64 and for AVX2 to cover vec16.h's other paths
# Per-source flags: the elementwise ops must round like torch's (no fused multiply-adds).
SOURCES = {_HERE / "paged_attention.cpp": (), _HERE / "prefill_attention.cpp": (),
           _HERE / "elementwise.cpp": ("-ffp-contract=off",)}
ABI_VERSION = 7
BUILD_TIMEOUT_S = 120


class BuildError(RuntimeError):
    """The kernels could not be built or loaded here; the message says why."""


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise BuildError("no C++ compiler found (set CXX, or install g++)")
    return cxx


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
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{cxx} --version failed: {e}") from e
    h = hashlib.sha256()
    parts = [src.read_bytes() + " ".join(extra).encode() for src, extra in SOURCES.items()]
    parts += [h.read_bytes() for h in sorted(_HERE.glob("*.h"))]
    for part in (*parts, " ".join(_flags(march, opt)).encode(), version.encode(), _cpu_flags().encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def build(march: str = MARCH, opt: str = OPT) -> Path:
    """Path of the built library, compiling it if this machine has not yet. `opt` other than -O3
    only for tests: the kernels' results do not depend on it (no fast-math, no contraction under
    -std=c++17), and -O3 takes ~100 s over the portable code's lane loops."""
    cxx = _compiler()
    out_dir = cache_root() / "cpu_kernels" / _key(cxx, march, opt)
    lib = out_dir / "libkvtier_cpu.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=out_dir, prefix=".build-"))
    try:
        objects = []
        for src, extra in SOURCES.items():
            obj = work / (src.stem + ".o")
            _run([cxx, *_flags(march, opt), *extra, "-c", str(src), "-o", str(obj)])
            objects.append(str(obj))
        tmp = work / lib.name
        _run([cxx, *_flags(march, opt), "-shared", *objects, "-o", str(tmp)])
        os.replace(tmp, lib)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lib


def _run(cmd: list[str]) -> None:
    log.info("building the CPU kernels: %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{' '.join(cmd)} failed: {e}") from e
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")


def load(march: str = MARCH, opt: str = OPT) -> ctypes.CDLL:
    """Builds if needed and loads the library; raises `BuildError` with the reason otherwise."""
    import torch  # noqa: F401  (torch's libgomp must be loaded first: the kernel then shares its pool)

    path = build(march, opt)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise BuildError(f"cannot load {path}: {e}") from e
    lib.kvt_abi_version.restype = ctypes.c_int
    if lib.kvt_abi_version() != ABI_VERSION:
        raise BuildError(f"{path} has ABI {lib.kvt_abi_version()}, expected {ABI_VERSION}")
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.kvt_paged_attention.restype = c_int
    lib.kvt_paged_attention.argtypes = [c_int, ptr, i64, ptr, ptr, i64, i64, ptr, i64, ptr, ptr, i64, ptr, i64,
                                        c_int, c_int, c_int, c_int, ctypes.c_float, i64, c_int]
    lib.kvt_prefill_attention.restype = c_int
    lib.kvt_prefill_attention.argtypes = [c_int, ptr, i64, ptr, ptr, i64, i64, ptr, i64, ptr, i64, ptr, i64, c_int,
                                          c_int, c_int, c_int, ctypes.c_float, i64, c_int]
    lib.kvt_rms_norm_apply.restype = None
    lib.kvt_rms_norm_apply.argtypes = [c_int, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, c_int]
    lib.kvt_rope.restype = None
    lib.kvt_rope.argtypes = [c_int, ptr, i64, ptr, ptr, i64, c_int, c_int, c_int]
    return lib

