"""A fleet on loopback for tests and benchmarks/fleet.py: `kvtier serve` replicas (each publishing
KV events) and `vllm-router` (PyPI) in front of them, all on ports chosen at run time."""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from redis_procs import free_port
from eager_servers import eager_unless_chosen
from server.launch import launch

ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
EVENTS_LINE = re.compile(r"KV events published on (\S+) \(topic .*\), replay on (\S+) ")


@dataclass
class Replica:
    proc: subprocess.Popen
    url: str
    events: str  # the ZMQ endpoint its KV events go to
    replay: str  # where a subscriber that missed batches asks for them again
    lines: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def finished_requests(self) -> int:
        """Requests this replica finished (its /metrics), whatever their finish reason."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return int(sum(float(v) for v in re.findall(r'^kvtier:request_success_total\{[^}]*\} (\S+)', text, re.M)))

    def kv_stats(self) -> dict:
        return httpx.get(self.url + "/v1/kv/stats", timeout=10).json()


def start_replica(model: Path | str, *args: str, env: dict[str, str] | None = None, eager: bool = False) -> Replica:
    """`kvtier serve MODEL ARGS` publishing KV events on a loopback port the OS picks; `eager`: at
    -O 0 unless ARGS choose a level (the tests' replicas: tests/eager_servers.py)."""
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
           "replay_endpoint": "tcp://127.0.0.1:*"}
    # vLLM's metric names too: the router scrapes workers' /metrics for load (seen in its PD mode).
    flags = [str(model), *args, "--kv-events-config", json.dumps(cfg), "--metrics-compat", "vllm"]
    srv = launch(eager_unless_chosen(flags) if eager else flags,
                 {"OMP_NUM_THREADS": "1", **(env or {})}, new_session=True)
    m = next((EVENTS_LINE.search(line) for line in srv.lines if EVENTS_LINE.search(line)), None)
    if m is None:
        srv.proc.kill()
        raise RuntimeError("the replica did not log its KV events endpoint:\n" + "".join(srv.lines)[-3000:])
    return Replica(srv.proc, srv.url, m.group(1), m.group(2), srv.lines)


@dataclass
class Router:
    proc: subprocess.Popen
    url: str
    lines: list[str] = field(default_factory=list)

    def log(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", "".join(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_router(replicas: list[Replica], policy: str, served_model: str, *extra: str,
                 timeout: float = 60) -> Router:
    """`vllm-router` over `replicas` with `policy`. With kv_aware it subscribes to their KV events
    under the model name clients send (its index is keyed by it: another name never matches) and
    tokenizes through the replicas' /v1/completions/render, so it needs no tokenizer files."""
    port = free_port()
    cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
           "--policy", policy, "--worker-urls", *[r.url for r in replicas],
           "--health-check-interval-secs", "1", "--health-failure-threshold", "1", *extra]
    if policy == "kv_aware":
        for r in replicas:
            cmd += ["--kv-event-source", f"{r.url}={r.events}", "--kv-event-replay-source", f"{r.url}={r.replay}"]
        cmd += ["--kv-event-model", served_model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=drain, daemon=True).start()
    router = Router(proc, f"http://127.0.0.1:{port}", lines)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}:\n{router.log()[-3000:]}")
        try:
            if httpx.get(router.url + "/health", timeout=1).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    router.stop()
    raise RuntimeError(f"vllm-router did not answer /health in {timeout:.0f}s:\n{router.log()[-3000:]}")


def stop_all(*procs) -> None:
    """Stops routers first, then replicas and Redis (anything with `stop()`; None skipped)."""
    for p in sorted((p for p in procs if p is not None), key=lambda p: not isinstance(p, Router)):
        p.stop()
