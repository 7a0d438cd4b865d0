"""G2's slab: host memory page-locked in chunks when a CUDA device will copy from it.

Why not `torch.empty(..., pin_memory=True)`: that is one cudaHostAlloc, which faults and locks every
page inside the driver (slow: minutes at 100+ GiB) and, like any single cudaHostRegister of 512 GiB
or more, fails outright on current drivers. Here the pages are faulted in by torch's threads
(`zero_`), then registered in spans of at most `MAX_REGISTER_BYTES`. Spans start on page boundaries
and end on slot boundaries, so no page is registered twice and no slot straddles two spans.
One copy must not cross from one span into the next: CUDA refuses an async copy whose host range
spans two registrations ("invalid argument", seen on an H200), so callers batch rows within a span
(`span_of`).
"""
from __future__ import annotations

import logging
import math
import weakref

import torch

log = logging.getLogger(__name__)

PAGE = 4096
MAX_REGISTER_BYTES = 64 * 2**30


def register_spans(num_rows: int, row_bytes: int, max_bytes: int = MAX_REGISTER_BYTES,
                   page: int = PAGE) -> list[tuple[int, int]]:
    """`(first_row, rows)` spans covering `num_rows` rows in order. Each span's byte length is a
    multiple of `page` (except the last) and at most `max_bytes`, unless the smallest page-aligned
    group of rows is larger than that, in which case each span is one such group."""
    if num_rows < 1 or row_bytes < 1 or max_bytes < 1:
        raise ValueError(f"bad slab shape: {num_rows} rows of {row_bytes} bytes, spans of {max_bytes}")
    group = page // math.gcd(row_bytes, page)  # fewest rows whose bytes are a whole number of pages
    per = max(group, (max_bytes // row_bytes) // group * group)
    return [(r, min(per, num_rows - r)) for r in range(0, num_rows, per)]


def _unregister(spans: list[tuple[int, int]]) -> None:
    cudart = torch.cuda.cudart()
    for ptr, _ in reversed(spans):
        cudart.cudaHostUnregister(ptr)
    spans.clear()


class HostSlab:
    """`tensor`: `[num_rows, row_bytes]` uint8, page-aligned, and page-locked when `pin`.
    The registration is undone when this object is collected. `tensor.is_pinned()` says False all
    the same: torch asks about its storage's first byte, which lies before the first page."""

    def __init__(self, num_rows: int, row_bytes: int, pin: bool, max_register_bytes: int | None = None):
        total = num_rows * row_bytes
        # Spans are laid out even when nothing is pinned, so a CPU run batches copies as a GPU one does.
        self._spans = register_spans(num_rows, row_bytes, MAX_REGISTER_BYTES if max_register_bytes is None
                                     else max_register_bytes)
        raw = torch.empty(total + PAGE, dtype=torch.uint8)
        offset = -raw.data_ptr() % PAGE
        self.tensor = raw[offset:offset + total].view(num_rows, row_bytes)
        self._registered: list[tuple[int, int]] = []  # (address, bytes), in order
        if pin:
            self._pin(row_bytes)
            weakref.finalize(self, _unregister, self._registered)

    def span_of(self, row: int) -> int:
        """Which registration span holds `row`: rows copied together must share one."""
        return row // self._spans[0][1]

    def _pin(self, row_bytes: int) -> None:
        self.tensor.zero_()  # fault the pages in on torch's threads, not inside the driver
        cudart = torch.cuda.cudart()
        spans = self._spans
        for i, (row, rows) in enumerate(spans):
            ptr, nbytes = self.tensor[row].data_ptr(), rows * row_bytes
            err = cudart.cudaHostRegister(ptr, nbytes, 0)
            if int(err) != 0:
                _unregister(self._registered)
                raise RuntimeError(f"G2: cudaHostRegister of {nbytes / 2**30:.1f} GiB failed ({err}); "
                                   "lower --kv-offloading-size")
            self._registered.append((ptr, nbytes))
            if len(spans) > 1:
                log.info("G2: page-locked %d/%d spans (%.0f GiB)", i + 1, len(spans),
                         (row + rows) * row_bytes / 2**30)

    @property
    def pinned_spans(self) -> list[tuple[int, int]]:
        """The page-locked `(address, bytes)` spans, in address order."""
        return list(self._registered)
