"""What a timed run cost its process tree, read from /proc: CPU seconds, page faults (major ones
read from disk) and context switches (involuntary ones mean another task took the core).

It tells why one engine's run was slower than usual: CPU seconds well under threads × wall time
mean its threads waited, and runnable-wait seconds say how much of that was waiting for a core
(e.g. two threads stacked on one core) rather than sleeping; involuntary switches mean they were
preempted; major faults mean code or
data was read back from disk (e.g. after the host's DAMON reclaim paged it out while idle). Stdlib
only: the vLLM worker imports it in vLLM's venv. Linux only; elsewhere the counts are empty.
"""
from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:  # exited between the listing and the read
        return None
    return text[text.rindex(")") + 2:].split()  # fields from "state" on; comm may hold spaces


def _descendants(root: int) -> list[int]:
    parent: dict[int, int] = {}
    for p in PROC.iterdir():
        if p.name.isdigit() and (f := _stat_fields(int(p.name))) is not None:
            parent[int(p.name)] = int(f[1])
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, pp in parent.items() if pp in frontier]
        tree += frontier
    return tree


def _threads(pid: int) -> tuple[int, int, float]:
    """Voluntary and involuntary switches, and seconds spent runnable but waiting for a core
    (/proc/.../schedstat), summed over the live threads."""
    vol = invol = 0
    wait_ns = 0
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return 0, 0, 0.0
    for t in tasks:
        try:
            for line in (t / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    vol += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    invol += int(line.split()[1])
            wait_ns += int((t / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return vol, invol, wait_ns / 1e9


def _machine() -> dict[str, float]:
    """All cores' busy and stolen seconds (/proc/stat): busy minus this tree's is what others used."""
    try:
        head = (PROC / "stat").read_text().splitlines()[0].split()
    except OSError:
        return {}
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in head[1:9])
    return {"machine_busy_s": (user + nice + system + irq + softirq) / TICKS, "steal_s": steal / TICKS}


def tree_usage(pid: int | None = None, children: bool = True) -> dict[str, float]:
    """Totals over `pid` (default this process) and, with `children`, its live descendants; with
    the machine's busy and stolen seconds. {} off Linux."""
    if not PROC.is_dir():
        return {}
    total = {"cpu_s": 0.0, "runnable_wait_s": 0.0, "minflt": 0, "majflt": 0, "vol_switches": 0,
             "invol_switches": 0, **_machine()}
    root = pid if pid is not None else os.getpid()
    for p in _descendants(root) if children else [root]:
        f = _stat_fields(p)
        if f is None:
            continue
        # After "state": ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
        total["minflt"] += int(f[7])
        total["majflt"] += int(f[9])
        total["cpu_s"] += (int(f[11]) + int(f[12])) / TICKS
        vol, invol, wait = _threads(p)
        total["vol_switches"] += vol
        total["invol_switches"] += invol
        total["runnable_wait_s"] += wait
    return total


def usage_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """`after - before`, rounded, and `others_cpu_s`: what other processes used meanwhile. Keys
    missing from either side are left out."""
    d = {k: round(after[k] - before[k], 3) for k in after if k in before}
    if "machine_busy_s" in d:
        d["others_cpu_s"] = round(max(0.0, d.pop("machine_busy_s") - d["cpu_s"]), 3)
    return d
