"""The processes benchmarks/fleet.py measures, built from tests/remote's helpers (redis_procs,
router_procs): a Redis Cluster as the shared G4, `kvtier serve` replicas and vllm-router in front of
them; and what the replicas' request logs say about where each request ran.

Import after putting tests/ and tests/remote on sys.path (fleet.py does)."""
from __future__ import annotations

import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis_procs import CLI, SERVER, RedisProc, start_cluster
from router_procs import ROUTER, Replica, Router, start_replica, start_router

__all__ = ["CLI", "ROUTER", "SERVER", "Cluster", "Replica", "Router", "ServedRequest", "decisions",
           "served_requests", "start_fleet_cluster", "start_replicas", "start_router", "stop_all",
           "wait_finished"]

# --enable-log-requests --log-prompts lines (server/request_log.py)
RECEIVED = re.compile(r"Received request (\S+): prompt_tokens=\d+, params: .*prompt_token_ids: \[([0-9, ]*)\]")
FINISHED = re.compile(r"Finished request (\S+): prompt_tokens=(\d+) cached_tokens=(\d+) \(([^)]*)\) "
                      r"output_tokens=(\d+)")
# vllm-router's kv_aware, at --log-level debug (0.1.17: policies/kv_aware.rs)
DECISION = re.compile(r"KV prefix decision outcome=\"?([\w-]+)\"? .*?input_tokens=(\d+) new_prefill_tokens=(\d+) "
                      r"credited_prefix_tokens=(\d+)")


# -- G4 ---------------------------------------------------------------------------------------
@dataclass
class Cluster:
    nodes: list[RedisProc]
    tmp: tempfile.TemporaryDirectory[str]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def flush(self) -> None:
        """Empty G4 between runs, so that a run starts cold: FLUSHALL on every master (each holds
        its own slots; one FLUSHALL through a cluster client reaches one node only)."""
        for n in self.nodes:
            n.cli("FLUSHALL")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        self.tmp.cleanup()


def start_fleet_cluster(n: int = 3) -> Cluster:
    """n masters in a fresh directory (a leftover nodes.conf would make `--cluster create` refuse)."""
    tmp = tempfile.TemporaryDirectory(prefix="kvtier-fleet-bench-redis-")
    try:
        return Cluster(start_cluster(Path(tmp.name), n), tmp)
    except BaseException:  # start_cluster stops the nodes it started
        tmp.cleanup()
        raise


# -- replicas and router -------------------------------------------------------------------------
def start_replicas(model: Path, n: int, args: list[str]) -> list[Replica]:
    """n `kvtier serve` replicas (KV events and per-request logs on), started side by side: the start
    is mostly imports and weight loading, a minute of a 2-core machine's time per fleet otherwise."""
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(start_replica, model, *args, "--enable-log-requests", "--log-prompts")
                   for _ in range(n)]
    started, errors = [], []
    for f in futures:
        try:
            started.append(f.result())
        except RuntimeError as e:  # start_replica/launch: exited, timed out, or no events endpoint
            errors.append(e)
    if errors:
        stop_all(started, None)
        raise errors[0]
    return started


def stop_all(replicas: list[Replica], router: Router | None) -> None:
    if router is not None:
        router.stop()
    for r in replicas:
        r.stop()  # SIGTERM: drains and flushes its queued G4 writes before exiting


# -- what the logs say -----------------------------------------------------------------------------
@dataclass
class ServedRequest:
    replica: int
    prompt: tuple[int, ...]
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    finished: bool = False


def served_requests(replicas: list[Replica], marks: list[int]) -> list[ServedRequest]:
    """Every request each replica received after `marks[i]` lines of its output, with what it
    finished with: which replica ran a prompt, and what each tier served of it. (The response ids
    a client sees are not the engine's request ids, and a body field to carry one would blind the
    router: see fleet.py.)"""
    out: list[ServedRequest] = []
    for i, (rep, mark) in enumerate(zip(replicas, marks)):
        by_id: dict[str, ServedRequest] = {}
        for line in rep.lines[mark:]:
            if m := RECEIVED.search(line):
                ids = tuple(int(t) for t in m.group(2).split(",") if t.strip())
                by_id[m.group(1)] = ServedRequest(i, ids)
            elif (m := FINISHED.search(line)) and m.group(1) in by_id:
                r = by_id[m.group(1)]
                r.prompt_tokens, r.cached_tokens, r.output_tokens = int(m.group(2)), int(m.group(3)), int(m.group(5))
                r.cached_by_tier = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(4))}
                r.finished = True
        out.extend(by_id.values())
    return out


def wait_finished(replicas: list[Replica], marks: list[int], expected: int, timeout: float = 10) -> list[ServedRequest]:
    """The finished lines are logged as the last chunk goes out: give the log readers a moment."""
    deadline = time.monotonic() + timeout
    while True:
        served = served_requests(replicas, marks)
        if sum(r.finished for r in served) >= expected or time.monotonic() > deadline:
            return served
        time.sleep(0.2)


def decisions(router: Router) -> dict[str, Any]:
    """kv_aware's routing decisions (its debug log): how many credited a cached prefix, and how much."""
    found = [DECISION.search(line) for line in router.log().splitlines()]  # log(): without the ANSI colours
    rows = [(m.group(1), int(m.group(2)), int(m.group(4))) for m in found if m]
    return {"decisions": len(rows), "credited": sum(1 for _, _, c in rows if c > 0),
            "credited_tokens": sum(c for _, _, c in rows), "input_tokens": sum(n for _, n, _ in rows),
            "outcomes": sorted({o for o, _, _ in rows})}
