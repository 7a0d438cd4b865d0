"""benchmarks/_common.py's JsonWorker: a real worker process answering on its pipe, stopped
(SIGSTOP) while idle so that it takes no CPU from the engine being timed, and still answering and
closing cleanly after a pause."""
from __future__ import annotations

import sys
from pathlib import Path

from bench_scripts import load_script

common = load_script("_common.py", "bench_common")

WORKER = """
import sys, time
sys.path.insert(0, {bench!r})
from _common import worker_reply
send = worker_reply(int(sys.argv[-1]))
send(ready=True)
for cmd in sys.stdin:
    if cmd.strip() != "tick":
        break
    send(t=time.monotonic())
"""


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_paused_worker_is_stopped_then_answers_and_closes(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(bench=str(Path(common.__file__).parent)))
    w = common.JsonWorker([sys.executable, str(script)], {}, tmp_path, name="tiny")
    try:
        assert w.recv(60) == {"ready": True}
        w.pause()  # returns once every thread has stopped: no wake-ups while another engine is timed
        assert state(w.proc.pid) == "T" and common._group_stopped(w.proc.pid)
        w.resume()
        w.send("tick")
        assert "t" in w.recv(60)
        w.pause()
    finally:
        w.close()  # resumes first: a stopped worker would never read "quit"
    assert w.proc.returncode == 0
