"""The CLI's allocator preload: which environment it re-executes with, and that a real
`kvtier generate` under it logs the allocator it runs with."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.runner import cpu_runtime


def test_nothing_to_do_without_an_allocator(monkeypatch):
    monkeypatch.setattr(cpu_runtime.ctypes.util, "find_library", lambda name: None)
    assert cpu_runtime.reexec_env({"PATH": "/bin"}) is None


def test_found_allocator_is_preloaded_once(monkeypatch):
    monkeypatch.setattr(cpu_runtime.ctypes.util, "find_library",
                        lambda name: "libtcmalloc_minimal.so.4" if name == "tcmalloc_minimal" else None)
    env = cpu_runtime.reexec_env({"LD_PRELOAD": "libfoo.so"})
    assert env["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:libfoo.so"
    assert cpu_runtime.reexec_env(env) is None  # the re-executed process does not loop
    assert cpu_runtime.reexec_env({"LD_PRELOAD": "/x/libjemalloc.so.2"}) is None  # the user's own choice


def test_explicit_choice(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_runtime.ctypes.util, "find_library", lambda name: "libtcmalloc.so.4")
    assert cpu_runtime.reexec_env({cpu_runtime.MALLOC_ENV: "system"}) is None
    lib = tmp_path / "libmy.so"
    lib.write_bytes(b"")
    assert cpu_runtime.reexec_env({cpu_runtime.MALLOC_ENV: str(lib)})["LD_PRELOAD"] == str(lib)
    with pytest.raises(ValueError, match="no such file"):
        cpu_runtime.reexec_env({cpu_runtime.MALLOC_ENV: str(tmp_path / "missing.so")})


def test_kvtier_generate_logs_its_allocator(ckpt_dir):
    """A real `kvtier generate`: with tcmalloc on the system it runs under it, re-executed; else it
    says glibc and how to get tcmalloc. The log line names what is really mapped into the process."""
    kvtier = Path(sys.executable).with_name("kvtier")
    env = {k: v for k, v in os.environ.items() if k not in (cpu_runtime.MALLOC_ENV, "LD_PRELOAD")}
    proc = subprocess.run([str(kvtier), "generate", str(ckpt_dir("llama")), "--prompt", "hello",
                           "--max-tokens", "2", "--log-level", "info"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stderr.splitlines() if "CPU:" in ln and "allocator" in ln)
    lib = cpu_runtime.find_allocator({})
    if lib:
        assert f"/{lib}" in line or f"({lib})" in line, line
        assert ("allocator tcmalloc" if "tcmalloc" in lib else "allocator jemalloc") in line, line
    else:
        assert "glibc malloc" in line and "libtcmalloc-minimal4" in line, line
