"""Building and loading kvtier's C and C++ libraries (G3's read loop, the CPU kernels).

Each is compiled with the system compiler on first use and cached under `$KVTIER_CACHE_DIR`, in a
directory named by a hash of everything that shapes the binary; a build goes to a temporary
directory and is renamed into place, so concurrent builders (test workers, serve + extract) each
publish a whole library.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path


class BuildError(RuntimeError):
    """A library could not be built or loaded here; the message says why."""


def compiler(env: str, names: tuple[str, ...]) -> str:
    """`$env`, else the first of `names` on PATH."""
    found = os.environ.get(env) or next((p for n in names if (p := shutil.which(n))), None)
    if not found:
        raise BuildError(f"no compiler found (set {env}, or install {names[0]})")
    return found


def version(cc: str) -> str:
    """`cc --version`'s output: part of every cache key, so an upgraded compiler rebuilds."""
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{cc} --version failed: {e}") from e


def run(cmd: list[str], timeout_s: float) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{' '.join(cmd)} failed: {e}") from e
    if proc.returncode != 0:
        raise BuildError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")


def publish(lib: Path, make: Callable[[Path, Path], None]) -> Path:
    """`lib`, made by `make(work_dir, output)` in a temporary directory beside it unless it exists."""
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=lib.parent, prefix=".build-"))
    try:
        make(work, work / lib.name)
        os.replace(work / lib.name, lib)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lib


def open_library(path: Path, abi_symbol: str, abi: int) -> ctypes.CDLL:
    """The library at `path`, whose `int abi_symbol(void)` must return `abi`."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise BuildError(f"cannot load {path}: {e}") from e
    fn = getattr(lib, abi_symbol)
    fn.restype = ctypes.c_int
    if fn() != abi:
        raise BuildError(f"{path} has ABI {fn()}, expected {abi}")
    return lib
