"""engine/runner/cpu_threads.py (issue 38, finding 6): the forward's thread count from the CPUs this
process may use, and the governor that drops threads while other processes load those CPUs.

Oracles: cgroup files and /proc texts written by hand (what the kernel prints), a fake clock,
and, once, a real CPU-bound neighbour process on this machine."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.runner import cpu_threads as ct
from engine.runner.cpu_threads import ThreadGovernor, UsableCpus, cgroup_quota, own_ticks, read_busy


def _files(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


@pytest.mark.parametrize("proc,files,want", [
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),
    ("0::/\n", {"cpu.max": "150000 100000\n"}, 1.5),
    ("0::/kubepods/pod1\n", {"kubepods/pod1/cpu.max": "200000 100000\n", "cpu.max": "max 100000"}, 2.0),
    ("1:cpu,cpuacct:/docker/abc\n", {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
                                      "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"}, 3.0),
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ("0::/\n", {}, None),  # no controller files: unlimited
])
def test_cgroup_quota_v1_and_v2(tmp_path, proc, files, want):
    root = _files(tmp_path / "cg", files)
    (tmp_path / "cgroup").write_text(proc)
    assert cgroup_quota(root, tmp_path / "cgroup") == want


def test_usable_count_is_affinity_lowered_to_the_quota():
    assert UsableCpus((0, 1, 2, 3), None).count == 4
    assert UsableCpus((0, 1, 2, 3), 1.5).count == 2
    assert UsableCpus((0, 1), 8.0).count == 2
    assert "cgroup quota 1.5 CPUs" in UsableCpus((0, 1, 2, 3), 1.5).describe()


STAT = """cpu  300 0 100 500 0 0 0 0 0 0
cpu0 100 0 50 250 10 0 0 5 0 0
cpu1 200 0 50 250 0 0 0 0 0 0
intr 12345
"""


def test_proc_parsing():
    assert read_busy((0,), STAT) == (155.0, 415.0)  # user+system+steal; iowait is idle
    assert read_busy((0, 1), STAT) == (405.0, 915.0)
    assert read_busy((), STAT) == (405.0, 915.0)
    assert own_ticks("1234 (kv tier) (x) R 1 2 3 4 5 6 7 8 9 10 70 30 0 0") == 100.0


class FakeProc:
    """/proc/stat and /proc/self/stat for two CPUs: every `advance`, this process and the others
    use the given CPU seconds (100 ticks a second)."""

    def __init__(self) -> None:
        self.busy = [0.0, 0.0]
        self.idle = [0.0, 0.0]
        self.own = 0.0
        self.now = 0.0
        self.running = 1  # procs_running: this process's reading thread

    def advance(self, seconds: float, own_cpus: float, other_cpus: float) -> None:
        self.now += seconds
        used = (own_cpus + other_cpus) * seconds * 100
        for c in range(2):
            self.busy[c] += used / 2
            self.idle[c] += 2 * seconds * 100 / 2 - used / 2
        self.own += own_cpus * seconds * 100

    def read(self, path: str) -> str:
        if path == "/proc/stat":
            return "".join(f"cpu{c} {self.busy[c]:.0f} 0 0 {self.idle[c]:.0f} 0 0 0 0 0 0\n"
                           for c in range(2)) + f"intr 0\nprocs_running {self.running}\nprocs_blocked 0\n"
        return f"1 (py) S 1 1 1 1 1 1 1 1 1 1 {self.own:.0f} 0 0 0"


def _governor(proc: FakeProc, changes: list[int]) -> ThreadGovernor:
    return ThreadGovernor(UsableCpus((0, 1), None), 2, changes.append, read=proc.read, clock=lambda: proc.now,
                          own_running=lambda: 1)


def test_governor_drops_a_thread_under_a_neighbour_and_adds_it_back_when_it_leaves(caplog):
    proc, changes = FakeProc(), []
    gov = _governor(proc, changes)
    caplog.set_level(logging.INFO, logger="engine.runner.cpu_threads")
    gov.tick()  # the first reading: nothing to compare yet
    for _ in range(4):  # quiet: both CPUs ours
        proc.advance(ct.INTERVAL_S, own_cpus=1.9, other_cpus=0.05)
        gov.tick()
    assert changes == [] and gov.threads == 2
    proc.advance(ct.INTERVAL_S, own_cpus=1.33, other_cpus=0.67)  # a busy neighbour takes its share
    gov.tick()
    assert changes == [1] and gov.threads == 1
    for _ in range(3):  # one thread beside the neighbour: 1 CPU left, it stays
        proc.advance(ct.INTERVAL_S, own_cpus=1.0, other_cpus=1.0)
        gov.tick()
    assert changes == [1]
    proc.advance(ct.INTERVAL_S, own_cpus=1.0, other_cpus=0.0)  # gone: one quiet interval is not enough
    gov.tick()
    assert changes == [1]
    proc.advance(ct.INTERVAL_S, own_cpus=1.0, other_cpus=0.0)
    gov.tick()
    assert changes == [1, 2] and gov.threads == 2
    assert "2 -> 1: other processes left 1.3 CPUs" in caplog.text and "1 -> 2" in caplog.text


def test_governor_ignores_light_load_and_reads_at_most_every_interval():
    proc, changes, reads = FakeProc(), [], []
    real = proc.read
    proc.read = lambda p: (reads.append(p), real(p))[1]  # type: ignore[method-assign]
    gov = _governor(proc, changes)
    gov.tick()
    for _ in range(10):  # the API process tokenizing beside us: 0.3 CPU is not a reason to drop
        proc.advance(ct.INTERVAL_S / 5, own_cpus=1.7, other_cpus=0.3)
        gov.tick()
    assert changes == [] and 2 * 2 <= len(reads) <= 2 * 3  # the first reading and one per interval (two files)


def test_governor_never_goes_below_one_or_above_the_start_count():
    proc, changes = FakeProc(), []
    gov = _governor(proc, changes)
    gov.observe(-3.0)
    assert gov.threads == 1
    for _ in range(10):
        gov.observe(8.0)
    assert gov.threads == 2 and changes == [1, 2]


def test_start_takes_omp_num_threads_or_the_flag(monkeypatch):
    import torch

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        fixed = ct.start(None, True, "x")  # one thread: nothing to govern, only to keep
        assert isinstance(fixed, ct.FixedThreads) and fixed.threads == 1 and torch.get_num_threads() == 1
        gov = ct.start(2, True, "x")
        assert isinstance(gov, ct.ThreadGovernor) and gov.max_threads == 2 and torch.get_num_threads() == 2
        assert isinstance(ct.start(2, False, "x"), ct.FixedThreads)
    finally:
        torch.set_num_threads(before)


NEIGHBOUR_CHILD = r"""
import logging, sys, time
import torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from engine.runner import cpu_threads
gov = cpu_threads.start(2, True, "test")
x = torch.randn(256, 256)
end = time.monotonic() + 6
while time.monotonic() < end and gov.threads > 1:
    x = torch.tanh(x @ x / 256)
    gov.tick()
print("THREADS", gov.threads, torch.get_num_threads(), flush=True)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable CPUs")
def test_a_real_busy_neighbour_makes_the_governor_drop_a_thread(tmp_path):
    """On this machine, with a real `while True: pass` beside it (and whatever else CI runs)."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        out = subprocess.run([sys.executable, "-c", NEIGHBOUR_CHILD], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    finally:
        hog.kill()
    assert "THREADS 1 1" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "CPU forward threads 2 -> 1" in out.stdout


def test_levels_and_the_warm_up_visit_each_the_start_up_count_last():
    assert ct.levels(1) == (1,) and ct.levels(2) == (1, 2) and ct.levels(4) == (1, 2, 3, 4)
    assert ct.levels(16) == (1, 4, 8, 12, 16) and ct.levels(6) == (1, 3, 4, 6)
    proc, changes = FakeProc(), []
    gov = ThreadGovernor(UsableCpus(tuple(range(16)), None), 16, changes.append, read=proc.read, clock=lambda: proc.now)
    ran = []
    gov.warm_up(lambda: ran.append(changes[-1]))
    assert ran == [1, 4, 8, 12, 16] and changes[-1] == 16
    gov.observe(10.4)  # 5.6 CPUs taken: the largest level that fits
    assert gov.threads == 8
    for _ in range(2):
        gov.observe(16.0)
    assert gov.threads == 12  # one level up at a time


def test_a_compiled_engine_switches_thread_count_without_recompiling(ckpt_dir, monkeypatch):
    """torch.compile's CPU code is specialised to the thread count: the warm-up compiles each
    level, so a governor's switch costs no compile in a request's step."""
    import torch
    import torch._dynamo.utils as dynamo_utils

    from engine import LLM, SamplingParams

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    llm = LLM(str(ckpt_dir("llama")), dtype="float32", num_gpu_blocks=64, optimization_level=1, cpu_threads=2)
    try:
        gov = llm.engine.threads
        assert gov is not None and gov.levels == (1, 2) and torch.get_num_threads() == 2
        compiles = dict(dynamo_utils.counters["stats"])
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for n in (1, 2, 1):
            gov._change(n, "test")
            llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], sp, use_tqdm=False)
        assert dict(dynamo_utils.counters["stats"]).get("unique_graphs") == compiles.get("unique_graphs"), \
            (compiles, dict(dynamo_utils.counters["stats"]))
        assert llm.get_stats().cpu_thread_changes == 3  # 2 -> 1 -> 2 -> 1, counted for the benchmarks' logs
    finally:
        llm.close()
        torch.set_num_threads(before)


def test_an_idle_stretch_with_room_counts_whole():
    """Between requests the governor does not tick: the first tick after a quiet idle minute adds
    the thread back at once, instead of running a second at one thread first."""
    proc, changes = FakeProc(), []
    gov = _governor(proc, changes)
    gov.tick()
    proc.advance(ct.INTERVAL_S, own_cpus=1.33, other_cpus=0.67)
    gov.tick()
    assert gov.threads == 1
    proc.advance(60.0, own_cpus=0.0, other_cpus=0.02)  # idle, the neighbour gone
    gov.tick()
    assert gov.threads == 2 and changes == [1, 2]


def test_an_idle_stretch_that_others_kept_busy_drops_a_thread_only_if_they_still_run():
    """A benchmark runs vLLM beside kvtier's idle engine: both cores busy for half a minute, then
    vLLM stops. That is not contention with kvtier's steps, so its next step keeps both threads.
    A neighbour that is still runnable when the steps resume (a `while True` beside a server
    between requests) sheds the thread at once, as without `rest()` (the contrast)."""
    for rested, runnable_now, want in ((True, False, []), (True, True, [1]), (False, False, [1])):
        proc, changes = FakeProc(), []
        gov = _governor(proc, changes)
        gov.tick()
        proc.advance(ct.INTERVAL_S, own_cpus=1.9, other_cpus=0.05)
        gov.tick()
        if rested:
            gov.rest()
        proc.advance(30.0, own_cpus=0.0, other_cpus=2.0)  # idle here, the other engine's run
        proc.running = 1 + 2 * runnable_now
        gov.tick()
        assert changes == want, (rested, runnable_now)


def test_steps_resuming_with_nothing_else_runnable_go_back_to_the_start_up_count(caplog):
    """Shed under a neighbour, then idle while another engine ran: the reading over the idle
    stretch is no evidence, so what is runnable at that moment decides. Nothing else: both threads
    at once (not after the first step, which at one thread can take seconds). Still a runnable
    neighbour: one thread, and the usual readings from there."""
    caplog.set_level(logging.INFO, logger="engine.runner.cpu_threads")
    for neighbour_runnable, want in ((False, [1, 2]), (True, [1])):
        proc, changes = FakeProc(), []
        gov = _governor(proc, changes)
        gov.tick()
        proc.advance(ct.INTERVAL_S, own_cpus=1.33, other_cpus=0.67)
        gov.tick()
        assert changes == [1]
        gov.rest()
        proc.advance(30.0, own_cpus=0.0, other_cpus=2.0)
        proc.running = 1 + 2 * neighbour_runnable
        gov.tick()
        assert changes == want, neighbour_runnable
    assert "1 -> 2: steps resume with no other process runnable" in caplog.text
    assert ct.procs_running(FakeProc().read("/proc/stat")) == 1 and ct.own_running_threads() >= 1


def test_the_engine_rests_its_governor_once_it_has_nothing_left(ckpt_dir, monkeypatch):
    """EngineCore calls `rest()` after the step that finishes its last request, not before."""
    from engine import LLM, SamplingParams

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    llm = LLM(str(ckpt_dir("llama")), dtype="float32", num_gpu_blocks=64, optimization_level=0, cpu_threads=2)
    try:
        gov, events = llm.engine.threads, []
        assert isinstance(gov, ThreadGovernor)
        monkeypatch.setattr(gov, "tick", lambda: events.append("tick"))
        monkeypatch.setattr(gov, "rest", lambda: events.append(("rest", llm.engine.has_unfinished())))
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        for _ in range(2):
            llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}], sp, use_tqdm=False)
            assert events[-1] == ("rest", False) and events.count(("rest", False)) == 1 and len(events) >= 4, events
            events.clear()
    finally:
        llm.close()


def test_an_engine_takes_its_thread_count_back_from_another_in_the_process(ckpt_dir):
    """torch's thread count is process-wide: an engine of 1 thread beside one of 2 (a benchmark, a
    tensor-parallel rank 0 beside a TP=1 engine) must not run its steps at the other's count."""
    import torch

    from engine import LLM, SamplingParams

    before = torch.get_num_threads()
    kw = dict(dtype="float32", num_gpu_blocks=64, optimization_level=0, adaptive_cpu_threads=False)
    one, two = (LLM(str(ckpt_dir("llama")), cpu_threads=n, **kw) for n in (1, 2))
    seen: dict[str, list[int]] = {"one": [], "two": []}
    try:
        for name, llm in (("one", one), ("two", two), ("one", one)):
            model = llm.engine.runner.model
            hook = model.register_forward_pre_hook(lambda *_a, name=name: seen[name].append(torch.get_num_threads()))
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
            hook.remove()
        assert set(seen["one"]) == {1} and set(seen["two"]) == {2}, seen
    finally:
        one.close()
        two.close()
        torch.set_num_threads(before)
