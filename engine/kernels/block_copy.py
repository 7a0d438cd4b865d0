"""Block gather and scatter between the G1 cache and a contiguous staging buffer, in one launch.

Offload moves a block across all layers: with the full cache `[num_layers, 2, num_blocks,
block_size, kv_heads, head_dim]` and `block_dim=2`, gathering n ids fills a staging buffer
`[num_layers, 2, n, block_size, kv_heads, head_dim]`, the layout of an encoded block's payload
(connectors/codec.py). Any contiguous tensor works: dims before `block_dim` are "planes",
dims after it one block's elements (e.g. the hidden-state cache with `block_dim=0`).
Contract (`reference.gather_blocks_ref` / `scatter_blocks_ref`): gather = index_select,
scatter = index_copy_ (scatter ids must be distinct).
"""
from __future__ import annotations

import math

import torch

from engine.kernels._triton import check_device, tl, triton

_BLOCK_ELEMS = 4096  # elements per program: 8 KiB of bf16, enough in flight per SM to saturate HBM
_WARPS = 4


@triton.jit
def _block_copy_kernel(
    cache_ptr, stage_ptr, ids_ptr, elems, stride_cp, stride_sp,
    TO_STAGE: tl.constexpr, BLOCK_E: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)  # position in the id list = block index in the staging buffer
    plane = tl.program_id(1).to(tl.int64)
    blk = tl.load(ids_ptr + i).to(tl.int64)
    offs = tl.program_id(2).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = offs < elems
    cache_at = cache_ptr + plane * stride_cp + blk * elems + offs
    stage_at = stage_ptr + plane * stride_sp + i * elems + offs
    if TO_STAGE:
        tl.store(stage_at, tl.load(cache_at, mask=mask), mask=mask)
    else:
        tl.store(cache_at, tl.load(stage_at, mask=mask), mask=mask)


def _launch(cache: torch.Tensor, stage: torch.Tensor, block_ids: torch.Tensor, block_dim: int, to_stage: bool) -> None:
    check_device(cache, stage, block_ids)
    n = block_ids.numel()
    want = cache.shape[:block_dim] + (n,) + cache.shape[block_dim + 1:]
    if stage.shape != want:
        raise ValueError(f"staging buffer is {tuple(stage.shape)}, expected {tuple(want)}")
    if stage.dtype != cache.dtype or not cache.is_contiguous() or not stage.is_contiguous():
        raise ValueError("cache and staging buffer must be contiguous and of one dtype")
    if n == 0 or stage.numel() == 0:
        return
    planes = math.prod(cache.shape[:block_dim])
    elems = math.prod(cache.shape[block_dim + 1:])
    grid = (n, planes, triton.cdiv(elems, _BLOCK_ELEMS))
    _block_copy_kernel[grid](
        cache, stage, block_ids, elems, cache.shape[block_dim] * elems, n * elems,
        TO_STAGE=to_stage, BLOCK_E=_BLOCK_ELEMS, num_warps=_WARPS,
    )


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None,
                  block_dim: int = 2) -> torch.Tensor:
    """Copy blocks `block_ids` (int32/int64, repeats allowed) of `cache` into `out` (allocated if None)."""
    if out is None:
        shape = cache.shape[:block_dim] + (block_ids.numel(),) + cache.shape[block_dim + 1:]
        out = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    _launch(cache, out, block_ids, block_dim, to_stage=True)
    return out


def scatter_blocks(src: torch.Tensor, block_ids: torch.Tensor, cache: torch.Tensor, block_dim: int = 2) -> None:
    """Copy staging `src` back into `cache` at distinct `block_ids` (the inverse of `gather_blocks`)."""
    _launch(cache, src, block_ids, block_dim, to_stage=False)
