"""Paged attention for decode: one query token per sequence, K/V read in place through the
block table, split along the context ("flash-decoding") so that a small batch of long
sequences still fills the GPU, then a reduce step merges the splits.

Contract (same as `reference.paged_decode_ref`): `q [B, Hq, D]`; sequence b's query sits at
position `seq_lens[b] - 1` and attends its first `seq_lens[b]` cached tokens (its own K/V
already written), restricted to the last `window` of them when `window > 0`. GQA: query head
h reads kv head `h // (Hq // Hkv)`. A row with `seq_lens[b] == 0` outputs zeros (padding).
"""
from __future__ import annotations

import math

import torch

from engine.kernels._triton import check_device, dot_options, next_pow2, num_sms, tl, triton

_LOG2E = 1.4426950408889634
_MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost (q load, partial write) dominates


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """acc + a @ b with fp32 accumulation (upcast for the interpreter, see _triton.dot_options)."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, window, num_splits,
    stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    # One program: one sequence, one kv head with all its GQA query heads (so K/V are read once
    # per group), one contiguous slice of the attended range.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    per = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per
    end = tl.minimum(start + per, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        page = tl.load(table + pos // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        row = pos % BLOCK_SIZE
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + page[:, None] * stride_kb + row[:, None] * stride_ks + kvh * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)  # a cache in another dtype is read back in q's
        s = _mma(q, tl.trans(k), tl.zeros([GROUP_PAD, BLOCK_N], tl.float32), UPCAST, PREC) * qk_scale
        s = tl.where(nmask[None, :], s, float("-inf"))
        # Every tile holds at least one valid key (n0 < end), so m_new is finite: no NaN guard.
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + page[:, None] * stride_vb + row[:, None] * stride_vs + kvh * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0).to(q.dtype)
        acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PREC)
        m = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # an empty split (or a padding row) leaves zeros
    o = acc / l_safe[:, None]
    omask = gmask[:, None] & dmask[None, :]
    if SPLIT:
        # Partials are [B, Hq, splits, DIM_PAD] fp32 with a base-2 log-sum-exp per row.
        prow = (b * NUM_HEADS + heads).to(tl.int64) * num_splits + split
        tl.store(part_o_ptr + prow[:, None] * DIM_PAD + d[None, :], o, mask=omask)
        lse = tl.where(l_i == 0.0, float("-inf"), m + tl.log2(l_safe))
        tl.store(part_lse_ptr + prow, lse, mask=gmask)
    else:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, num_splits, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    smask = s < num_splits
    prow = (b * NUM_HEADS + h).to(tl.int64) * num_splits + s
    lse = tl.load(part_lse_ptr + prow, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights 0, output 0
    w = tl.exp2(lse - m)
    o = tl.load(part_o_ptr + prow[:, None] * DIM_PAD + d[None, :], mask=smask[:, None], other=0.0)
    den = tl.sum(w, 0)
    res = tl.sum(o * w[:, None], 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _config(dim_pad: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the split kernel."""
    return (64 if dim_pad <= 128 else 32), 4, 2


def choose_splits(batch: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough splits for ~2 programs per SM, none shorter than _MIN_SPLIT_TOKENS. Depends only on
    host-side numbers, so a CUDA-graph capture size can fix it."""
    want = math.ceil(2 * num_sms(device) / max(1, batch * kv_heads))
    return max(1, min(want, math.ceil(max_seq_len / _MIN_SPLIT_TOKENS), 64))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, *, window: int = 0, max_seq_len: int | None = None,
                 num_splits: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention; see the module docstring. `block_tables [B, max_blocks]` and `seq_lens [B]`
    are int32/int64 on q's device. `max_seq_len` (host int, an upper bound; defaults to the table
    width) only sizes the split count; `num_splits` overrides it. Returns `out [B, Hq, D]`."""
    check_device(q, k_cache, v_cache, block_tables, seq_lens)
    batch, heads, dim = q.shape
    num_blocks, block_size, kv_heads, kdim = k_cache.shape
    if kdim != dim or heads % kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("head_dim must be the contiguous dimension")
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if window > 0:
        max_seq_len = min(max_seq_len, window)
    splits = num_splits or choose_splits(batch, kv_heads, max_seq_len, q.device)
    group = heads // kv_heads
    dim_pad = next_pow2(dim)
    upcast, prec = dot_options(q.dtype, q.device)
    block_n, warps, stages = _config(dim_pad, q.device)
    if splits > 1:
        part_o = torch.empty(batch, heads, splits, dim_pad, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    _decode_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse,
        scale * _LOG2E, window, splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=heads, BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=dim, DIM_PAD=dim_pad, BLOCK_N=block_n,
        SPLIT=splits > 1, UPCAST=upcast, PREC=prec, num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        _decode_reduce_kernel[(batch, heads)](
            part_o, part_lse, out, splits, out.stride(0), out.stride(1),
            NUM_HEADS=heads, HEAD_DIM=dim, DIM_PAD=dim_pad, SPLITS_PAD=max(2, next_pow2(splits)),
            num_warps=4 if dim_pad >= 128 else 2,
        )
    return out
