"""KV-cache write: a step's new keys and values go to their slots in the paged cache.

Contract (same as `reference.kv_write_ref`): row t of `k/v [T, kv_heads, head_dim]` is stored
at flat slot `slot_mapping[t]` = block * block_size + offset of the layer caches `[num_blocks,
block_size, kv_heads, head_dim]`; a negative slot (padding, e.g. in a CUDA-graph batch) is skipped.
"""
from __future__ import annotations

import torch

from engine.kernels._triton import check_device, next_pow2, tl, triton
from engine.model_config import FP8_DTYPES
from engine.runner.attention import quantize


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, HEADS_PAD)[:, None]
        d = tl.arange(0, DIM_PAD)[None, :]
        mask = (h < NUM_HEADS) & (d < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        tl.store(kc_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d, k, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d, v, mask=mask)


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write `k/v [T, kv_heads, head_dim]` into `k_cache/v_cache` at `slot_mapping [T]` (int32/int64).
    A cache in another dtype (--kv-cache-dtype) gets them rounded by torch first: to nearest even,
    as the other backends round (Triton's interpreter truncates in a kernel's cast); an fp8 one
    gets them divided by `k_scale`/`v_scale` and saturated (engine/runner/attention.quantize),
    and the kernel moves bytes."""
    check_device(k, v, k_cache, v_cache, slot_mapping)
    if k_cache.dtype in FP8_DTYPES:
        k, v = quantize(k, k_cache.dtype, k_scale), quantize(v, v_cache.dtype, v_scale)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    elif k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    num_tokens, heads, dim = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (heads, dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError("k/v must have the cache's dtype")
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("head_dim must be the contiguous dimension")
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], NUM_HEADS=heads, HEAD_DIM=dim,
        HEADS_PAD=next_pow2(heads), DIM_PAD=next_pow2(dim),
        num_warps=4 if heads * dim >= 1024 else 1,
    )
