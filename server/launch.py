"""Starting `kvtier serve` as a subprocess and waiting for it (for tests, benchmarks and
scripts). The server prints READY_LINE once it listens; with `--port 0` that line is the only
way to learn the port the OS chose."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_LINE = "kvtier: serving {model} (max_model_len={max_model_len}) on {url}"
READY = re.compile(r"kvtier: serving (\S+) \(max_model_len=(\d+)\) on (https?://\S+)")


@dataclass
class Launched:
    proc: subprocess.Popen
    model: str
    max_model_len: int
    url: str
    lines: list[str] = field(default_factory=list)  # everything it printed so far (kept draining)


def launch(args: list[str], env: dict[str, str] | None = None, timeout: float = 300,
           new_session: bool = False) -> Launched:
    """`kvtier serve ARGS --port 0`; returns once it is serving. Raises RuntimeError with the
    end of its output if it exits first or does not start within `timeout` (it is killed)."""
    cmd = [sys.executable, "-m", "server.cli", "serve", *args, "--port", "0"]
    full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=new_session)
    lines: list[str] = []
    found: list[re.Match[str]] = []
    ready = threading.Event()

    def reader() -> None:  # keeps draining, so the server never blocks on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = READY.search(line)
            if m and not found:
                found.append(m)
                ready.set()
        ready.set()

    threading.Thread(target=reader, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"kvtier serve did not start in {timeout:.0f}s:\n{''.join(lines)[-4000:]}")
    if not found:
        proc.wait(10)
        raise RuntimeError(f"kvtier serve exited with {proc.returncode} before serving:\n{''.join(lines)[-4000:]}")
    m = found[0]
    return Launched(proc, m.group(1), int(m.group(2)), m.group(3), lines)
