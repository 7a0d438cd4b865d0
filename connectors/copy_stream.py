"""Where offload copies between G1 and host memory run.

On CUDA, a stream of their own, so the step loop's stream never waits behind them. Entering a
scope makes the copy stream wait for everything already queued on the device's default stream
(the forward that wrote a block being stored; the last reads of a G1 block a load overwrites);
leaving it waits for the scope's copies on the calling thread (the transfer thread), so a
LoadDone/StoreDone is only sent once its bytes are in place and the step loop never synchronizes.
On CPU both are no-ops.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class CopyStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def on_device(self) -> bool:
        return self._stream is not None

    @contextmanager
    def scope(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.default_stream(self.device))
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            self._stream.synchronize()
