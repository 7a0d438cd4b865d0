"""Paged attention for prefill with cached context: varlen query chunks (a whole prompt, a
chunk of one, or the rest of a prompt after a prefix hit) attending, causally, to the cached
tokens before them and to themselves, with K/V read in place through the block table.

Contract (same as `reference.paged_prefill_ref`): `q [T, Hq, D]` holds every sequence's query
rows back to back, sequence b's rows being `cu_seqlens_q[b]:cu_seqlens_q[b+1]`; they are the
last positions of its `seq_lens[b]` cached tokens (their K/V already written by kv_write).
Row i of a chunk of n sits at position `seq_lens[b] - n + i` and attends keys j <= that
position (all keys when `causal=False`), and only the last `window` of them when `window > 0`.
"""
from __future__ import annotations

import torch

from engine.kernels._triton import check_device, dot_options, next_pow2, tl, triton
from engine.kernels.paged_decode import _LOG2E, _mma


@triton.jit
def _attend_tiles(acc, l_i, m, q, lo, hi, q_pos, seq_len, window, table, k_ptr, v_ptr, kvh,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale, d, dmask,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                  EVEN_D: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """Online softmax over keys [lo, hi). MASKED=False only for tiles every row sees entirely."""
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            in_ctx = pos < seq_len
            page = tl.load(table + pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
            kv_mask = in_ctx[:, None] & dmask[None, :]
        else:  # every key of the tile is in the context: only the head_dim padding needs a mask
            page = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
            kv_mask = dmask[None, :]
        row = pos % BLOCK_SIZE
        k_at = k_ptr + page[:, None] * stride_kb + row[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        v_at = v_ptr + page[:, None] * stride_vb + row[:, None] * stride_vs + kvh * stride_vh + d[None, :]
        if EVEN_D and not MASKED:
            k = tl.load(k_at).to(q.dtype)  # a cache in another dtype (--kv-cache-dtype) is read back in q's
        else:
            k = tl.load(k_at, mask=kv_mask, other=0.0).to(q.dtype)
        s = _mma(q, tl.trans(k), tl.zeros([q.shape[0], BLOCK_N], tl.float32), UPCAST, PREC) * qk_scale
        if MASKED:
            ok = (pos < seq_len)[None, :]
            if CAUSAL:
                ok = ok & (pos[None, :] <= q_pos[:, None])
            ok = ok & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A row may see nothing in a masked tile yet (m_new = -inf): exp2(-inf - 0) keeps it at 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if EVEN_D and not MASKED:
            v = tl.load(v_at).to(q.dtype)
        else:
            v = tl.load(v_at, mask=kv_mask, other=0.0).to(q.dtype)
        acc = _mma(p.to(v.dtype), v, acc * alpha[:, None], UPCAST, PREC)
        m = m_new
    return acc, l_i, m


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_q_ptr, lens_ptr, out_ptr, qk_scale, window, num_m_tiles,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, stride_ot, stride_oh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    b = tl.program_id(0)
    mt = num_m_tiles - 1 - tl.program_id(1)  # heaviest (last, most keys) tiles start first
    h = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if mt * BLOCK_M < q_len:
        seq_len = tl.load(lens_ptr + b)
        kvh = h // GROUP
        rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < q_len
        d = tl.arange(0, DIM_PAD)
        dmask = d < HEAD_DIM
        tok = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        q_pos = seq_len - q_len + rows
        first = seq_len - q_len + mt * BLOCK_M  # position of the tile's first and last valid rows
        last = tl.minimum(first + BLOCK_M, seq_len) - 1
        # Keys some row sees: [lo_any, hi_any); keys every row sees: [lo_all, hi_all).
        if CAUSAL:
            hi_any = last + 1
            hi_all = first + 1
        else:
            hi_any = seq_len
            hi_all = seq_len
        lo_any = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0)
        lo_all = tl.where(window > 0, tl.maximum(last - window + 1, 0), 0)
        # Masked tiles at both edges, unmasked full tiles between: most of a long context skips
        # the mask arithmetic.
        start = (lo_any // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(lo_all, BLOCK_N) * BLOCK_N
        full_hi = (hi_all // BLOCK_N) * BLOCK_N
        no_full = full_hi <= full_lo
        full_lo = tl.where(no_full, start, full_lo)
        full_hi = tl.where(no_full, start, full_hi)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        table = bt_ptr + b.to(tl.int64) * stride_bt
        acc, l_i, m = _attend_tiles(acc, l_i, m, q, start, full_lo, q_pos, seq_len, window, table, k_ptr, v_ptr, kvh,
                                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale, d, dmask,
                                  BLOCK_SIZE, BLOCK_N, True, CAUSAL, DIM_PAD == HEAD_DIM, UPCAST, PREC)
        acc, l_i, m = _attend_tiles(acc, l_i, m, q, full_lo, full_hi, q_pos, seq_len, window, table, k_ptr, v_ptr, kvh,
                                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale, d, dmask,
                                  BLOCK_SIZE, BLOCK_N, False, CAUSAL, DIM_PAD == HEAD_DIM, UPCAST, PREC)
        acc, l_i, m = _attend_tiles(acc, l_i, m, q, full_hi, hi_any, q_pos, seq_len, window, table, k_ptr, v_ptr, kvh,
                                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale, d, dmask,
                                  BLOCK_SIZE, BLOCK_N, True, CAUSAL, DIM_PAD == HEAD_DIM, UPCAST, PREC)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=rmask[:, None] & dmask[None, :])


def _config(dim_pad: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): for bf16/fp16 the best of a sweep on an H100
    (8k prompts, 2k chunks after 8k cached); fp32 tiles are smaller to fit shared memory;
    small tiles for the interpreter."""
    if device.type != "cuda":
        return 16, 16, 4, 1
    if dtype == torch.float32:
        return 64, 32, 4, 2
    if dim_pad <= 64:
        return 64, 64, 4, 3
    return 128, 128, 8, 3


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, *, max_query_len: int,
                  window: int = 0, causal: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill attention; see the module docstring. `cu_seqlens_q [B+1]`, `seq_lens [B]` and
    `block_tables [B, max_blocks]` are int32/int64 on q's device; `max_query_len` (host int, an
    upper bound) sizes the grid without a device sync. Returns `out [T, Hq, D]`."""
    check_device(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != dim or heads % kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("head_dim must be the contiguous dimension")
    out = torch.empty_like(q) if out is None else out
    batch = seq_lens.shape[0]
    if tokens == 0 or batch == 0 or max_query_len == 0:
        return out
    dim_pad = next_pow2(dim)
    block_m, block_n, warps, stages = _config(dim_pad, q.dtype, q.device)
    m_tiles = triton.cdiv(max_query_len, block_m)
    upcast, prec = dot_options(q.dtype, q.device)
    _prefill_kernel[(batch, m_tiles, heads)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, scale * _LOG2E, window, m_tiles,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_SIZE=k_cache.shape[1], GROUP=heads // kv_heads, HEAD_DIM=dim, DIM_PAD=dim_pad,
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, UPCAST=upcast, PREC=prec,
        num_warps=warps, num_stages=stages,
    )
    return out
