"""Where the transfer engine's bytes land in G1, and how they get there (worker side).

`G1Copies` owns the registered G1 cache (and the exported hidden-state cache, when the layout has
one), the threads that copy into it, the copy stream on its device, and the choice to stage host
bytes on that device first. The transfer engine decides what to copy; this copies it.
"""
from __future__ import annotations

import torch

from connectors.codec import HEADER_BYTES, BlockLayout, encode_blocks, hidden_payload, payload, write_header
from connectors.copy_stream import CopyStream
from connectors.offload_plans import LoadJob, StoreJob
from kvstore.g1 import BlockId
from kvstore.threads import CopyPool


class G1Copies:
    def __init__(self, layout: BlockLayout, g1_per_chunk: int) -> None:
        self.layout, self.g1_per_chunk = layout, g1_per_chunk
        self.layout_id = layout.layout_id()
        self.kv_cache: torch.Tensor | None = None
        self.hidden_cache: torch.Tensor | None = None  # exported hidden states, when the layout has them
        self.stage_on_device = False  # True once a CUDA cache is registered: loads stage bytes on it
        self.stream = CopyStream(torch.device("cpu"))  # re-made for the cache's device on register
        # As many copy threads as the forward uses (the constructing thread's count).
        self._pool = CopyPool(torch.get_num_threads())

    def register(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self.stream = CopyStream(kv_cache.device)
        self.stage_on_device = kv_cache.device.type != "cpu"  # see staged; tests set it on CPU

    def staged(self, rows: torch.Tensor) -> torch.Tensor:
        """Contiguous host bytes on the cache's device (as they are on CPU), in one DMA, so that the
        strided views the scatter copies from are read device-side. A cross-device `copy_` from a
        strided host view first makes it contiguous in a pageable host temporary on this thread:
        G2 loads ran at 1.2 GB/s that way on an H200 whose raw pinned copy moves 55 GB/s. Blocking:
        a G2 slot promoted from a lower tier is published before it lands, and a later read in
        the same load may take it over."""
        assert self.kv_cache is not None
        if not self.stage_on_device:
            return rows
        return rows.to(self.kv_cache.device, copy=True)

    def scatter(self, buf: torch.Tensor, chunk_index: int, job: LoadJob) -> int:
        """Copies the chunk's blocks that G1 lacks into their G1 blocks; returns how many."""
        k = self.g1_per_chunk
        buf = self.staged(buf)
        data = payload(buf, self.layout)
        lo = max(job.first_g1 - chunk_index * k, 0)  # blocks of this chunk already in G1 are skipped
        dst_start = chunk_index * k + lo - job.first_g1
        n = k - lo
        dst = job.dst[dst_start:dst_start + n]
        assert self.kv_cache is not None
        hid = hidden_payload(buf, self.layout)[lo:] if self.hidden_cache is not None else None
        if all(d == dst[0] + i for i, d in enumerate(dst)):  # the usual case: a strided copy,
            self.place(self.kv_cache[:, :, dst[0]:dst[0] + n], data[:, :, lo:])  # faster than index_copy_
            if hid is not None:
                self.hidden_cache[dst[0]:dst[0] + n].copy_(hid)  # type: ignore[index]
        else:
            idx = torch.tensor(dst, dtype=torch.long, device=self.kv_cache.device)
            cache, src = self.kv_cache, data[:, :, lo:]
            if self.layout.converts:
                src = self.layout.decode(src)
            elif cache.is_floating_point() and cache.element_size() == 1:  # fp8: no fp8 index_copy_ on CPU
                cache, src = cache.view(torch.uint8), src.view(torch.uint8)
            cache.index_copy_(2, idx, src)
            if hid is not None:
                self.hidden_cache.index_copy_(0, idx, hid)  # type: ignore[union-attr]
        return n

    def scatter_slab(self, slab_rows: torch.Tensor, first: BlockId) -> int:
        """`m` whole entries (G2 slab rows) into the consecutive G1 blocks from `first`, in one
        strided copy; returns the G1 blocks filled."""
        assert self.kv_cache is not None
        lay, k, m = self.layout, self.g1_per_chunk, slab_rows.shape[0]
        rows = self.staged(slab_rows)
        src = rows[:, HEADER_BYTES:HEADER_BYTES + lay.kv_bytes].view(lay.dtype)
        src = src.view(m, *lay.shape).permute(1, 2, 0, 3, 4, 5, 6)  # [L, 2, m, k, ...]
        dst = self.kv_cache[:, :, first:first + m * k]
        self.place(dst.view(*dst.shape[:2], m, k, *dst.shape[3:]), src)
        if self.hidden_cache is not None:
            hid = rows[:, HEADER_BYTES + lay.kv_bytes:HEADER_BYTES + lay.payload_bytes].view(lay.hidden_element)
            self.hidden_cache[first:first + m * k].view(m, *lay.hidden_shape).copy_(hid.view(m, *lay.hidden_shape))
        return m * k

    def place(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """An entry's KV into G1 blocks (`dst` a view of them): a parallel copy, widened and
        multiplied by the scales when entries hold a narrower dtype (--kv-offload-dtype)."""
        self._pool.copy(dst, src)
        if self.layout.kv_scales:
            dst.mul_(self.layout.decode_factors(dst))

    def gather(self, src: list[BlockId], buf: torch.Tensor, job: StoreJob) -> None:
        """A store's G1 blocks `src`, encoded (header and payload) into `buf`."""
        assert self.kv_cache is not None
        write_header(buf, self.layout_id, job.digest, self.layout.payload_bytes)
        encode_blocks(buf, self.layout, self.kv_cache, self.hidden_cache, src)

    def close(self) -> None:
        self._pool.close()
