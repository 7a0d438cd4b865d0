"""Starts real `kvtier serve` processes for the server tests (a port chosen by the OS, read
back from the server's start-up line) and stops them."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from eager_servers import eager_unless_chosen

from server.launch import launch

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: str
    lines: list[str] = field(default_factory=list)  # everything it printed so far

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return "".join(self.lines)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 120), **kw)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"server did not exit within {timeout}s of {sig!r}:\n{self.log()[-4000:]}")

    def core_pid(self) -> int:
        """The engine-core child process."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True, check=False).stdout.split()
        for pid in out:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmd:
                return int(pid)
        raise AssertionError(f"no engine-core child of {self.proc.pid} among {out}")


def start_server(*args: str, env: dict[str, str] | None = None, timeout: float = START_TIMEOUT_S,
                 compiled: bool = False) -> Server:
    """`kvtier serve ARGS --port 0`; returns once it prints its URL (raises with its log if it exits).
    Eager unless `compiled` or ARGS choose a level (`eager_unless_chosen`)."""
    threads = {"OMP_NUM_THREADS": os.environ.get("KVTIER_TEST_THREADS", "1")}
    srv = launch(list(args) if compiled else eager_unless_chosen(list(args)), {**threads, **(env or {})}, timeout)
    return Server(srv.proc, srv.url, srv.model, srv.lines)


_MANY = """
import json, sys
from server import cli
for i, args in enumerate(json.loads(sys.argv[1])):
    try:
        rc = cli.main(["serve", *args])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    sys.stdout.flush()
    print(f"\\n@@case {i} {rc}", file=sys.stderr, flush=True)
"""


def run_cli_many(cases: list[list[str]], timeout: float = 240) -> list[tuple[int, str]]:
    """`kvtier serve ARGS` for each ARGS, all expected to exit on their own (bad flags), in one
    process so the imports are paid once: (exit code, stderr) per case."""
    r = subprocess.run([sys.executable, "-c", _MANY, json.dumps(cases)], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    parts = re.split(r"\n@@case (\d+) (-?\d+)\n", "\n" + r.stderr)
    out = [(int(parts[i + 2]), parts[i]) for i in range(0, len(parts) - 1, 3)]
    if r.returncode != 0 or len(out) != len(cases):
        raise AssertionError(f"the driver ended early (rc {r.returncode}):\n{r.stderr[-3000:]}")
    return out


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`kvtier serve ARGS` expected to exit on its own (bad flags)."""
    return subprocess.run([sys.executable, "-m", "server.cli", "serve", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
