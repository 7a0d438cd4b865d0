"""The G2 -> G1 load path against a one-block-at-a-time reference.

The connector copies runs of chunks whose G2 slots and G1 blocks are both consecutive in one
strided copy, and falls back to per-chunk copies otherwise. Every arrangement must place
exactly the same bytes as copying each G1 block on its own.
"""
from __future__ import annotations

import random

import pytest
import torch

from connectors.codec import BlockLayout, payload, write_header
from connectors.offload_plans import Chunk, LoadDone, LoadJob
from connectors.tiered import TieredOffloadConnector
from kvstore.g1 import BlockId, BlockPool
from kvstore.host import HostTier
from kvstore.keys import BlockKey
from policies import make_policy

NUM_G1 = 64


def make_connector(k: int, num_slots: int, dtype: torch.dtype = torch.float32) -> TieredOffloadConnector:
    layout = BlockLayout(num_layers=3, g1_blocks=k, block_size=4, kv_heads=2, head_dim=8,
                         dtype=dtype, fingerprint="test")
    g2 = HostTier(num_slots, layout.encoded_bytes, make_policy("lru"))
    conn = TieredOffloadConnector(layout, BlockPool(NUM_G1, make_policy("lru")), g2, [])
    conn.register_kv_caches(torch.zeros(3, 2, NUM_G1, 4, 2, 8, dtype=dtype))
    return conn


def fill_g2(conn: TieredOffloadConnector, n: int, slot_order: list[int]) -> list[Chunk]:
    """Stores n chunks with random payloads; chunk i lands in the slot given by slot_order."""
    g2 = conn.g2
    assert g2 is not None
    chunks = [Chunk(i, BlockKey(i.to_bytes(16, "little")), bytes([i]) * 16, "G2") for i in range(n)]
    for c in chunks:  # reserve slots 0..n-1, then hand them out in slot_order
        g2.prepare_store(c.key, c.digest)
    for c, slot in zip(chunks, slot_order):
        g2._pending[c.key] = slot  # noqa: SLF001 - arrange the slab layout under test
    for c in chunks:
        buf = g2.slot_view(g2._pending[c.key])  # noqa: SLF001
        write_header(buf, conn.layout.layout_id(), c.digest, conn.layout.payload_bytes)
        payload(buf, conn.layout).copy_(torch.randn(conn.layout.shape))
        g2.complete_store(c.key, True)
    return chunks


def reference(conn: TieredOffloadConnector, chunks: list[Chunk], first_g1: int, dst: list[int]) -> torch.Tensor:
    assert conn.g2 is not None and conn.transfer.kv_cache is not None
    out = conn.transfer.kv_cache.clone()
    k = conn.layout.g1_blocks
    for c in chunks:
        data = payload(conn.g2.slot_view(conn.g2._slot[c.key]), conn.layout)  # noqa: SLF001
        for b in range(k):
            g1_index = c.index * k + b
            if g1_index >= first_g1:
                out[:, :, dst[g1_index - first_g1]] = data[:, :, b]
    return out


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("arrangement", ["all-consecutive", "shuffled-slots", "shuffled-g1", "broken-runs"])
@pytest.mark.parametrize("partial_first", [False, True])
def test_batched_scatter_matches_per_block_copy(k: int, arrangement: str, partial_first: bool) -> None:
    n = 8
    rng = random.Random(f"{k}-{arrangement}-{partial_first}")
    slots = list(range(n))
    if arrangement == "shuffled-slots":
        rng.shuffle(slots)
    elif arrangement == "broken-runs":
        slots[3], slots[4] = slots[4], slots[3]
    conn = make_connector(k, n + 2)
    chunks = fill_g2(conn, n, slots)
    first_g1 = k // 2 if partial_first and k > 1 else 0  # chunk 0's first blocks already in G1
    dst = list(range(5, 5 + n * k - first_g1))
    if arrangement == "shuffled-g1":
        rng.shuffle(dst)
    elif arrangement == "broken-runs":
        dst[len(dst) // 2:] = [b + 20 for b in dst[len(dst) // 2:]]
    expected = reference(conn, chunks, first_g1, dst)
    assert conn.g2 is not None
    slots = dict(zip([c.key for c in chunks], conn.g2.prepare_load([c.key for c in chunks]) or []))
    job = LoadJob("r", tuple(chunks), first_g1, tuple(BlockId(b) for b in dst), (first_g1 + len(dst)) * 4, slots)
    conn.transfer.run_load(job)  # the transfer thread's body, run inline
    assert conn.transfer.reports.drain() == [LoadDone("r", (), group=0, num_filled=len(dst))]
    assert torch.equal(conn.transfer.kv_cache, expected)
    assert conn.transfer.tier_hits["G2"] == len(dst) * conn.layout.block_size
    conn.g2.check_integrity()
    conn.close()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_chunks_land_in_scattered_g1_blocks(dtype: torch.dtype) -> None:
    """An fp8 cache (--kv-cache-dtype fp8*): chunks into non-consecutive G1 blocks (the
    per-chunk copy, which torch does not do for fp8 on CPU) place the same bytes as one
    block at a time."""
    conn = make_connector(2, 8, dtype)
    chunks = fill_g2(conn, 4, [2, 0, 3, 1])
    dst = [40, 3, 17, 9, 30, 31, 5, 60]
    expected = reference(conn, chunks, 0, dst)
    assert conn.g2 is not None
    slots = dict(zip([c.key for c in chunks], conn.g2.prepare_load([c.key for c in chunks]) or []))
    conn.transfer.run_load(LoadJob("r", tuple(chunks), 0, tuple(BlockId(b) for b in dst), len(dst) * 4, slots))
    assert conn.transfer.reports.drain() == [LoadDone("r", (), group=0, num_filled=len(dst))]
    got = conn.transfer.kv_cache
    assert got is not None and got.dtype == dtype and got.view(torch.uint8).any()
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    conn.close()


def test_corrupt_chunk_stops_the_run_there() -> None:
    """A bad header in the middle of a consecutive run: the chunks before it land, none after."""
    conn = make_connector(2, 8)
    chunks = fill_g2(conn, 6, list(range(6)))
    assert conn.g2 is not None
    conn.g2.slot_view(conn.g2._slot[chunks[3].key])[0] ^= 0xFF  # noqa: SLF001 - flip the magic
    dst = list(range(10, 22))
    before = conn.transfer.kv_cache.clone()  # type: ignore[union-attr]
    expected = reference(conn, chunks[:3], 0, dst)
    slots = dict(zip([c.key for c in chunks], conn.g2.prepare_load([c.key for c in chunks]) or []))
    conn.transfer.run_load(LoadJob("r", tuple(chunks), 0, tuple(BlockId(b) for b in dst), len(dst) * 4, slots))
    (done,) = conn.transfer.reports.drain()
    assert done.failed_blocks == tuple(dst[6:])
    assert torch.equal(conn.transfer.kv_cache[:, :, 10:16], expected[:, :, 10:16])  # type: ignore[index]
    assert torch.equal(conn.transfer.kv_cache[:, :, 16:], before[:, :, 16:])  # type: ignore[index]
    assert conn.g2.stats.corrupt == 1
    conn.close()
