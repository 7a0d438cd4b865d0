"""benchmarks/_proc_usage.py against real processes: a child that burns CPU counts in its parent's
tree but not in the parent alone, and shows up as another process's time in the parent's delta."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from bench_scripts import load_script

usage = load_script("_proc_usage.py", "bench_proc_usage")

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"

pytestmark = pytest.mark.skipif(not usage.PROC.is_dir(), reason="needs /proc (Linux)")


def test_a_child_burning_cpu_counts_in_the_tree_only():
    tree0, own0 = usage.tree_usage(), usage.tree_usage(children=False)
    child = subprocess.Popen([sys.executable, "-c", BURN + "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        # Let it burn, then read while it is still alive: /proc drops an exited child.
        deadline = time.monotonic() + 20
        while usage.usage_delta(tree0, usage.tree_usage())["cpu_s"] < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = usage.usage_delta(tree0, usage.tree_usage())
        own = usage.usage_delta(own0, usage.tree_usage(children=False))
    finally:
        child.communicate(b"")
    assert tree["cpu_s"] >= 0.5
    assert own["cpu_s"] < 0.3  # the parent mostly slept
    assert own["others_cpu_s"] >= 0.4  # the child's time is someone else's from the parent's view
    assert set(own) >= {"minflt", "majflt", "vol_switches", "invol_switches", "steal_s", "runnable_wait_s"}
    assert 0 <= own["runnable_wait_s"] < 1


def test_delta_leaves_out_missing_keys():
    d = usage.usage_delta({"cpu_s": 1.0, "minflt": 5}, {"cpu_s": 3.5, "majflt": 1})
    assert d == {"cpu_s": 2.5}
