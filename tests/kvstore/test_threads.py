"""kvstore/threads.py: side threads run torch at one intra-op thread, and CopyPool's split copies
equal a plain copy_ (the oracle) for every shape and layout the offload loads use."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvstore.threads import CopyPool, DaemonPool, one_torch_thread


def test_side_threads_get_one_torch_thread_and_leave_the_callers_alone():
    before = torch.get_num_threads()
    with ThreadPoolExecutor(1, initializer=one_torch_thread) as pool:
        assert pool.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", [(1, 2, 3), (2, 2, 4, 5), (5, 2, 3, 7), (30, 2, 1, 16, 3, 8)])
def test_split_copies_equal_a_plain_copy(threads, shape):
    pool = CopyPool(threads)
    try:
        src = torch.randn(*shape)
        dst = torch.zeros(*shape)
        pool.copy(dst, src)
        assert torch.equal(dst, src)
        # strided both ways, as the G2 -> G1 load copies a permuted slab into a slice of G1
        big = torch.zeros(shape[0], shape[1] + 2, *shape[2:])
        perm = src.transpose(0, 1).contiguous().transpose(0, 1)
        pool.copy(big[:, 1:1 + shape[1]], perm)
        assert torch.equal(big[:, 1:1 + shape[1]], src) and not big[:, 0].any() and not big[:, -1].any()
    finally:
        pool.close()


def test_daemon_pool_runs_tasks_and_never_waits_forever_on_a_stuck_one():
    """Issue 38: a tier read stuck in the kernel held the engine core's shutdown (and its exit:
    ThreadPoolExecutor joins its workers at interpreter exit). A DaemonPool's shutdown waits a
    bounded time, its workers are daemons, and a stuck worker can be replaced."""
    import subprocess
    import sys
    import threading
    import time

    from kvstore.threads import DaemonPool

    pool = DaemonPool(2, "test-pool", initializer=one_torch_thread)
    assert pool.submit(torch.get_num_threads).result(5) == 1
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    release = threading.Event()
    stuck = [pool.submit(release.wait) for _ in range(2)]  # both workers busy
    assert pool.replace_stuck() and pool.replace_stuck()
    assert pool.submit(lambda: 7).result(5) == 7  # served by a replacement
    assert not pool.replace_stuck()  # the spares are spent
    t0 = time.monotonic()
    assert pool.shutdown(0.2) is False  # two workers still stuck
    assert time.monotonic() - t0 < 2
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: 0)
    release.set()
    assert all(f.result(5) for f in stuck)
    # a process whose pool worker never returns still exits
    code = ("import threading; from kvstore.threads import DaemonPool; p = DaemonPool(1, 'x'); "
            "p.submit(threading.Event().wait); print(p.shutdown(0.1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_a_replaced_stuck_worker_leaves_once_its_task_ends():
    import threading
    import time

    release, took = threading.Event(), []
    pool = DaemonPool(1, "t-retire", spares=1)
    try:
        stuck = pool.submit(lambda: (took.append(threading.current_thread()), release.wait())[0])
        while not took:
            time.sleep(0.01)
        assert pool.replace_stuck(took[0]) and not pool.replace_stuck(took[0])  # one spare only
        assert pool.submit(lambda: threading.current_thread()).result(5) is not took[0]  # the spare serves
        release.set()
        stuck.result(5)
        took[0].join(5)
        assert not took[0].is_alive()  # it left; the spare goes on
        assert pool.submit(lambda: 7).result(5) == 7
        # ...and gave its place back: the next stuck worker can be replaced too (a lifetime count
        # of spares ran out on a long-lived server after a few slow compiles, and stayed out)
        release2, took2 = threading.Event(), []
        stuck2 = pool.submit(lambda: (took2.append(threading.current_thread()), release2.wait())[0])
        while not took2:
            time.sleep(0.01)
        assert pool.replace_stuck(took2[0]) and not pool.replace_stuck(took2[0])
        assert pool.submit(lambda: 8).result(5) == 8
        release2.set()
        stuck2.result(5)
    finally:
        release.set()
        pool.shutdown(1.0)
