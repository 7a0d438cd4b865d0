"""A forward's time, read after the fact (issue 42): the step-cost fits and the stats need the
device's time, and waiting for it right after the launch (`ModelRunner.synchronize`) would put a
bubble between every two steps. On CUDA two events on the step's stream bracket the forward and
are read when the step's results are (the host waits for them then anyway); elsewhere a forward
returns when it has run, and the wall clock is its time."""
from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        self._t0 = time.perf_counter()
        self._t1: float | None = None

    def stop(self) -> StepTimer:
        """Marks the end of the forward's launch (on CUDA, of its queued work)."""
        if self._cuda:
            self._end.record()
        self._t1 = time.perf_counter()
        return self

    def seconds(self) -> float:
        """The forward's time; on CUDA, waits for its end event."""
        if self._t1 is None:
            raise RuntimeError("StepTimer.seconds() before stop()")
        if self._cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3
        return self._t1 - self._t0
