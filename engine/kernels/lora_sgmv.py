"""Segmented gather matrix multiply (SGMV) for batched LoRA on the GPU, in one launch.

A step's rows come in segments, each a run of consecutive rows under one adapter slot (the
scheduler orders a step by adapter). For segment g (rows `starts[g] : starts[g] + lens[g]`, slot
`slots[g]`):

    out[rows, :N] (+)= x[rows, :K] @ w[slots[g], :K, :N]

LoRA runs it twice per projection: the shrink (`x @ A^T`, K = hidden, N = rank; `accumulate`
False) and the expand (`(x A^T) @ B^T` added into the base projection's output, K = rank; with
`accumulate`). `x`, `w` and `out` may be strided views (a part's columns of a fused output, its
rows of a block-diagonal B^T): every stride is passed. Contract (`reference.sgmv_ref`): the loop
of per-segment GEMMs. Rows outside every segment are untouched.

One program computes a BLOCK_M x BLOCK_N tile of one segment, looping over K in BLOCK_K steps with
fp32 accumulation; a program past its segment's rows returns at once, so the grid is sized from
host ints (the longest segment) and the launch never syncs with the device.
"""
from __future__ import annotations

import torch

from engine.kernels._triton import check_device, dot_options, next_pow2, tl, triton


@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, out_ptr, starts_ptr, lens_ptr, slots_ptr, K, N,
                 sxm, sxk, sws, swk, swn, som, son,
                 ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 UPCAST: tl.constexpr, PREC: tl.constexpr):
    g = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.load(lens_ptr + g)
    if m0 >= rows:
        return
    first = tl.load(starts_ptr + g).to(tl.int64)
    slot = tl.load(slots_ptr + g).to(tl.int64)
    m = m0 + tl.arange(0, BLOCK_M)
    m_ok = m < rows
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(x_ptr + (first + m)[:, None] * sxm + k[None, :] * sxk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + slot * sws + k[:, None] * swk + n[None, :] * swn, mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc, input_precision=PREC)
    at = out_ptr + (first + m)[:, None] * som + n[None, :] * son
    mask = m_ok[:, None] & n_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(at, mask=mask, other=0.0).to(tl.float32)
    tl.store(at, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sgmv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
         slots: torch.Tensor, max_len: int, accumulate: bool) -> torch.Tensor:
    """`out[rows of g] (+)= x[rows of g] @ w[slots[g]]` for every segment g (module docstring).

    x [T, K], w [S, K, N], out [T, N] (any strides); starts, lens, slots [G] int tensors on the
    device; `max_len`: a host int >= every lens[g] (sizes the grid). Returns `out`."""
    check_device(x, w, out, starts, lens, slots)
    if x.dim() != 2 or w.dim() != 3 or out.dim() != 2 or x.shape[1] != w.shape[1] or out.shape[1] != w.shape[2] \
            or out.shape[0] != x.shape[0]:
        raise ValueError(f"sgmv shapes: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    if not starts.numel() == lens.numel() == slots.numel():
        raise ValueError("sgmv: starts, lens and slots must have one entry per segment")
    groups, k, n = starts.numel(), x.shape[1], w.shape[2]
    if groups == 0 or max_len == 0 or n == 0:
        return out
    block_m = 16 if max_len <= 16 else 32 if max_len <= 32 else 64
    block_n = min(128, max(16, next_pow2(n)))
    block_k = min(64, max(16, next_pow2(k)))
    upcast, prec = dot_options(x.dtype, x.device)
    grid = (groups, triton.cdiv(max_len, block_m), triton.cdiv(n, block_n))
    _sgmv_kernel[grid](x, w, out, starts, lens, slots, k, n, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                       w.stride(2), out.stride(0), out.stride(1), ACCUMULATE=accumulate, BLOCK_M=block_m,
                       BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast, PREC=prec, num_warps=4)
    return out
