"""A fault campaign you can rerun: one `kvtier serve` with G2, G3 and G4 (a redis-server this
script starts) replays a Mooncake trace slice for --minutes while a chaos thread injects faults,
and every request's greedy output is compared, token for token, with the output of the same
request on a clean server (no offload, no prefix caching: every token recomputed).

Workload: benchmarks/serve.py's (its functions are imported, not copied): the trace slice
(--start, --num-requests) scaled by --scale, token ids per hash id, prompts sent as token ids to
/v1/completions with temperature 0, ignore_eos and return_token_ids; max_tokens from the trace's
output_length * --output-scale, clamped to [--min-output, --max-output]. The slice is replayed
over and over, in trace order, --concurrency requests in flight (closed loop). Pass p uses the
cache_salt of tenant p % --tenants, so a tenant's second pass finds its prefixes in whichever
tier kept them. The sizes make every tier matter: by default (--scale 1/64) one tenant's distinct
blocks take 364 MiB of float32 KV; G1 holds two of the longest requests, G2 (0.25 GiB) about 70%
of one tenant, G3 (0.5 GiB) about 70% of both, Redis (2 GiB) all of them.

Oracle: each distinct request of the slice once, on a clean `kvtier serve` with the same G1
flags plus --no-enable-prefix-caching and no offload, with the top-2 logprobs of every output
token (their margin tells a near tie from damage when an output differs). Cached in
benchmarks/results/soak-oracle-<key>.json, the key covering the workload, the flags, the model
files and the source of engine/, server/, kvstore/, connectors/ and policies/. Computing it takes
1.5-4.5 minutes on 2 cores, before the --minutes of chaos.

Faults, one at a time, --fault-interval seconds apart on average (exponential; the kinds come
in shuffled rounds so that each kind occurs once before any occurs twice):
  core_kill   SIGKILL the engine core (the server process's child running multiprocessing's
              spawn_main); the server is expected to exit with code 1 (else, after
              --exit-timeout s, it is killed and that is recorded as a finding); it is restarted
              with the same G3 directory and Redis. Recovery = kill -> first successful response.
  redis_stop  SIGSTOP Redis for --redis-stop-s, then SIGCONT.
  redis_kill  SIGKILL Redis, --redis-down-s later a new one on the same port (empty).
  g3_readonly the G3 directory read-only for --g3-fault-s: a read-only bind mount over it
              (EROFS, even for root); without mount rights: chmod 0500 (non-root) or chattr +i
              (root); otherwise skipped, and the JSON says which.
  g3_full     the G3 filesystem full for --g3-fault-s: G3 lives on a tmpfs this script mounts
              (--g3-gib + 128 MiB) and a filler file takes all its free space (ENOSPC); without a
              tmpfs, RLIMIT_FSIZE 0 on the engine core (prlimit; writes fail with EFBIG).
  g3_flip     one random byte XOR a random non-zero value in each of --flip-files random G3
              .kvb files (header or payload, wherever the offset falls).
For Redis and G3 faults, recovery = fault cleared -> the tier works again (G4: breaker closed and
a G4 hit or write; G3: a G3 write), polled every second for at most --recovery-timeout s.

Counting: a request fails (by cause: connection refused/dropped, timeout, HTTP status, finish
reason) or completes; a completed request whose tokens differ from the oracle's is wrong.
Retry policy: none. Corrupt entries detected = the corrupt counters of G2, G3 and G4 in
/v1/kv/stats, summed over server restarts. Corrupt entries served = wrong outputs of requests
that had lower-tier hits: a request "had" them if it reported cached tokens and the G2+G3+G4
hit counters rose between /v1/kv/stats taken just before it was sent and just after it ended
(with concurrency > 1 this over-attributes, which only makes the count stricter). Hit rate per
tier: /v1/kv/stats every --sample-interval s (and around every request), per-minute deltas of
each tier's hit tokens over the prompt tokens. A failed request is charged to the fault whose
window (start -> recovered or cleared, + 5 s) it overlaps; failures outside every window, a server
that does not exit after its core died, an exit code other than 1, a failed restart, and corrupt
entries found before any byte was flipped (beyond the temp files of writes a killed core left,
which G3 counts as corrupt too; the server log tells them apart) are reported as findings.

Prints three tables (summary, faults, per minute), writes them with every request, fault and
sample to --out, and the servers' logs beside it (.log). Exit code 1 when any output is wrong
or any corrupt entry was served (or the run was interrupted, or no server could be restarted).
Needs root (or mount rights) for the bind mount and the tmpfs; falls back as described otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import math
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))
sys.path.append(str(_HERE))
sys.path.append(str(_HERE.parent / "tests" / "remote"))  # redis_procs: the G4 tests' redis-server helper

from _common import REPO_ROOT, RESULTS_DIR, format_table, log, usable_cpus, write_json  # noqa: E402
from redis_procs import SERVER as REDIS_SERVER  # noqa: E402
from redis_procs import RedisProc, free_port  # noqa: E402
from serve import TRACE, Req, Server, build_workload, load_trace, start_server  # noqa: E402

FAULT_KINDS = ("core_kill", "redis_stop", "redis_kill", "g3_readonly", "g3_full", "g3_flip")
LOWER_TIERS = ("G2", "G3", "G4")
# Counters summed over server restarts (every other field of /v1/kv/stats is a gauge).
CUM_KEYS = ("prompt_tokens", "G1.hit_tokens", "G1.queries", "offload.load_failures",
            *(f"{t}.{k}" for t in LOWER_TIERS for k in ("hit_tokens", "miss_tokens", "corrupt")),
            "G3.write_errors", "G3.bytes_written", "G3.evictions",
            "G4.outages", "G4.failed_writes", "G4.dropped_writes", "G4.written_blocks", "G4.hits", "G4.write_errors")
SOURCE_DIRS = ("engine", "server", "kvstore", "connectors", "policies")
try:  # only to tell header flips from payload flips in the report
    from kvstore.disk import HEADER_SIZE
except ImportError:
    HEADER_SIZE = None


# -- /v1/kv/stats --------------------------------------------------------------------------------
def flatten(st: dict[str, Any]) -> dict[str, Any]:
    """The counters of one /v1/kv/stats answer as "TIER.name" -> number (plus G4.breaker)."""
    t = st["tiers"]
    out: dict[str, Any] = {"prompt_tokens": st["requests"]["prompt_tokens"],
                           "G1.hit_tokens": t["G1"]["prefix_cache_hits"], "G1.queries": t["G1"]["prefix_cache_queries"],
                           "offload.load_failures": (st.get("offload") or {}).get("load_failures", 0)}
    for tier in LOWER_TIERS:
        for k, v in (t.get(tier) or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{tier}.{k}"] = v
    if "G4" in t:
        out["G4.breaker"] = t["G4"].get("breaker")
    return out


def lower_hits(flat: dict[str, Any]) -> int:
    return sum(flat.get(f"{t}.hit_tokens", 0) for t in LOWER_TIERS)


class Counters:
    """Cumulative counters over server restarts: each incarnation's last values are folded into
    a base when the next incarnation's first sample arrives. Samples come from several threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.base: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.inc = -1
        self.series: list[tuple[float, int, dict[str, float], str | None]] = []  # (t, incarnation, cum, breaker)

    def add(self, t: float, inc: int, flat: dict[str, Any]) -> None:
        with self.lock:
            if inc < self.inc:
                return  # a late answer from a server that is gone
            if inc > self.inc:
                for k, v in self.last.items():
                    self.base[k] = self.base.get(k, 0) + v
                self.last, self.inc = {}, inc
            for k in CUM_KEYS:
                if k in flat:
                    self.last[k] = max(self.last.get(k, 0), flat[k])
            cum = {k: self.base.get(k, 0) + self.last.get(k, 0) for k in CUM_KEYS}
            self.series.append((t, inc, cum, flat.get("G4.breaker")))
            self.series.sort(key=lambda s: s[0])  # nearly sorted: cheap

    def at(self, t: float) -> dict[str, float]:
        """Cumulative counters as of the last sample taken at or before `t`."""
        with self.lock:
            best: dict[str, float] = {k: 0 for k in CUM_KEYS}
            for ts, _, cum, _ in self.series:
                if ts > t:
                    break
                best = cum
            return best

    def now(self) -> tuple[dict[str, float], str | None]:
        with self.lock:
            if not self.series:
                return {k: 0 for k in CUM_KEYS}, None
            return self.series[-1][2], self.series[-1][3]


# -- processes -----------------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    """Child pids of `pid` from /proc (every thread's children file)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def find_core_pid(server_pid: int) -> int | None:
    """The engine core: the server's child started by multiprocessing's spawn (not its resource tracker)."""
    for c in children(server_pid):
        try:
            cmd = Path(f"/proc/{c}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            return c
    return None


def run_cmd(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def try_mount_tmpfs(path: Path, mib: int) -> str | None:
    """Mount a tmpfs of `mib` MiB at `path`; None on success, else why not."""
    if shutil.which("mount") is None:
        return "no mount command"
    r = run_cmd("mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs", str(path))
    return None if r.returncode == 0 else (r.stderr.strip() or f"mount exited {r.returncode}")


def unmount(path: Path, every: bool = True) -> None:
    """Unmount the top mount at `path` (with `every`, each mount stacked there); a busy one lazily."""
    for _ in range(5):
        if not os.path.ismount(path):
            return
        if run_cmd("umount", str(path)).returncode != 0:
            time.sleep(0.2)
            if run_cmd("umount", str(path)).returncode != 0:
                run_cmd("umount", "-l", str(path))
        if not every:
            return


# -- faults --------------------------------------------------------------------------------------
@dataclass
class Fault:
    id: int
    kind: str
    t_start: float
    method: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    t_clear: float | None = None  # the fault was undone (or, for core_kill, the new server was ready)
    recovery_s: float | None = None  # see the module docstring, per kind
    recovery_what: str = ""
    effect: dict[str, float] = field(default_factory=dict)  # counter deltas until the next fault
    failed_requests: int = 0
    first_ok_after_s: float | None = None  # fault start -> first success of a request sent after it
    notes: list[str] = field(default_factory=list)
    skipped: bool = False


class Soak:
    def __init__(self, args: argparse.Namespace, server_args: list[str], wl_reqs: list[Req],
                 oracle: dict[int, dict[str, Any]], g3_root: Path, g3_tmpfs: bool, redis: RedisProc) -> None:
        self.args, self.server_args, self.reqs, self.oracle = args, server_args, wl_reqs, oracle
        self.g3_root, self.g3_tmpfs, self.redis = g3_root, g3_tmpfs, redis
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.up = threading.Event()
        self.stop = threading.Event()
        self.fatal: str | None = None
        self.server: Server | None = None
        self.url = ""
        self.inc = -1
        self.logs: list[tuple[int, list[str]]] = []  # (incarnation, lines) of every server started
        self.counters = Counters()
        self.records: list[dict[str, Any]] = []
        self.faults: list[Fault] = []
        self.findings: list[dict[str, Any]] = []
        self.undo: list[Any] = []  # callables that undo the fault in force (run on stop, too)
        self.run_id = uuid.uuid4().hex[:8]
        self.euid = os.geteuid()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def finding(self, what: str, **detail: Any) -> None:
        log(f"FINDING at {self.now():.0f}s: {what} {detail if detail else ''}")
        self.findings.append({"t_s": round(self.now(), 1), "finding": what, **detail})

    # -- server --------------------------------------------------------------------------------
    def start_server(self) -> float:
        t = time.monotonic()
        for attempt in (1, 2):
            try:
                srv = start_server(self.server_args, self.args.threads, self.args.start_timeout)
                break
            except RuntimeError as e:
                self.finding("kvtier serve failed to start", attempt=attempt, error=str(e)[-2000:])
                if attempt == 2:
                    raise
        with self.lock:
            self.server, self.url, self.inc = srv, srv.url, self.inc + 1
            self.logs.append((self.inc, srv.lines))
        self.up.set()
        return time.monotonic() - t

    def sample(self, timeout: float = 5.0) -> dict[str, Any] | None:
        import httpx

        with self.lock:
            url, inc = self.url, self.inc
        if not url:
            return None
        try:
            r = httpx.get(url + "/v1/kv/stats", timeout=timeout)
            if r.status_code != 200:
                return None
            flat = flatten(r.json())
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        self.counters.add(self.now(), inc, flat)
        return flat

    def sampler(self) -> None:
        while not self.stop.wait(self.args.sample_interval):
            self.sample()

    # -- requests ------------------------------------------------------------------------------
    async def worker(self, client: Any, seq: Any, deadline: float) -> None:
        import httpx

        async def stats(url: str, inc: int) -> dict[str, Any] | None:
            try:
                r = await client.get(url + "/v1/kv/stats", timeout=5)
                if r.status_code == 200:
                    flat = flatten(r.json())
                    self.counters.add(self.now(), inc, flat)
                    return flat
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            return None

        while self.now() < deadline and not self.stop.is_set():
            if not self.up.is_set():
                await asyncio.sleep(0.2)
                continue
            n = next(seq)
            p, i = divmod(n, len(self.reqs))
            req = self.reqs[i]
            with self.lock:
                url, inc = self.url, self.inc
            tenant = p % self.args.tenants
            body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "cache_salt": f"soak-{self.run_id}-tenant{tenant}"}
            rec: dict[str, Any] = {"n": n, "pass": p, "idx": i, "tenant": tenant, "inc": inc, "ok": False,
                                   "cause": None, "wrong": False}
            before = await stats(url, inc)
            rec["sent"] = self.now()
            try:
                r = await client.post(url + "/v1/completions", json=body, timeout=self.args.request_timeout)
                if r.status_code != 200:
                    rec["cause"] = f"HTTP {r.status_code}"
                    rec["msg"] = r.text[:300]
                else:
                    out = r.json()
                    ch = out["choices"][0]
                    toks, fr = ch.get("token_ids"), ch.get("finish_reason")
                    rec["cached"] = out.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens")
                    if fr != "length" or toks is None or len(toks) != req.max_tokens:
                        rec["cause"] = f"finish_reason {fr}"
                        rec["msg"] = f"{len(toks or [])} of {req.max_tokens} tokens"
                    else:
                        rec["ok"] = True
                        want = self.oracle[i]["token_ids"]
                        if toks != want:
                            j = next(k for k, (a, b) in enumerate(zip(toks, want)) if a != b)
                            margins = self.oracle[i].get("margins") or []
                            rec.update(wrong=True, diverge_at=j, got=toks, want=want,
                                       oracle_margin=margins[j] if j < len(margins) else None)
            except httpx.ConnectError as e:
                rec["cause"], rec["msg"] = "connection refused", str(e)[:200]
            except httpx.TimeoutException as e:
                rec["cause"], rec["msg"] = "timeout", type(e).__name__
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                rec["cause"], rec["msg"] = "connection dropped", f"{type(e).__name__}: {str(e)[:200]}"
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                rec["cause"], rec["msg"] = f"bad response ({type(e).__name__})", str(e)[:200]
            rec["done"] = self.now()
            after = await stats(url, inc) if rec["ok"] else None
            if before is not None and after is not None:
                rec["lower_hit_tokens_window"] = lower_hits(after) - lower_hits(before)
            self.records.append(rec)
            if rec["wrong"]:
                log(f"WRONG output: trace line {req.index} (slice #{i}, pass {p}) diverges at token "
                    f"{rec['diverge_at']} (oracle top-2 margin {rec['oracle_margin']}); lower-tier hits in its window: "
                    f"{rec.get('lower_hit_tokens_window')}")
            if not rec["ok"]:
                await asyncio.sleep(1.0)  # no retry, but no spinning on a server that is going down either

    async def progress(self, deadline: float) -> None:
        last_t, last = 0.0, self.counters.at(0)
        while self.now() < deadline and not self.stop.is_set():
            await asyncio.sleep(min(self.args.progress_interval, max(deadline - self.now(), 0.1)))
            t = self.now()
            cum, breaker = self.counters.now()
            recs = list(self.records)
            d = {k: cum[k] - last.get(k, 0) for k in cum}
            pt = d["prompt_tokens"] or 1
            rates = " ".join(f"{tier} {d[f'{tier}.hit_tokens'] / pt:.0%}" for tier in ("G1", *LOWER_TIERS))
            log(f"[{t:4.0f}s] done {len(recs)}, ok {sum(r['ok'] for r in recs)}, failed "
                f"{sum(not r['ok'] for r in recs)}, wrong {sum(r['wrong'] for r in recs)}; faults {len(self.faults)}; "
                f"server #{self.inc}{'' if self.up.is_set() else ' (down)'}; last {t - last_t:.0f}s hit: {rates}; "
                f"corrupt so far {sum(cum[f'{x}.corrupt'] for x in LOWER_TIERS):.0f}; G4 breaker {breaker}")
            last_t, last = t, cum

    async def load(self, deadline: float) -> None:
        import httpx

        seq = itertools.count()
        limits = httpx.Limits(max_connections=self.args.concurrency + 4)
        async with httpx.AsyncClient(limits=limits) as client:
            await asyncio.gather(*(self.worker(client, seq, deadline) for _ in range(self.args.concurrency)),
                                 self.progress(deadline))

    # -- chaos ---------------------------------------------------------------------------------
    def chaos(self, deadline: float) -> None:
        rng = random.Random(self.args.seed)
        kinds = list(self.args.faults)
        order: list[str] = []
        t_next = self.args.first_fault + rng.expovariate(1 / self.args.fault_interval)
        while not self.stop.is_set():
            if self.stop.wait(max(t_next - self.now(), 0)):
                break
            if self.now() > deadline - 5:
                break
            if not order:
                order = rng.sample(kinds, len(kinds))
            kind = order.pop(0)
            f = Fault(len(self.faults) + 1, kind, self.now())
            self.faults.append(f)
            log(f"[{f.t_start:4.0f}s] fault #{f.id}: {kind}")
            try:
                getattr(self, f"fault_{kind}")(f, rng)
            except Exception as e:  # noqa: BLE001 - the campaign goes on; the fault says what broke
                f.notes.append(f"error: {type(e).__name__}: {e}")
                log(f"fault #{f.id} {kind} raised {type(e).__name__}: {e}")
                self.run_undo()
                if kind == "core_kill" and not self.up.is_set():
                    self.fatal = f"no server after fault #{f.id}: {e}"
                    self.stop.set()
                    return
            log(f"[{self.now():4.0f}s] fault #{f.id} {kind} done: {f.method}; "
                f"recovery {f.recovery_s if f.recovery_s is None else round(f.recovery_s, 1)} s "
                f"({f.recovery_what}) {'; '.join(f.notes)}")
            t_next = self.now() + max(2.0, rng.expovariate(1 / self.args.fault_interval))

    def run_undo(self) -> None:
        while self.undo:
            fn = self.undo.pop()
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                log(f"undoing a fault failed: {type(e).__name__}: {e}")

    def hold(self, f: Fault, seconds: float) -> None:
        self.stop.wait(seconds)
        self.run_undo()
        f.t_clear = self.now()

    def wait_recovery(self, f: Fault, what: str, ok: Any) -> None:
        """Poll /v1/kv/stats every second until ok(flat, at_clear) or --recovery-timeout."""
        f.recovery_what = what
        at_clear = self.sample() or {}
        t_clear = f.t_clear if f.t_clear is not None else self.now()
        while self.now() - t_clear < self.args.recovery_timeout and not self.stop.is_set():
            flat = self.sample()
            if flat is not None and ok(flat, at_clear):
                f.recovery_s = self.now() - t_clear
                return
            self.stop.wait(1.0)
        f.notes.append(f"not recovered within {self.args.recovery_timeout:.0f} s" if not self.stop.is_set()
                       else "run ended before recovery")

    def fault_core_kill(self, f: Fault, rng: random.Random) -> None:
        import httpx

        srv = self.server
        assert srv is not None
        core = find_core_pid(srv.proc.pid)
        if core is None:
            f.skipped = True
            f.notes.append(f"no engine-core child of server pid {srv.proc.pid}")
            return
        self.sample()  # this incarnation's last counters
        url = srv.url
        f.method = f"SIGKILL core pid {core}"
        f.t_start = self.now()
        os.kill(core, signal.SIGKILL)
        t_kill = time.monotonic()
        health_bad = exited = None
        with httpx.Client() as c:
            while time.monotonic() - t_kill < self.args.exit_timeout:
                if srv.proc.poll() is not None:
                    exited = time.monotonic() - t_kill
                    break
                try:
                    if c.get(url + "/health", timeout=1).status_code != 200 and health_bad is None:
                        health_bad = time.monotonic() - t_kill
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        hung = srv.proc.poll() is None
        if hung:
            self.finding("server did not exit after core death", fault=f.id, waited_s=self.args.exit_timeout,
                         health_non_200_after_s=health_bad)
            os.killpg(srv.proc.pid, signal.SIGKILL)  # its own session: everything it started goes too
            srv.proc.wait(10)
        elif srv.proc.returncode != 1:
            self.finding("server exit code after core death is not 1", fault=f.id, exit_code=srv.proc.returncode)
        self.up.clear()
        f.detail.update(server_exit_code=None if hung else srv.proc.returncode,
                        server_exit_s=None if exited is None else round(exited, 2),
                        health_non_200_s=None if health_bad is None else round(health_bad, 2),
                        server_killed_by_soak=hung)
        if self.stop.is_set():
            return
        f.detail["restart_s"] = round(self.start_server(), 1)
        f.t_clear = self.now()
        f.recovery_what = "kill -> first successful response"  # computed from the requests in report()
        while self.now() - f.t_clear < self.args.recovery_timeout and not self.stop.is_set():
            done = [r["done"] for r in list(self.records) if r["ok"] and r["sent"] >= f.t_start]
            if done:
                f.recovery_s = min(done) - f.t_start
                break  # recovered: the next fault may come
            self.stop.wait(0.5)

    def fault_redis_stop(self, f: Fault, rng: random.Random) -> None:
        f.method = f"SIGSTOP redis {self.args.redis_stop_s:g} s, SIGCONT"
        self.redis.pause()
        self.undo.append(self.redis.resume)
        self.hold(f, self.args.redis_stop_s)
        self.wait_recovery(f, "SIGCONT -> G4 breaker closed and a G4 hit or write", self._g4_ok)

    def fault_redis_kill(self, f: Fault, rng: random.Random) -> None:
        f.method = f"SIGKILL redis, new one on :{self.redis.port} {self.args.redis_down_s:g} s later"
        self.redis.kill()
        self.undo.append(self.redis.start)
        self.hold(f, self.args.redis_down_s)
        self.wait_recovery(f, "restart -> G4 breaker closed and a G4 hit or write", self._g4_ok)

    @staticmethod
    def _g4_ok(flat: dict[str, Any], at_clear: dict[str, Any]) -> bool:
        def used(s: dict[str, Any]) -> float:
            return s.get("G4.hits", 0) + s.get("G4.written_blocks", 0)

        return flat.get("G4.breaker") == "closed" and used(flat) > used(at_clear)

    @staticmethod
    def _g3_ok(flat: dict[str, Any], at_clear: dict[str, Any]) -> bool:
        return flat.get("G3.bytes_written", 0) > at_clear.get("G3.bytes_written", 0)

    def g3_dirs(self) -> list[Path]:
        return [self.g3_root, *(p for p in self.g3_root.rglob("*") if p.is_dir())]

    def fault_g3_readonly(self, f: Fault, rng: random.Random) -> None:
        root = str(self.g3_root)
        r = run_cmd("mount", "--bind", root, root)
        if r.returncode == 0:
            self.undo.append(lambda: unmount(self.g3_root, every=False))  # the bind only, not the tmpfs
            r = run_cmd("mount", "-o", "remount,bind,ro", root)
            if r.returncode != 0:
                self.run_undo()
                f.notes.append(f"remount ro failed: {r.stderr.strip()}")
            else:
                f.method = "read-only bind mount over the G3 dir (EROFS)"
        if not f.method and self.euid != 0:
            dirs = self.g3_dirs()
            modes = {d: d.stat().st_mode & 0o7777 for d in dirs}
            for d in dirs:
                d.chmod(0o500)
            self.undo.append(lambda: [d.chmod(m) for d, m in modes.items() if d.exists()])
            f.method = "chmod 0500 on the G3 dirs (EACCES)"
        if not f.method and shutil.which("chattr"):
            dirs = [str(d) for d in self.g3_dirs()]
            if run_cmd("chattr", "+i", *dirs).returncode == 0:
                self.undo.append(lambda: run_cmd("chattr", "-i", *dirs))
                f.method = "chattr +i on the G3 dirs (EPERM)"
        if not f.method:
            f.skipped = True
            f.notes.append("no way to make the G3 dir read-only here (no mount rights, root, no chattr)")
            return
        f.detail["dirs"] = len(self.g3_dirs())
        self.hold(f, self.args.g3_fault_s)
        self.wait_recovery(f, "writable -> a G3 write", self._g3_ok)

    def fault_g3_full(self, f: Fault, rng: random.Random) -> None:
        if self.g3_tmpfs:
            filler = self.g3_root / "soak-filler.bin"
            self.undo.append(lambda: filler.unlink(missing_ok=True))
            written = 0
            chunk = b"\0" * (1 << 20)
            try:
                with open(filler, "wb") as fh:
                    while True:
                        fh.write(chunk)
                        fh.flush()
                        written += len(chunk)
            except OSError as e:
                f.detail["filler_error"] = e.strerror
            st = os.statvfs(self.g3_root)
            f.detail.update(filler_mib=written >> 20, free_bytes_after=st.f_bavail * st.f_frsize)
            f.method = f"G3 tmpfs filled ({written >> 20} MiB filler, ENOSPC)"
        else:
            srv = self.server
            core = find_core_pid(srv.proc.pid) if srv is not None else None
            if core is None:
                f.skipped = True
                f.notes.append("no engine core to limit")
                return
            soft, hard = resource.prlimit(core, resource.RLIMIT_FSIZE)
            resource.prlimit(core, resource.RLIMIT_FSIZE, (0, hard))
            self.undo.append(lambda: resource.prlimit(core, resource.RLIMIT_FSIZE, (soft, hard)))
            f.method = f"RLIMIT_FSIZE 0 on core pid {core} (EFBIG; no tmpfs to fill)"
        self.hold(f, self.args.g3_fault_s)
        self.wait_recovery(f, "space back -> a G3 write", self._g3_ok)

    def fault_g3_flip(self, f: Fault, rng: random.Random) -> None:
        files = sorted(self.g3_root.rglob("*.kvb"))
        picked = rng.sample(files, min(self.args.flip_files, len(files)))
        flips = []
        for path in picked:
            try:
                with open(path, "r+b") as fh:
                    size = os.fstat(fh.fileno()).st_size
                    if size == 0:
                        continue
                    off = rng.randrange(size)
                    fh.seek(off)
                    old = fh.read(1)[0]
                    new = old ^ rng.randrange(1, 256)
                    fh.seek(off)
                    fh.write(bytes([new]))
                flips.append({"file": path.name, "offset": off, "size": size})
            except (OSError, IndexError):
                continue
        f.method = f"flipped 1 byte in each of {len(flips)} of {len(files)} G3 files"
        f.detail.update(files_flipped=len(flips), g3_files=len(files), flips=flips)
        if HEADER_SIZE is not None:
            f.detail["in_header"] = sum(x["offset"] < HEADER_SIZE for x in flips)
        f.t_clear = self.now()
        f.recovery_what = "n/a"

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> None:
        deadline = self.args.minutes * 60
        log(f"starting the soak server: kvtier serve {' '.join(self.server_args)}")
        self.start_server()
        self.t0 = time.monotonic()  # the clock starts with the first server serving
        self.sample()
        threads = [threading.Thread(target=self.sampler, daemon=True, name="sampler"),
                   threading.Thread(target=self.chaos, args=(deadline,), daemon=True, name="chaos")]
        for t in threads:
            t.start()
        try:
            asyncio.run(self.load(deadline))
        finally:
            self.stop.set()
            for t in threads:
                t.join(self.args.start_timeout + 30)
            self.run_undo()
            self.sample()

    def close(self) -> None:
        self.stop.set()
        self.run_undo()
        if self.server is not None:
            self.server.stop(60)


# -- oracle --------------------------------------------------------------------------------------
def source_digest() -> str:
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        for p in sorted((REPO_ROOT / d).rglob("*.py")):
            h.update(str(p.relative_to(REPO_ROOT)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def model_digest(model_dir: Path) -> str:
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for p in sorted(model_dir.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


async def oracle_outputs(url: str, reqs: list[Req], concurrency: int, timeout: float) -> dict[int, dict[str, Any]]:
    import httpx

    out: dict[int, dict[str, Any]] = {}
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout) as client:
        async def one(i: int, r: Req) -> None:
            async with sem:
                body = {"prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True, "logprobs": 2}
                resp = await client.post(url + "/v1/completions", json=body)
                if resp.status_code != 200:
                    raise RuntimeError(f"oracle request {i}: HTTP {resp.status_code}: {resp.text[:300]}")
                ch = resp.json()["choices"][0]
                toks = ch["token_ids"]
                if len(toks) != r.max_tokens:
                    raise RuntimeError(f"oracle request {i}: {len(toks)} tokens, {r.max_tokens} asked")
                margins = []
                for top in (ch.get("logprobs") or {}).get("top_logprobs") or []:
                    v = sorted(top.values(), reverse=True)
                    margins.append(v[0] - v[1] if len(v) > 1 else None)
                out[i] = {"token_ids": toks, "margins": margins}

        await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
    return out


def get_oracle(args: argparse.Namespace, reqs: list[Req], oracle_args: list[str], key: str) -> tuple[dict, dict]:
    path = RESULTS_DIR / f"soak-oracle-{key[:16]}.json"
    if not args.no_oracle_cache and path.is_file():
        doc = json.loads(path.read_text())
        if doc.get("key") == key:
            log(f"oracle: {len(doc['outputs'])} outputs from {path}")
            return {int(k): v for k, v in doc["outputs"].items()}, {"source": "cache", "path": str(path)}
    log(f"oracle: {len(reqs)} requests on a clean server: kvtier serve {' '.join(oracle_args)}")
    t = time.perf_counter()
    srv = start_server(oracle_args, args.threads, args.start_timeout)
    try:
        outs = asyncio.run(oracle_outputs(srv.url, reqs, args.concurrency, args.request_timeout))
    except BaseException:
        log(f"oracle failed; its server's last lines:\n{srv.tail()}")
        raise
    finally:
        srv.stop()
    secs = time.perf_counter() - t
    log(f"oracle: done in {secs:.0f} s")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "server_args": oracle_args, "outputs": outs}))
    return outs, {"source": "computed", "path": str(path), "seconds": round(secs, 1)}


# -- report --------------------------------------------------------------------------------------
def report(soak: Soak, duration: float) -> tuple[dict[str, Any], str]:
    recs = sorted(soak.records, key=lambda r: r["sent"])
    faults = soak.faults
    # Counter deltas per fault: from its start to the next fault's; a flip's damage is found whenever
    # the entry is read, so its corrupt counts run to the next flip (and no other row shows them).
    ends = [f.t_start for f in faults[1:]] + [duration]
    flip_starts = [f.t_start for f in faults if f.kind == "g3_flip" and not f.skipped]
    corrupt_keys = (*(f"{t}.corrupt" for t in LOWER_TIERS), "offload.load_failures")
    for f, end in zip(faults, ends):
        if f.kind == "g3_flip":
            end = next((t for t in flip_starts if t > f.t_start), duration)
            keys: tuple[str, ...] = corrupt_keys
        else:
            keys = ("G3.write_errors", "G4.outages", "G4.failed_writes", "G4.dropped_writes")
        a, b = soak.counters.at(f.t_start - 1e-6), soak.counters.at(end)
        f.effect = {k: b[k] - a[k] for k in keys if b[k] - a[k]}
        # Only a core kill takes the server down: a response after the next one is not this one's.
        nxt = next((g.t_start for g in faults if g.t_start > f.t_start and g.kind == "core_kill"), math.inf)
        after = [r["done"] for r in recs if r["ok"] and f.t_start <= r["sent"] and r["done"] < nxt]
        if after:
            f.first_ok_after_s = min(after) - f.t_start
            if f.kind == "core_kill":
                f.recovery_s = f.first_ok_after_s
        elif f.kind == "core_kill" and not f.skipped:
            f.notes.append("no successful response before the next core kill" if nxt < math.inf
                           else "no successful response before the end")
        window_end = f.t_start + max(f.recovery_s or 0.0, (f.t_clear or f.t_start) - f.t_start) + 5.0
        f.detail["window_end_s"] = round(window_end, 1)
    for r in recs:
        if r["ok"]:
            continue
        owner = [f for f in faults if r["done"] >= f.t_start and r["sent"] <= f.detail["window_end_s"]]
        r["fault"] = owner[-1].id if owner else None  # the latest fault it overlaps
        if owner:
            owner[-1].failed_requests += 1
    # G3 counts the temp file of a write its killed core left behind as corrupt too (a "bad file").
    log_lines = [line.strip() for _, lines in soak.logs for line in lines
                 if "corrupt" in line.lower() or "bad file" in line.lower()]
    tmp_files = sum("interrupted write" in line for line in log_lines)
    before_flip = soak.counters.at(flip_starts[0] if flip_starts else duration)
    if sum(before_flip[f"{t}.corrupt"] for t in LOWER_TIERS) > tmp_files:
        soak.finding("corrupt entries detected before any byte was flipped (beyond temp files of killed writes)",
                     **{t: before_flip[f"{t}.corrupt"] for t in LOWER_TIERS}, log=log_lines[:5])
    no_fault = [r for r in recs if not r["ok"] and r["fault"] is None]
    if no_fault:
        soak.finding("requests failed outside every fault window", count=len(no_fault),
                     causes=dict(Counter(r["cause"] for r in no_fault)))

    ok = [r for r in recs if r["ok"]]
    wrong = [r for r in ok if r["wrong"]]
    # A wrong output is attributed to a lower tier unless its request provably had no lower-tier hit.
    served = [r for r in wrong if not (r.get("cached") == 0 or r.get("lower_hit_tokens_window") == 0)]
    cum, _ = soak.counters.now()
    corrupt = {t: int(cum[f"{t}.corrupt"]) for t in LOWER_TIERS}
    flips = [f for f in faults if f.kind == "g3_flip"]
    with_lower = sum(1 for r in ok if (r.get("lower_hit_tokens_window") or 0) > 0 and (r.get("cached") or 0) > 0)

    minutes = []
    n_min = max(1, math.ceil(min(duration, soak.args.minutes * 60) / 60 - 1e-9))
    for m in range(n_min):  # the last bucket also takes the requests still in flight at the deadline
        lo, hi = m * 60, (m + 1) * 60 if m < n_min - 1 else max(duration, (m + 1) * 60)
        a, b = soak.counters.at(lo), soak.counters.at(hi)
        pt = b["prompt_tokens"] - a["prompt_tokens"]
        row = {"minute": m + 1, "sent": sum(lo <= r["sent"] < hi for r in recs),
               "ok": sum(lo <= r["done"] < hi and r["ok"] for r in recs),
               "failed": sum(lo <= r["done"] < hi and not r["ok"] for r in recs),
               "wrong": sum(lo <= r["done"] < hi and r["wrong"] for r in recs), "prompt_tokens": int(pt),
               "corrupt_detected": int(sum(b[f"{t}.corrupt"] - a[f"{t}.corrupt"] for t in LOWER_TIERS)),
               "faults": [f"{f.id}:{f.kind}" for f in faults if lo <= f.t_start < hi]}
        for tier in ("G1", *LOWER_TIERS):
            h = b[f"{tier}.hit_tokens"] - a[f"{tier}.hit_tokens"]
            row[f"{tier}_hit_tokens"] = int(h)
            row[f"{tier}_hit_rate"] = h / pt if pt > 0 else None
        minutes.append(row)

    causes = Counter(r["cause"] for r in recs if not r["ok"])
    summary = {
        "duration_s": round(duration, 1), "requests_sent": len(recs), "completed": len(ok),
        "failed": len(recs) - len(ok), "failed_by_cause": dict(causes),
        "failed_by_fault_kind": dict(Counter(next((f.kind for f in faults if f.id == r["fault"]), "none")
                                             for r in recs if not r["ok"])),
        "wrong_outputs": len(wrong), "corrupt_entries_detected": {**corrupt, "total": sum(corrupt.values())},
        "corrupt_log_lines": len(log_lines), "interrupted_write_temp_files_removed": tmp_files,
        "corrupt_entries_served": len(served),
        "completed_with_lower_tier_hits": with_lower,
        "g3_files_flipped": sum(f.detail.get("files_flipped", 0) for f in flips),
        "server_restarts": soak.inc, "faults": dict(Counter(f.kind for f in faults if not f.skipped)),
        "faults_skipped": [f"{f.id}:{f.kind}" for f in faults if f.skipped],
        "recovery_s": {k: [round(f.recovery_s, 1) if f.recovery_s is not None else None
                           for f in faults if f.kind == k and not f.skipped] for k in FAULT_KINDS},
        "findings": soak.findings, "fatal": soak.fatal,
    }

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.0%}"

    cause_s = ", ".join(f"{c} {n}" for c, n in causes.most_common()) or "none"
    rows = [
        ["duration", f"{duration / 60:.1f} min ({soak.args.concurrency} in flight, {soak.args.tenants} tenants)"],
        ["requests sent", len(recs)], ["completed", len(ok)],
        ["failed (no retry)", f"{len(recs) - len(ok)}: {cause_s}"],
        ["wrong outputs (must be 0)", len(wrong)],
        ["completed with lower-tier hits", with_lower],
        ["corrupt entries detected", f"{sum(corrupt.values())} (G2 {corrupt['G2']}, G3 {corrupt['G3']}, "
                                     f"G4 {corrupt['G4']}); {tmp_files} of them temp files of killed writes"],
        ["corrupt entries served (must be 0)", len(served)],
        ["G3 files with a flipped byte", summary["g3_files_flipped"]],
        ["faults", ", ".join(f"{k} {n}" for k, n in summary["faults"].items()) or "none"],
        ["server restarts", soak.inc],
        ["findings", "; ".join(f"{k}{f' (x{n})' if n > 1 else ''}"
                               for k, n in Counter(x["finding"] for x in soak.findings).items()) or "none"],
    ]
    text = [format_table(["soak", "result"], rows), ""]
    frows = []
    for f in faults:
        eff = ", ".join(f"{k} +{v:.0f}" for k, v in f.effect.items())
        if f.kind == "g3_flip":
            eff = f"{eff or 'none'} (until the next flip)"
        frows.append([f.id, round(f.t_start), f.kind, ("SKIPPED: " if f.skipped else "") + f.method,
                      f.failed_requests, None if f.recovery_s is None else round(f.recovery_s, 1),
                      f.recovery_what if f.recovery_s is not None or f.notes == [] else "; ".join(f.notes),
                      eff or "-"])
    if frows:
        text += [format_table(["#", "t s", "fault", "how", "failed", "recovery s", "recovery is",
                               "counters until the next fault"],
                              frows), ""]
    mrows = [[m["minute"], m["sent"], m["ok"], m["failed"], m["wrong"], m["prompt_tokens"],
              pct(m["G1_hit_rate"]), pct(m["G2_hit_rate"]), pct(m["G3_hit_rate"]), pct(m["G4_hit_rate"]),
              m["corrupt_detected"], " ".join(m["faults"]) or "-"] for m in minutes]
    text.append(format_table(["min", "sent", "ok", "failed", "wrong", "prompt tok", "G1 hit", "G2 hit", "G3 hit",
                              "G4 hit", "corrupt", "faults"], mrows))
    doc = {"summary": summary, "faults": [asdict(f) for f in faults], "hit_rate_per_minute": minutes,
           "wrong": [{k: r.get(k) for k in ("n", "pass", "idx", "tenant", "inc", "sent", "diverge_at", "oracle_margin",
                                          "lower_hit_tokens_window", "cached", "got", "want")} for r in wrong],
           "failures": [{k: r.get(k) for k in ("n", "idx", "inc", "sent", "done", "cause", "msg", "fault")}
                        for r in recs if not r["ok"]],
           "requests": [[round(r["sent"], 2), round(r["done"], 2), r["inc"], r["pass"], r["idx"], r["ok"],
                         r["cause"], r["wrong"], r.get("cached"), r.get("lower_hit_tokens_window")] for r in recs],
           "requests_columns": ["sent_s", "done_s", "server", "pass", "idx", "ok", "cause", "wrong", "cached_tokens",
                                "lower_hit_tokens_window"],
           "samples": [[round(t, 2), inc, {k: v for k, v in cum.items() if v}, br]
                       for t, inc, cum, br in soak.counters.series[::max(1, len(soak.counters.series) // 2000)]]}
    return doc, "\n".join(text)


# -- main ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the chaos phase (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the fault schedule, the files flipped and the block token ids (default %(default)s)")
    ap.add_argument("--fault-interval", type=float, default=30.0,
                    help="mean seconds between one fault's end and the next fault (exponential; default %(default)s)")
    ap.add_argument("--first-fault", type=float, default=20.0,
                    help="seconds before the first fault can come, added to the random interval (default %(default)s)")
    ap.add_argument("--faults", default=",".join(FAULT_KINDS),
                    help="comma-separated fault kinds to inject (default: all: %(default)s)")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "soak.json",
                    help="JSON results (default %(default)s); the servers' logs go beside it (.log)")
    ap.add_argument("--trace", type=Path, default=TRACE, help="Mooncake-format JSONL trace (default %(default)s)")
    ap.add_argument("--start", type=int, default=-64,
                    help="first trace request of the slice; negative counts from the end (default %(default)s)")
    ap.add_argument("--num-requests", type=int, default=64, help="requests in the slice (default %(default)s)")
    ap.add_argument("--scale", type=float, default=1 / 64,
                    help="token scale of the trace, as in serve.py (default 1/64: 8-token trace blocks, the longest "
                         "prompt 1k tokens, 25k prompt tokens per pass over the default slice)")
    ap.add_argument("--output-scale", type=float, default=0.1,
                    help="max_tokens = round(output_length * OUTPUT_SCALE), clamped (default %(default)s)")
    ap.add_argument("--min-output", type=int, default=8, help="fewest output tokens per request (default %(default)s)")
    ap.add_argument("--max-output", type=int, default=16, help="most output tokens per request (default %(default)s)")
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight (default %(default)s)")
    ap.add_argument("--tenants", type=int, default=2,
                    help="cache_salts used in turn, one per pass over the slice (default %(default)s)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per G1 block (default %(default)s)")
    ap.add_argument("--num-gpu-blocks", type=int, default=None,
                    help="G1 blocks (default: --concurrency of the longest requests, +25%%, as serve.py)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="step token budget (default %(default)s)")
    ap.add_argument("--g2-gib", type=float, default=0.25, help="G2 size in GiB (default %(default)s)")
    ap.add_argument("--g3-gib", type=float, default=0.5, help="G3 size in GiB (default %(default)s)")
    ap.add_argument("--redis-mib", type=int, default=2048, help="Redis maxmemory in MiB (default %(default)s)")
    ap.add_argument("--g3-dir", type=Path, default=None,
                    help="parent of the G3 directory (default: the system's temp dir)")
    ap.add_argument("--no-tmpfs", action="store_true",
                    help="keep G3 on the parent's filesystem instead of a tmpfs mounted for it; g3_full then "
                         "uses RLIMIT_FSIZE on the engine core")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                    help="dtype of both servers (default %(default)s)")
    ap.add_argument("--threads", type=int, default=usable_cpus(),
                    help="OMP_NUM_THREADS of the servers (default: all usable cores)")
    ap.add_argument("--exit-timeout", type=float, default=10.0,
                    help="seconds the server may take to exit after its core is killed (default %(default)s)")
    ap.add_argument("--redis-stop-s", type=float, default=5.0, help="SIGSTOP length (default %(default)s)")
    ap.add_argument("--redis-down-s", type=float, default=5.0,
                    help="seconds between killing Redis and its restart (default %(default)s)")
    ap.add_argument("--g3-fault-s", type=float, default=15.0,
                    help="seconds G3 stays read-only or full (default %(default)s)")
    ap.add_argument("--flip-files", type=int, default=8, help="G3 files damaged per g3_flip (default %(default)s)")
    ap.add_argument("--recovery-timeout", type=float, default=45.0,
                    help="most seconds to wait for a tier to work again after a fault (default %(default)s)")
    ap.add_argument("--sample-interval", type=float, default=5.0,
                    help="seconds between /v1/kv/stats samples (default %(default)s)")
    ap.add_argument("--progress-interval", type=float, default=30.0,
                    help="seconds between progress lines (default %(default)s)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request (default %(default)s)")
    ap.add_argument("--start-timeout", type=float, default=300.0,
                    help="seconds for a server to start (default %(default)s)")
    ap.add_argument("--no-oracle-cache", action="store_true", help="recompute the oracle even if it is cached")
    ap.add_argument("--dry-run", action="store_true", help="print the workload and the server flags, start nothing")
    args = ap.parse_args(argv)
    args.faults = [k.strip() for k in args.faults.split(",") if k.strip()]
    if bad := [k for k in args.faults if k not in FAULT_KINDS]:
        ap.error(f"unknown fault kind(s) {bad}; choose from {', '.join(FAULT_KINDS)}")
    if not args.trace.is_file():
        ap.error(f"no trace at {args.trace} (give --trace)")
    if REDIS_SERVER is None:
        ap.error("no redis-server or valkey-server on PATH (G4 needs one)")
    if args.minutes <= 0 or args.concurrency < 1 or args.tenants < 1 or args.fault_interval <= 0:
        ap.error("--minutes and --fault-interval must be > 0, --concurrency and --tenants >= 1")
    if not 1 <= args.min_output <= args.max_output:
        ap.error("need 1 <= --min-output <= --max-output")

    from engine.demo_model import ensure_demo_model

    model_dir = ensure_demo_model()
    cfg = json.loads((model_dir / "config.json").read_text())
    wl = build_workload(load_trace(args.trace, args.start, args.num_requests), args.scale, args.output_scale,
                        args.min_output, args.max_output, cfg["vocab_size"], args.seed)
    summary = wl.summary()
    longest = max(len(r.prompt) + r.max_tokens for r in wl.reqs)
    g1_blocks = args.num_gpu_blocks or math.ceil(1.25 * args.concurrency * longest / args.block_size)
    common = ["--dtype", args.dtype, "--block-size", str(args.block_size), "--num-gpu-blocks", str(g1_blocks),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--log-level", "warning"]
    oracle_args = [*common, "--no-enable-prefix-caching"]
    log(f"workload: {summary['requests']} requests (trace lines {summary['trace_lines'][0]}-"
        f"{summary['trace_lines'][1]}), {summary['prompt_tokens']:,} prompt tokens ({summary['distinct_tokens']:,} "
        f"distinct), longest {summary['longest_prompt']:,}, {summary['output_tokens']} output tokens; "
        f"G1 {g1_blocks} blocks, G2 {args.g2_gib:g} GiB, G3 {args.g3_gib:g} GiB, Redis {args.redis_mib} MiB")
    if args.dry_run:
        print(json.dumps({"workload": summary, "oracle_args": oracle_args, "soak_args": common}))
        return 0

    def on_term(*_: Any) -> None:  # SIGTERM cleans up like Ctrl-C: servers stopped, mounts undone
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    key = hashlib.sha256(json.dumps([summary["sha256"], oracle_args, args.concurrency, model_digest(model_dir),
                                     source_digest()]).encode()).hexdigest()
    oracle, oracle_info = get_oracle(args, wl.reqs, oracle_args, key)

    work = Path(tempfile.mkdtemp(prefix="kvtier-soak-", dir=args.g3_dir))
    g3_root = work / "g3"
    g3_root.mkdir()
    g3_tmpfs = False
    tmpfs_why = "--no-tmpfs"
    if not args.no_tmpfs:
        why = try_mount_tmpfs(g3_root, int(args.g3_gib * 1024) + 128)
        g3_tmpfs, tmpfs_why = why is None, why or f"tmpfs of {int(args.g3_gib * 1024) + 128} MiB"
    log(f"G3 at {g3_root}: {'tmpfs' if g3_tmpfs else 'the parent filesystem'} ({tmpfs_why}); "
        f"running as uid {os.geteuid()}")
    redis = RedisProc(work / "redis", free_port(), ("--maxmemory", f"{args.redis_mib}mb"))
    soak_args = [*common, "--kv-offloading-size", f"{args.g2_gib:g}", "--kv-offload-disk", str(g3_root),
                 "--kv-offload-disk-size", f"{args.g3_gib:g}", "--kv-offload-remote", redis.url]
    soak: Soak | None = None
    interrupted = False
    try:
        redis.start()
        soak = Soak(args, soak_args, wl.reqs, oracle, g3_root, g3_tmpfs, redis)
        try:
            soak.run()
        except KeyboardInterrupt:
            interrupted = True
            log("interrupted: reporting what ran")
        duration = soak.now()
    finally:
        if soak is not None:
            soak.close()
        redis.stop()
        if g3_tmpfs:
            unmount(g3_root)
        shutil.rmtree(work, ignore_errors=True)

    doc, table = report(soak, duration)
    print(table, flush=True)
    log_path = args.out.with_suffix(".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text("".join(f"===== server #{inc} =====\n" + "".join(lines) for inc, lines in soak.logs))
    path = write_json(args.out, {
        **doc, "interrupted": interrupted, "table": table, "server_log": str(log_path),
        "workload": {**summary, "trace": str(args.trace), "start": args.start, "scale": args.scale,
                     "output_scale": args.output_scale, "min_output": args.min_output,
                     "max_output": args.max_output, "concurrency": args.concurrency, "tenants": args.tenants},
        "config": {"soak_server_args": soak_args, "oracle_server_args": oracle_args, "threads": args.threads,
                   "g3": "tmpfs" if g3_tmpfs else "parent filesystem", "g3_tmpfs_note": tmpfs_why,
                   "uid": os.geteuid(), "redis": REDIS_SERVER, "redis_maxmemory_mib": args.redis_mib,
                   **{k: getattr(args, k) for k in ("minutes", "seed", "fault_interval", "first_fault", "faults",
                                                    "exit_timeout", "redis_stop_s", "redis_down_s", "g3_fault_s",
                                                    "flip_files", "recovery_timeout", "sample_interval")}},
        "oracle": {**oracle_info, "requests": len(oracle)}})
    log(f"wrote {path} and {log_path}")
    s = doc["summary"]
    return 1 if s["wrong_outputs"] or s["corrupt_entries_served"] or interrupted or soak.fatal else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before the chaos phase (the oracle): nothing to report
        log("interrupted")
        sys.exit(130)
