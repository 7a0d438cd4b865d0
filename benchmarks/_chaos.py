"""soak.py's faults: the processes and mounts they act on, and `Chaos`, which owns the fault
schedule, the faults injected so far and the undo of the one in force (see soak.py's docstring
for what each kind does and what its recovery means).

Imported by soak.py after it has put the repo root first on sys.path and benchmarks/ last.
"""
from __future__ import annotations

import os
import random
import resource
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from _common import log

if TYPE_CHECKING:
    from _soak_run import Soak
    from redis_procs import RedisProc

FAULT_KINDS = ("core_kill", "redis_stop", "redis_kill", "g3_readonly", "g3_full", "g3_flip", "g3_stranger", "hostile")
DAMAGE_KINDS = ("g3_flip", "g3_stranger")  # faults that damage entries: corrupt counts are theirs
try:  # only to tell header flips from payload flips in the report
    from kvstore.disk import HEADER_SIZE
except ImportError:
    HEADER_SIZE = None


# -- processes and mounts ------------------------------------------------------------------------
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


class Chaos:
    """The faults of one soak run, injected by `run` on the chaos thread into the server of
    `soak` (a core kill restarts it through `soak`, where the workers pick it up), its Redis and
    its G3 directory. What a fault changes is undone by `run_undo`, which the run calls when it
    stops as well, so that no read-only mount, filler file or stopped Redis outlives it."""

    def __init__(self, soak: Soak, g3_root: Path, g3_tmpfs: bool, redis: RedisProc) -> None:
        self.soak, self.args, self.stop, self.up = soak, soak.args, soak.stop, soak.up
        self.g3_root, self.g3_tmpfs, self.redis = g3_root, g3_tmpfs, redis
        self.faults: list[Fault] = []
        self.undo: list[Callable[[], Any]] = []  # callables that undo the fault in force (run on stop, too)
        self.euid = os.geteuid()

    def run(self, deadline: float) -> None:
        """Inject faults until `deadline` (seconds on the soak's clock) or the soak stops."""
        rng = random.Random(self.args.seed)
        kinds = list(self.args.faults)
        order: list[str] = []
        t_next = self.args.first_fault + rng.expovariate(1 / self.args.fault_interval)
        while not self.stop.is_set():
            if self.stop.wait(max(t_next - self.soak.now(), 0)):
                break
            if self.soak.now() > deadline - 5:
                break
            if not order:
                order = rng.sample(kinds, len(kinds))
            kind = order.pop(0)
            f = Fault(len(self.faults) + 1, kind, self.soak.now())
            self.faults.append(f)
            log(f"[{f.t_start:4.0f}s] fault #{f.id}: {kind}")
            try:
                getattr(self, f"fault_{kind}")(f, rng)
            except Exception as e:  # noqa: BLE001 - the campaign goes on; the fault says what broke
                f.notes.append(f"error: {type(e).__name__}: {e}")
                log(f"fault #{f.id} {kind} raised {type(e).__name__}: {e}")
                self.run_undo()
                if kind == "core_kill" and not self.up.is_set():
                    self.soak.fatal = f"no server after fault #{f.id}: {e}"
                    self.stop.set()
                    return
            log(f"[{self.soak.now():4.0f}s] fault #{f.id} {kind} done: {f.method}; "
                f"recovery {f.recovery_s if f.recovery_s is None else round(f.recovery_s, 1)} s "
                f"({f.recovery_what}) {'; '.join(f.notes)}")
            t_next = self.soak.now() + max(2.0, rng.expovariate(1 / self.args.fault_interval))

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
        f.t_clear = self.soak.now()

    def wait_recovery(self, f: Fault, what: str, ok: Any) -> None:
        """Poll /v1/kv/stats every second until ok(flat, at_clear) or --recovery-timeout."""
        f.recovery_what = what
        at_clear = self.soak.sample() or {}
        t_clear = f.t_clear if f.t_clear is not None else self.soak.now()
        while self.soak.now() - t_clear < self.args.recovery_timeout and not self.stop.is_set():
            flat = self.soak.sample()
            if flat is not None and ok(flat, at_clear):
                f.recovery_s = self.soak.now() - t_clear
                return
            self.stop.wait(1.0)
        f.notes.append(f"not recovered within {self.args.recovery_timeout:.0f} s" if not self.stop.is_set()
                       else "run ended before recovery")

    def fault_core_kill(self, f: Fault, rng: random.Random) -> None:
        import httpx

        srv = self.soak.server
        assert srv is not None
        core = find_core_pid(srv.proc.pid)
        if core is None:
            f.skipped = True
            f.notes.append(f"no engine-core child of server pid {srv.proc.pid}")
            return
        self.soak.sample()  # this incarnation's last counters
        url = srv.url
        f.method = f"SIGKILL core pid {core}"
        f.t_start = self.soak.now()
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
            self.soak.finding("server did not exit after core death", fault=f.id, waited_s=self.args.exit_timeout,
                         health_non_200_after_s=health_bad)
            os.killpg(srv.proc.pid, signal.SIGKILL)  # its own session: everything it started goes too
            srv.proc.wait(10)
        elif srv.proc.returncode != 1:
            self.soak.finding("server exit code after core death is not 1", fault=f.id, exit_code=srv.proc.returncode)
        self.up.clear()
        f.detail.update(server_exit_code=None if hung else srv.proc.returncode,
                        server_exit_s=None if exited is None else round(exited, 2),
                        health_non_200_s=None if health_bad is None else round(health_bad, 2),
                        server_killed_by_soak=hung)
        if self.stop.is_set():
            return
        f.detail["restart_s"] = round(self.soak.start_server(), 1)
        f.t_clear = self.soak.now()
        f.recovery_what = "kill -> first successful response"  # computed from the requests in report()
        while self.soak.now() - f.t_clear < self.args.recovery_timeout and not self.stop.is_set():
            done = [r["done"] for r in list(self.soak.records) if r["ok"] and r["sent"] >= f.t_start]
            if done:
                f.recovery_s = min(done) - f.t_start
                break  # recovered: the next fault may come
            self.stop.wait(0.5)

    def fault_redis_stop(self, f: Fault, rng: random.Random) -> None:
        self._redis_outage(f, f"SIGSTOP redis {self.args.redis_stop_s:g} s, SIGCONT", self.redis.pause,
                           self.redis.resume, self.args.redis_stop_s, "SIGCONT")

    def fault_redis_kill(self, f: Fault, rng: random.Random) -> None:
        self._redis_outage(f, f"SIGKILL redis, new one on :{self.redis.port} {self.args.redis_down_s:g} s later",
                           self.redis.kill, self.redis.start, self.args.redis_down_s, "restart")

    def _redis_outage(self, f: Fault, method: str, cause: Callable[[], Any], undo: Callable[[], Any],
                      seconds: float, cleared_by: str) -> None:
        """Redis out for `seconds`: `cause`, hold, `undo`, then wait for G4 to work again."""
        f.method = method
        cause()
        self.undo.append(undo)
        self.hold(f, seconds)
        self.wait_recovery(f, f"{cleared_by} -> G4 breaker closed and a G4 hit or write", self._g4_ok)

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
            srv = self.soak.server
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
        f.t_clear = self.soak.now()
        f.recovery_what = "n/a"

    def fault_g3_stranger(self, f: Fault, rng: random.Random) -> None:
        """A FIFO, a symlink and a directory planted at live G3 entry paths (issue 38): each must be
        a miss and removed, and G3 must keep serving."""
        files = sorted(self.g3_root.rglob("*.kvb"))
        planted = []
        for path, kind in zip(rng.sample(files, min(3, len(files))), ("fifo", "symlink", "directory")):
            try:
                path.unlink()
                if kind == "fifo":
                    os.mkfifo(path, 0o600)
                elif kind == "symlink":
                    os.symlink("/etc/hostname", path)
                else:
                    path.mkdir()
                planted.append({"file": path.name, "kind": kind, "path": str(path)})
            except OSError as e:
                f.notes.append(f"could not plant {kind}: {e.strerror}")
        f.method = f"planted {', '.join(p['kind'] for p in planted)} at live G3 entry paths"
        f.t_clear = self.soak.now()
        self.wait_recovery(f, "planted -> a G3 hit or write after them", self._g3_ok)
        f.detail["planted"] = planted
        f.detail["still_there"] = [p["kind"] for p in planted
                                   if os.path.lexists(p["path"]) and not Path(p["path"]).is_file()]

    def fault_hostile(self, f: Fault, rng: random.Random) -> None:
        """One of issue 38's hostile requests, sent beside the workload: it must get an answer or a
        400 in bounded time, and the workload's requests must not fail or change."""
        import httpx
        from _hostile import classes

        name, path, body = classes()[(len([x for x in self.faults if x.kind == "hostile"]) - 1) % len(classes())]
        t0 = time.monotonic()
        try:
            r = httpx.post(self.soak.url + path, json=body, timeout=self.args.request_timeout)
            status = r.status_code
        except httpx.HTTPError as e:
            status = f"{type(e).__name__}"
        took = time.monotonic() - t0
        f.method = f"{name}: {status} after {took:.2f} s"
        f.detail.update({"class": name, "status": status, "seconds": round(took, 3)})
        if status not in (200, 400):
            f.notes.append(f"hostile request answered {status}")
        f.t_clear = self.soak.now()
        f.recovery_what = "n/a"
