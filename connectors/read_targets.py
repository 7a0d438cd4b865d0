"""Where a storage tier's reads land when not in G2 (worker side): bounce buffers, or G1 itself.

An entry is `[connector header][KV: slots, 2, g1_blocks, block, ...][hidden states: g1_blocks, ...]`
(connectors/codec.py); G1 is `[slots, 2, num_blocks, block, ...]`. So an entry's KV is one piece
of G1 per (slot, K/V) and run of consecutive destination blocks, and its hidden states one piece
per run. A read into those pieces moves each byte once, where a read into a buffer and a copy into
G1 moved it twice (and a third time to check it): on a tmpfs G3 the copy was most of a hit's load
(docs/performance/tier-io.md).

Only for a G1 in host memory holding the entries' own dtype: a GPU's G1 is not a read target, and
a narrower offload dtype (`--kv-offload-dtype`) is converted by a copy anyway. Everything else is
read into bounce buffers and copied (connectors/offload_transfer.py).
"""
from __future__ import annotations

import numpy as np
import torch

from connectors.codec import HEADER_BYTES, BlockLayout, encode_blocks
from kvstore.backend import Scatter, ScatterBatch
from kvstore.g1 import BlockId


def _runs(blocks: list[BlockId]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive block ids, in order."""
    out: list[tuple[int, int]] = []
    for b in blocks:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


class G1Targets:
    """The pieces of a host G1 (and its hidden-state cache) that an entry's value fills."""

    def __init__(self, layout: BlockLayout, kv_cache: torch.Tensor, hidden_cache: torch.Tensor | None) -> None:
        assert self.usable(layout, kv_cache, hidden_cache)
        self.layout = layout
        self._kv, self._hidden = kv_cache, hidden_cache  # kept: the addresses are theirs
        slots, _, self.num_blocks = kv_cache.shape[:3]
        self.block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        self._hidden_bytes = hidden_cache[0].numel() * hidden_cache.element_size() if hidden_cache is not None else 0
        # Piece addresses of a run starting at block 0, in the value's order after its header:
        # one per (slot, K/V), then the hidden states'. A run at block b adds b * `_step`.
        rows = np.arange(slots * 2, dtype=np.int64) * self.num_blocks * self.block_bytes + kv_cache.data_ptr()
        self._at0 = np.concatenate([rows, [hidden_cache.data_ptr()] if hidden_cache is not None else []]).astype(np.int64)
        self._run_shapes: dict[int, Scatter] = {}  # run length -> its pieces' lengths (`_shape`)
        self._step = np.array([self.block_bytes] * len(rows) + ([self._hidden_bytes] if hidden_cache is not None else []),
                              dtype=np.int64)

    @staticmethod
    def usable(layout: BlockLayout, kv_cache: torch.Tensor | None, hidden_cache: torch.Tensor | None) -> bool:
        """Whether entries of `layout` can be read into this G1 as they are."""
        if kv_cache is None or kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            return False
        if layout.converts or layout.kv_scales or kv_cache.dtype != layout.dtype or kv_cache.dim() < 4:
            return False
        per_block = layout.block_size * layout.kv_heads * layout.head_dim
        if tuple(kv_cache.shape[:2]) != (layout.num_layers, 2) or kv_cache[0, 0, 0].numel() != per_block:
            return False
        if not layout.hidden_layer_ids:
            return True
        return (hidden_cache is not None and hidden_cache.device.type == "cpu" and hidden_cache.is_contiguous()
                and hidden_cache.dtype == layout.hidden_element
                and hidden_cache[0].numel() == layout.block_size * len(layout.hidden_layer_ids) * layout.hidden_size)

    def serves(self, kv_cache: torch.Tensor | None, hidden_cache: torch.Tensor | None) -> bool:
        """Whether these are the caches it was made for."""
        return kv_cache is self._kv and hidden_cache is self._hidden

    def scatters(self, headers: list[np.ndarray], blocks: list[list[BlockId]]) -> list[Scatter]:
        """The pieces the values of entries filling G1 `blocks[j]` (g1_blocks each, in order) are
        read into: entry j's header into `headers[j]` (HEADER_BYTES of uint8), the rest into G1.
        One array operation for the entries whose blocks are consecutive (nearly all: a load's
        blocks are mostly allocated in order); a load reads hundreds of entries."""
        runs = [_runs(b) for b in blocks]
        simple = [j for j, r in enumerate(runs) if len(r) == 1]
        out: list[Scatter | None] = [None] * len(blocks)
        if simple:
            table = np.empty((len(simple), 1 + len(self._at0)), dtype=np.int64)
            table[:, 0] = [headers[j].ctypes.data for j in simple]
            table[:, 1:] = self._at0[None, :] + self._step[None, :] * np.array([runs[j][0][0] for j in simple],
                                                                             dtype=np.int64)[:, None]
            for row, j in zip(table, simple):
                out[j] = self._shape(runs[j][0][1]).moved(row, keep=(headers[j], self._kv, self._hidden))
        for j, r in enumerate(runs):
            if out[j] is None:  # [pieces, runs]: piece-major, so each (slot, K/V) lists its runs in order
                first = np.array([b for b, _ in r], dtype=np.int64)
                count = np.array([n for _, n in r], dtype=np.int64)
                addrs = (self._at0[:, None] + self._step[:, None] * first[None, :]).ravel()
                lens = (self._step[:, None] * count[None, :]).ravel()
                out[j] = Scatter(np.concatenate(([headers[j].ctypes.data], addrs)),
                                 np.concatenate(([HEADER_BYTES], lens)), keep=(headers[j], self._kv, self._hidden))
        return out  # type: ignore[return-value]

    def batch(self, headers: np.ndarray, blocks: np.ndarray, bounce: dict[int, torch.Tensor]) -> ScatterBatch:
        """A load's entries as one ScatterBatch: entry j's value read into the G1 blocks `blocks[j]`
        (a row of an [n, g1_blocks] array; its header into `headers[j]`, a C-contiguous
        [n, HEADER_BYTES] uint8 array) or, for j in `bounce`, whole into `bounce[j]`. The usual
        load (every entry one run of blocks) takes a few array operations, whatever its size."""
        n, keep = len(blocks), (headers, self._kv, self._hidden, bounce)
        if not bounce and (blocks.shape[1] == 1 or (np.diff(blocks, axis=1) == 1).all()):
            table = np.empty((n, 1 + len(self._at0)), dtype=np.int64)
            table[:, 0] = headers.ctypes.data + HEADER_BYTES * np.arange(n, dtype=np.int64)
            table[:, 1:] = self._at0[None, :] + self._step[None, :] * blocks[:, :1]
            lens = np.tile(self._shape(blocks.shape[1]).lengths, n)
            return ScatterBatch(np.arange(n + 1, dtype=np.int64) * table.shape[1], table.ravel(), lens, keep=keep)
        direct = iter(self.scatters([headers[j] for j in range(n) if j not in bounce],
                                    [blocks[j].tolist() for j in range(n) if j not in bounce]))
        values = [whole(bounce[j]) if j in bounce else next(direct) for j in range(n)]
        return ScatterBatch(np.cumsum([0, *(len(v.addresses) for v in values)]).astype(np.int64),
                            np.concatenate([v.addresses for v in values]).astype(np.int64),
                            np.concatenate([v.lengths for v in values]).astype(np.int64), keep=keep)

    def _shape(self, n: int) -> Scatter:
        """The pieces of a value whose blocks are one run of n (header first), at no address:
        `moved` to each entry's."""
        got = self._run_shapes.get(n)
        if got is None:
            lengths = np.concatenate(([HEADER_BYTES], self._step * n)).astype(np.int64)
            got = self._run_shapes[n] = Scatter(np.zeros_like(lengths), lengths)
        return got

    def value(self, header: np.ndarray, blocks: list[BlockId]) -> bytes:
        """The entry's value as the tier holds it, from G1 (for a tier below that copies it)."""
        buf = torch.empty(self.layout.encoded_bytes, dtype=torch.uint8)
        buf[:HEADER_BYTES] = torch.from_numpy(header)
        encode_blocks(buf, self.layout, self._kv, self._hidden, blocks)
        return bytes(buf.numpy())

class ReadTargets:
    """The memory reads land in outside G2, owned by the transfer thread: `count` bounce buffers
    of an encoded block (page-locked for a GPU's G1: a copy from pageable memory goes through the
    driver's own staging, and G3 loads without G2 ran at 2.5 GB/s on an H200 that way), and G1 as
    a target (`G1Targets`)."""

    def __init__(self, layout: BlockLayout, count: int) -> None:
        self.layout = layout
        self._bounce: list[torch.Tensor | None] = [None] * count
        self._g1: G1Targets | None = None

    def bounce(self, i: int, pinned: bool) -> torch.Tensor:
        buf = self._bounce[i]
        if buf is None:
            buf = self._bounce[i] = torch.empty(self.layout.encoded_bytes, dtype=torch.uint8, pin_memory=pinned)
        return buf

    def g1(self, kv_cache: torch.Tensor | None, hidden_cache: torch.Tensor | None) -> G1Targets | None:
        """G1 as a read target, when it is in host memory in the entries' own dtype (else None)."""
        if self._g1 is None or not self._g1.serves(kv_cache, hidden_cache):
            usable = G1Targets.usable(self.layout, kv_cache, hidden_cache)
            self._g1 = G1Targets(self.layout, kv_cache, hidden_cache) if usable else None  # type: ignore[arg-type]
        return self._g1

    def abandon(self) -> None:
        """A read outlived its timeout and may still fill the buffers it was given: later reads
        get new ones (the old stay alive as long as that read holds them)."""
        self._bounce = [None] * len(self._bounce)


def whole(buf: torch.Tensor) -> Scatter:
    """A host buffer as a one-piece Scatter."""
    return Scatter(np.array([buf.data_ptr()], np.int64), np.array([buf.numel()], np.int64), keep=buf)
