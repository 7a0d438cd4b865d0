"""Helpers shared by the scripts in benchmarks/: progress lines, tables, medians, interleaved
runs and JSON results that carry a description of the machine they were measured on.

Stdlib only at import time (torch is imported lazily): `throughput.py` also imports this in
its vLLM worker, which runs under a different virtual environment.

Import it from a benchmark script after putting the repo root first on sys.path and
benchmarks/ *last* (see throughput.py): benchmarks/ must never come before site-packages or
the repo's packages, or a script named like a package (benchmarks/policies.py) shadows it.
"""
from __future__ import annotations

import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timezone
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"

T = TypeVar("T")


def log(msg: str) -> None:
    """Progress goes to stderr so that stdout holds only the final table."""
    print(msg, file=sys.stderr, flush=True)


def usable_cpus() -> int:
    """Cores this process may run on (the affinity mask), which can be fewer than the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_torch_threads(n: int) -> None:
    """Set intra-op threads identically for every engine in this process; engines are compared only at
    equal thread counts. OMP_NUM_THREADS is exported too, for subprocesses (it is read at their start)."""
    import torch

    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


def preload_allocator() -> None:
    """Re-executes this benchmark under tcmalloc when the system has it, as the `kvtier`
    CLI does for serve/generate/extract (engine/runner/cpu_runtime.py), so in-process engines are measured as
    users run them. Every engine in this process shares it; KVTIER_MALLOC=system turns it off."""
    from engine.runner.cpu_runtime import reexec_env

    env = reexec_env(dict(os.environ))
    if env is not None:
        log(f"re-executing under LD_PRELOAD={env['LD_PRELOAD']} (KVTIER_MALLOC=system to measure with glibc)")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


# -- statistics ---------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    """Median of runs: robust to the one run that a neighbour on the shared machine slowed down."""
    if not values:
        raise ValueError("median of no runs")
    return float(statistics.median(values))


def summarize(values: Sequence[float]) -> dict[str, float]:
    return {"median": median(values), "min": float(min(values)), "max": float(max(values)), "n": len(values)}


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


# -- interleaving -------------------------------------------------------------------------------
def interleave(runs: int, items: Sequence[T]) -> Iterator[tuple[int, T]]:
    """Yield (run index, item) as A B C A B C ...: every engine sees each phase of the machine's
    noise (neighbours come and go), instead of A A A B B B, where one engine could get all the
    quiet minutes."""
    for r in range(runs):
        for item in items:
            yield r, item


def run_interleaved(runs: int, items: dict[str, Callable[[int], T]],
                    progress: Callable[[int, str, T], None] | None = None) -> dict[str, list[T]]:
    """Call each named measurement once per run, interleaved; the callable gets the run index.
    Returns every result per name, in run order."""
    out: dict[str, list[T]] = {name: [] for name in items}
    for r, name in interleave(runs, list(items)):
        result = items[name](r)
        out[name].append(result)
        if progress is not None:
            progress(r, name, result)
    return out


# -- output -------------------------------------------------------------------------------------
def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table; numbers are right-aligned, floats get one decimal."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.1f}"
        return str(v)

    cells = [[cell(v) for v in row] for row in rows]
    numeric = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    print(format_table(headers, rows), flush=True)


def _git(*args: str) -> str | None:
    try:
        # --no-optional-locks: read-only, never refreshes the index under a concurrent git user.
        res = subprocess.run(["git", "--no-optional-locks", *args], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _cpu_isa() -> str | None:
    """The widest ISA the CPU has for the forward (engine/runner/cpu_runtime.py), where the repo is importable."""
    try:
        from engine.runner.cpu_runtime import cpu_isa
    except ImportError:  # the vLLM worker's venv
        return None
    return cpu_isa().name


def _version(dist: str) -> str | None:
    try:
        return importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge a number: cores, thread setting, versions and the exact code."""
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "cpu_model": _cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "torch_threads": None,
        "cpu_isa": _cpu_isa(),
    }
    if "torch" in sys.modules:  # report the setting in force, without importing torch just for this
        info["torch_threads"] = sys.modules["torch"].get_num_threads()
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    info["git_commit"] = commit
    info["git_dirty"] = bool(status) if status is not None else None  # uncommitted changes to tracked files
    return info


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write results with the machine description and the command line that produced them."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "machine": machine_info(),
        **payload,
    }
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)  # never leave a half-written result file behind
    return path


class Timer:
    """`with Timer() as t: ...; t.seconds` — wall time by perf_counter."""

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


# -- peers in a subprocess (vLLM lives in its own venv) ------------------------------------------
def vllm_cpu_env(threads: int, kv_gib: float, workdir: Path, extra: Iterable[str] = ()) -> dict[str, str]:
    """Environment for vLLM's CPU build (see ../shared/PEERS.md beside the checkout): all `threads`
    cores bound, none reserved, and every cache, socket and temp file inside `workdir`. `extra` is
    KEY=VALUE strings (e.g. LD_PRELOAD for tcmalloc) and wins."""
    cache = workdir / "cache"
    env = dict(os.environ)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": f"{kv_gib:g}",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # else vLLM keeps one of the cores for itself
        "OMP_NUM_THREADS": str(threads),
        "VLLM_CACHE_ROOT": str(cache / "vllm"), "VLLM_CONFIG_ROOT": str(cache / "config"),
        "XDG_CACHE_HOME": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"), "VLLM_RPC_BASE_PATH": str(workdir),
        "TMPDIR": str(workdir), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
    })
    env.update(kv.split("=", 1) for kv in extra)
    return env


class JsonWorker:
    """A long-lived worker process driven by text commands on its stdin, answering JSON lines on a
    private pipe (its fd number is appended to `argv`). The worker's stdout/stderr go to a log file,
    so a library that prints to stdout cannot corrupt the replies. A reply with an "error" key, an
    exit or a timeout raises RuntimeError with a short reason; the log's tail goes to stderr."""

    def __init__(self, argv: list[str], env: dict[str, str], workdir: Path, name: str = "worker"):
        self.name, self.log_path = name, workdir / f"{name}.log"
        read_fd, write_fd = os.pipe()
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen([*argv, str(write_fd)], stdin=subprocess.PIPE, stdout=log_file,
                                         stderr=subprocess.STDOUT, env=env, cwd=workdir, pass_fds=(write_fd,),
                                         start_new_session=True)  # own group, so close() can kill it whole
        os.close(write_fd)  # else EOF never comes when the worker dies
        self.read_fd, self.buf = read_fd, b""

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(cmd.encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as e:
            raise self._failed(f"{self.name} is gone ({e})") from None

    def recv(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.read_fd], [], [], left)[0]:
                raise self._failed(f"{self.name} timed out after {timeout:.0f} s")
            chunk = os.read(self.read_fd, 65536)
            if not chunk:
                raise self._failed(f"{self.name} exited (rc={self.proc.wait()})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg = json.loads(line)
        if "error" in msg:
            raise self._failed(f"{self.name} failed: {msg['error']}")
        return msg

    def _failed(self, why: str, n: int = 15) -> RuntimeError:
        # The log usually sits in a temp dir deleted at exit: show its tail now, keep `why` short.
        try:
            tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            tail = "(no log)"
        log(f"{why}; last lines of {self.log_path.name}:\n{tail}")
        return RuntimeError(why)

    def pause(self) -> None:
        """Stop the worker's whole process group (SIGSTOP) while it is idle. Idle, vLLM's CPU worker
        keeps ~47 threads pinned to core 0 (14 gloo loops among them, each waking every 10 ms). On a
        2-core machine those wake-ups kept pushing the timed engine's unpinned thread off core 0, and
        both its threads then shared core 1 for seconds at a time while core 0 sat idle (sampled
        placement; docs/CPU.md): kvtier's float32 workload took 29 s beside it, 27 s with it stopped."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            # SIGSTOP lands when each thread next runs: wait for it, or the timed engine's first
            # steps share the cores with ~100 threads on their way to stopping.
            deadline = time.monotonic() + 5.0
            while not _group_stopped(self.proc.pid) and time.monotonic() < deadline:
                time.sleep(0.002)

    def resume(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self, cmd: str = "quit") -> None:
        self.resume()  # a stopped worker reads no command
        try:
            if self.proc.poll() is None:
                self.send(cmd)
                self.proc.wait(timeout=60)
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its session: engine-core children included
            self.proc.wait()
        os.close(self.read_fd)


def _group_stopped(pgid: int) -> bool:
    """Every thread of process group `pgid` stopped (or gone), from /proc."""
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if int((p / "stat").read_text().rpartition(")")[2].split()[2]) != pgid:
                continue
            states = [(t / "stat").read_text().rpartition(")")[2].split()[0] for t in (p / "task").iterdir()]
        except (OSError, IndexError, ValueError):  # exited meanwhile
            continue
        if any(s not in ("T", "t", "Z", "X") for s in states):
            return False
    return True


def worker_reply(fd: int) -> Callable[..., None]:
    """Worker side of JsonWorker: `send = worker_reply(int(sys.argv[-1])); send(key=value, ...)`."""
    reply = os.fdopen(fd, "w", buffering=1)

    def send(**msg: Any) -> None:
        reply.write(json.dumps(msg) + "\n")
        reply.flush()

    return send
