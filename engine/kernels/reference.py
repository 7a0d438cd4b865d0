"""Plain-torch references for the Triton kernels: same signatures and contracts, written for
clarity, not speed (a Python loop over sequences). Tests compare each kernel against these.

Shapes (see engine/runner/attention.py): a layer's cache `k_cache`/`v_cache` is `[num_blocks,
block_size, kv_heads, head_dim]`; the full cache `[num_layers, 2, num_blocks, ...]`.
Window convention: a query at position p attends keys j with `p - window < j <= p` (`window`
keys, itself included, like Mistral's sliding window); `window <= 0` means the whole context.
"""
from __future__ import annotations

import torch


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
               window: int = 0, causal: bool = True) -> torch.Tensor:
    """Dense attention of `q [n, Hq, D]` at positions `q_pos [n]` over `k/v [ctx, Hkv, D]`, in fp32."""
    hq, hkv = q.shape[1], k.shape[1]
    kf = k.float().repeat_interleave(hq // hkv, dim=1)  # GQA: query head h reads kv head h // group
    vf = v.float().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    kpos = torch.arange(k.shape[0], device=q.device)
    allowed = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
    if causal:
        allowed &= kpos[None, :] <= q_pos[:, None]
    if window > 0:
        allowed &= kpos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing outputs 0
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)


def _context(cache: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    """A sequence's first `ctx` cached rows `[ctx, kv_heads, head_dim]`, read through its block table."""
    bs = cache.shape[1]
    nblocks = -(-ctx // bs)
    return cache[table[:nblocks].long()].flatten(0, 1)[:ctx]


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """One query token per sequence (`q [B, Hq, D]`) at position `seq_lens[b] - 1`."""
    out = torch.zeros_like(q)
    for b, ctx in enumerate(seq_lens.tolist()):
        if ctx == 0:  # a padding row (CUDA-graph batches): output 0
            continue
        k = _context(k_cache, block_tables[b], ctx)
        v = _context(v_cache, block_tables[b], ctx)
        pos = torch.tensor([ctx - 1], device=q.device)
        out[b] = attend_ref(q[b : b + 1], k, v, pos, scale, window)[0]
    return out


def paged_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int = 0,
                      causal: bool = True) -> torch.Tensor:
    """Varlen queries `q [T, Hq, D]`: sequence b owns rows `cu_seqlens_q[b]:cu_seqlens_q[b+1]`, which
    sit at the last positions of its `seq_lens[b]` cached tokens (their own K/V already written)."""
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    for b, ctx in enumerate(seq_lens.tolist()):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        k = _context(k_cache, block_tables[b], ctx)
        v = _context(v_cache, block_tables[b], ctx)
        pos = torch.arange(ctx - (e - s), ctx, device=q.device)
        out[s:e] = attend_ref(q[s:e], k, v, pos, scale, window, causal)
    return out


def kv_write_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Row t of `k/v [T, kv_heads, head_dim]` goes to flat slot `slot_mapping[t]`; negative slots skip."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    kvh, d = k_cache.shape[2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slots, k[keep])
    v_cache.view(-1, kvh, d).index_copy_(0, slots, v[keep])


def gather_blocks_ref(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None,
                      block_dim: int = 2) -> torch.Tensor:
    """`cache.index_select(block_dim, block_ids)`: e.g. `[L, 2, n, bs, H, D]` from the full cache."""
    if out is None:
        return cache.index_select(block_dim, block_ids.long())
    return torch.index_select(cache, block_dim, block_ids.long(), out=out)


def scatter_blocks_ref(src: torch.Tensor, block_ids: torch.Tensor, cache: torch.Tensor, block_dim: int = 2) -> None:
    """`cache.index_copy_(block_dim, block_ids, src)`: the inverse of gather (ids must be distinct)."""
    cache.index_copy_(block_dim, block_ids.long(), src)


def sgmv_ref(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
             slots: torch.Tensor, max_len: int, accumulate: bool) -> torch.Tensor:
    """`lora_sgmv.sgmv`'s contract: one GEMM per segment, in fp32."""
    for s, n, slot in zip(starts.tolist(), lens.tolist(), slots.tolist()):
        y = x[s:s + n].float() @ w[slot].float()
        out[s:s + n] = (out[s:s + n].float() + y if accumulate else y).to(out.dtype)
    return out
