"""How many threads the CPU forward runs: the CPUs this process may use, and fewer while another
process is using them (issue 38).

**At start-up** the count is the CPUs this process may run on: its affinity mask, lowered to its
cgroup's CPU quota (a container given 2 CPUs on a 64-core host would otherwise run 64 threads
that take turns). OMP_NUM_THREADS, or `cpu_threads`, sets it instead.

**While it runs** a forward's OpenMP team waits at a barrier after every parallel region for
its slowest thread. When another process is runnable on one of the team's cores, that thread
runs only every other time slice, and the whole team waits for it, dozens of times a step:
measured here, one busy neighbour made the default two threads 2.9x slower (AMD EPYC) to 12x
(an Intel Xeon), where one thread was 1.5x slower than two on a quiet machine. So a governor
reads, every INTERVAL_S, how much of the usable CPUs other processes used (the machine's busy
time in /proc/stat minus this process's own in /proc/self/stat): when what is left for this
process is below the threads it runs by more than half a core, it drops to what is left (at
least one); when what is left has had room for one more thread for RAISE_AFTER_S seconds (an
idle stretch between requests counts whole), it adds one back, up to the start-up count. Each
change is logged.

A reading that spans an idle stretch (the engine calls `rest()` when it has nothing left to run)
is checked against what is runnable at that moment (/proc/stat's procs_running less this process's
running threads, three looks 1 ms apart): what other processes used while this one did not step
says nothing by itself about contention with its steps. If another process is runnable now, the
reading stands (a neighbour that kept running sheds threads at once, as before). If none is, it may
add a thread but not drop one, and a governor below its start-up count goes back to it at once,
since its next reading would come only after the first step (at one thread, a 4k-token prefill
chunk takes seconds). Before this, every kvtier run of the interleaved benchmark that followed
vLLM's run (both cores busy beside the idle engine) began at one thread: ~4.8 s of it (AMD EPYC,
2 cores).

A compiled model (-O1, the CPU default) has its OpenMP thread count baked into its code, and its
first run at another count recompiles (5 s on the demo model, inside a request's step). So the
governor moves between a few `levels` only (every count up to 4 threads, quarters above), and the
engine's warm-up compiles each of them at start-up (`ThreadGovernor.warm_up`).

Passive waiting (OMP_WAIT_POLICY=PASSIVE) was the other candidate: under the same neighbour it
was as good as one thread, but on a quiet machine it made decode 35-50% slower (threads sleep
and wake at every barrier), so the engine keeps spinning and sheds threads instead.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

INTERVAL_S = 0.5  # how often the governor measures
DROP_MARGIN = 0.5  # drop when the CPUs left are this much below the threads running
RAISE_ROOM = 0.8  # add a thread when this much of a CPU beyond the running threads is left ...
RAISE_AFTER_S = 1.0  # ... for this long
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (guest time is inside user)


def levels(max_threads: int) -> tuple[int, ...]:
    """The thread counts a governor may use: all up to 4, else quarters of the most (and 1)."""
    if max_threads <= 4:
        return tuple(range(1, max_threads + 1))
    return tuple(sorted({1, *(max(1, max_threads * k // 4) for k in (1, 2, 3, 4))}))


@dataclass(frozen=True)
class UsableCpus:
    cpus: tuple[int, ...]  # the affinity mask
    quota: float | None  # the cgroup's CPU quota in CPUs, None when unlimited

    @property
    def count(self) -> int:
        n = len(self.cpus) or (os.cpu_count() or 1)
        return max(1, min(n, math.ceil(self.quota))) if self.quota is not None else n

    def describe(self) -> str:
        q = f"cgroup quota {self.quota:g} CPUs" if self.quota is not None else "no cgroup CPU quota"
        return f"{self.count} usable CPUs (affinity {len(self.cpus)}, {q})"


def cgroup_quota(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """This process's cgroup CPU quota in CPUs (v2 cpu.max, or v1 cfs_quota_us / cfs_period_us);
    None when unlimited or unreadable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    paths = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            paths[c] = path.lstrip("/")
    candidates: list[tuple[Path, Path | None]] = [(root / paths.get("", "") / "cpu.max", None), (root / "cpu.max", None)]
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):  # v1 mounts the controller under one of these
        for sub in ((paths["cpu"], "") if "cpu" in paths else ("",)):
            d = root / mount / sub
            candidates.append((d / "cpu.cfs_quota_us", d / "cpu.cfs_period_us"))
    for quota_file, period_file in candidates:
        try:
            if period_file is None:
                quota, period = quota_file.read_text().split()[:2]
            else:
                quota, period = quota_file.read_text().strip(), period_file.read_text().strip()
        except (OSError, ValueError):
            continue
        if quota in ("max", "-1"):
            return None
        try:
            q, p = int(quota), int(period)
        except ValueError:
            continue
        return q / p if q > 0 and p > 0 else None
    return None


def usable_cpus() -> UsableCpus:
    cpus = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
    return UsableCpus(cpus, cgroup_quota())


def read_busy(cpus: tuple[int, ...], stat_text: str) -> tuple[float, float]:
    """(busy, total) clock ticks of `cpus` (all when empty) from /proc/stat's text."""
    busy = total = 0.0
    want = {f"cpu{c}" for c in cpus}
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or (want and name not in want):
            continue
        vals = [float(v) for v in rest.split()[:8]]
        busy += sum(vals[i] for i in _BUSY_FIELDS if i < len(vals))
        total += sum(vals)
    return busy, total


def procs_running(stat_text: str) -> int:
    """The machine's runnable tasks now (/proc/stat's procs_running), the reader included."""
    for line in stat_text.splitlines():
        if line.startswith("procs_running "):
            return int(line.split()[1])
    raise ValueError("no procs_running in /proc/stat")


def own_running_threads() -> int:
    """This process's threads in state R (running or runnable) now."""
    n = 0
    for t in Path("/proc/self/task").iterdir():
        try:
            n += (t / "stat").read_text().rpartition(")")[2].split()[0] == "R"
        except (OSError, IndexError):  # the thread exited meanwhile
            continue
    return n


def own_ticks(stat_text: str) -> float:
    """utime + stime of /proc/self/stat's text, in clock ticks."""
    fields = stat_text.rpartition(")")[2].split()
    return float(fields[11]) + float(fields[12])


class ThreadGovernor:
    """Owns the forward's thread count (see the module docstring). `tick()` from the thread that
    runs the forward, once a step: torch's thread count is per calling thread."""

    def __init__(self, usable: UsableCpus, threads: int, set_threads: Callable[[int], None],
                 read: Callable[[str], str] = lambda p: Path(p).read_text(),
                 clock: Callable[[], float] = time.monotonic, get_threads: Callable[[], int] | None = None,
                 own_running: Callable[[], int] = own_running_threads) -> None:
        """`get_threads`: torch's count now, re-set to ours at each tick when another engine in this
        process changed it (it is process-wide)."""
        self.usable, self.max_threads, self.threads = usable, max(1, threads), max(1, threads)
        self._get, self._own_running = get_threads, own_running
        self.levels = levels(self.max_threads)
        self._set, self._read, self._clock = set_threads, read, clock
        self._room_s = 0.0  # seconds in a row with room for one more thread
        self._last: tuple[float, float, float] | None = None  # (time, others' busy ticks, total ticks)
        self._next = 0.0
        self._rested = False  # the engine went idle since the last reading
        self.changes = 0

    def tick(self) -> None:
        if self._get is not None and self._get() != self.threads:
            self._set(self.threads)
        now = self._clock()
        if now < self._next:
            return
        self._next = now + INTERVAL_S
        try:
            stat = self._read("/proc/stat")
            busy, total = read_busy(self.usable.cpus, stat)
            own = own_ticks(self._read("/proc/self/stat"))
        except (OSError, ValueError, IndexError) as e:  # not Linux, or no /proc: stay as we are
            log.debug("thread governor cannot read CPU times: %s", e)
            self._next = now + 60.0
            return
        last, self._last = self._last, (now, busy - own, total)
        spanned_idle, self._rested = self._rested, False
        if last is None or total <= last[2]:
            return
        n = len(self.usable.cpus) or (os.cpu_count() or 1)  # the CPUs /proc/stat was summed over
        others = max(0.0, (busy - own - last[1]) / (total - last[2]) * n)
        quiet = spanned_idle and self._none_runnable(stat)
        if quiet and self.threads < self.max_threads:
            self._change(self.max_threads, "steps resume with no other process runnable")
            return
        self.observe(min(n, self.usable.count) - others, now - last[0], may_drop=not quiet)

    def _none_runnable(self, stat: str, looks: int = 3) -> bool:
        """Nothing else runnable in at least one of `looks` looks 1 ms apart: a single look can catch
        a kernel worker's or a shell's moment on a core."""
        try:
            for i in range(looks):
                if procs_running(stat if i == 0 else self._read("/proc/stat")) - self._own_running() <= 0:
                    return True
                time.sleep(0.001)
        except (OSError, ValueError, IndexError):  # unreadable: the reading stands, as without rest()
            return False
        return False

    def rest(self) -> None:
        """The engine has nothing left to run: the reading that the next tick takes spans the idle
        stretch, and what is runnable then decides whether it stands (module docstring)."""
        self._rested = True

    def observe(self, left: float, seconds: float = INTERVAL_S, may_drop: bool = True) -> None:
        """`left`: the CPUs other processes left this process over the last `seconds`; `may_drop`
        False when this process was not stepping all that time."""
        if left < self.threads - DROP_MARGIN and self.threads > 1:
            if not may_drop:
                self._room_s = 0.0
                return
            fit = max(1, int(left + 0.5))
            self._change(max(n for n in self.levels if n <= fit), f"other processes left {left:.1f} CPUs")
        elif left >= self.threads + RAISE_ROOM and self.threads < self.max_threads:
            self._room_s += seconds
            if self._room_s >= RAISE_AFTER_S - 1e-9:
                self._change(min(n for n in self.levels if n > self.threads), f"{left:.1f} CPUs free again")
        else:
            self._room_s = 0.0

    def warm_up(self, run: Callable[[], None]) -> None:
        """`run` (a compiled model's warm-up forward) at every level, the start-up count last."""
        try:
            for n in [*(n for n in self.levels if n != self.threads), self.threads]:
                self._set(n)
                run()
        finally:
            self._set(self.threads)

    def _change(self, threads: int, why: str) -> None:
        self._room_s = 0.0
        if threads == self.threads:
            return
        log.info("CPU forward threads %d -> %d: %s", self.threads, threads, why)
        self.threads = threads
        self.changes += 1
        self._set(threads)


class FixedThreads:
    """An engine's fixed thread count, re-set before a step when another engine in this process
    (a benchmark's, a test's) changed torch's, which is process-wide: a tensor-parallel rank 0 left
    at another engine's 2 threads on its 1 core ran 3.5x slower, fighting its worker for a core."""

    def __init__(self, threads: int, set_threads: Callable[[int], None], get_threads: Callable[[], int]) -> None:
        self.threads, self._set, self._get = threads, set_threads, get_threads
        self.changes = 0  # never changes: the governor's counter, for the stats

    def tick(self) -> None:
        if self._get() != self.threads:
            self._set(self.threads)

    def rest(self) -> None:
        pass  # nothing measured

    def warm_up(self, run: Callable[[], None]) -> None:
        run()


def start(cpu_threads: int | None, adaptive: bool, runtime: str) -> ThreadGovernor | FixedThreads:
    """Sets the forward's thread count (module docstring) on the calling thread, logs it with
    `runtime` (the allocator and binding line) and returns what keeps it: the governor, or a fixed count."""
    import torch

    usable = usable_cpus()
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    threads = cpu_threads or (int(env) if env.isdigit() and int(env) > 0 else usable.count)
    torch.set_num_threads(threads)
    governed = adaptive and threads > 1
    log.info("CPU: %d forward threads, %s%s; %s", threads, usable.describe(),
             "; fewer while other processes load those CPUs" if governed else "", runtime)
    if governed:
        return ThreadGovernor(usable, threads, torch.set_num_threads, get_threads=torch.get_num_threads)
    return FixedThreads(threads, torch.set_num_threads, torch.get_num_threads)
