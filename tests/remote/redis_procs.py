"""Real `redis-server` (or `valkey-server`) processes for the G4 tests, on loopback ports
chosen at run time, each in its own temp directory."""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

SERVER = shutil.which("valkey-server") or shutil.which("redis-server")
CLI = shutil.which("valkey-cli") or shutil.which("redis-cli")


def free_port(bus: bool = False) -> int:
    """A free loopback port; with bus=True one whose cluster bus port (port + 10000) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not bus:
            return port
        if port + 10000 <= 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    continue


@dataclass
class RedisProc:
    workdir: Path
    port: int
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10) -> "RedisProc":
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), "--daemonize", "no", "--maxmemory-policy", "allkeys-lru", *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{SERVER} exited with {self.proc.returncode}") from None
                time.sleep(0.05)
        raise RuntimeError(f"{SERVER} did not listen on {self.port} within {timeout}s")

    def cli(self, *args: str) -> str:
        auth = []
        if "--requirepass" in self.extra:
            auth = ["-a", self.extra[self.extra.index("--requirepass") + 1], "--no-auth-warning"]
        return subprocess.run([CLI, "-p", str(self.port), *auth, *args], capture_output=True, text=True,
                              timeout=30, check=True).stdout

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def start_cluster(workdir: Path, n: int = 3) -> list[RedisProc]:
    """n masters, no replicas, every slot assigned (redis-cli --cluster create)."""
    nodes: list[RedisProc] = []
    try:
        for i in range(n):
            r = RedisProc(workdir / f"node{i}", free_port(bus=True),
                          ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                           "--cluster-node-timeout", "2000"))
            nodes.append(r.start())
        addrs = [f"127.0.0.1:{r.port}" for r in nodes]
        subprocess.run([CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
                       capture_output=True, text=True, timeout=60, check=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in r.cli("cluster", "info") for r in nodes):
                return nodes
            time.sleep(0.2)
        raise RuntimeError("cluster did not reach cluster_state:ok")
    except BaseException:
        for r in nodes:  # the caller gets no handle on them: stop them here
            r.stop()
        raise
