"""Attention on CPU through the C++ kernel (`engine/cpu_kernels`), which reads K/V in place.

Decodes and short prompt chunks (up to `IN_PLACE_MAX_QUERY` tokens, e.g. the new tokens after a
prefix hit) go through the kernel, one query row at a time with its own causal length. Longer
chunks keep the torch path (SDPA over the gathered context): their attention costs
query_len x context_len per layer while the gather costs context_len, so the copy is under 1% of
their time and SDPA's blocked GEMMs beat a row-at-a-time kernel there.
"""
from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.attention import AttentionMetadata, PrefillSeq, TorchPagedAttention

IN_PLACE_MAX_QUERY = 16


def _chunk_rows(seq: PrefillSeq) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel rows for a short chunk: row i sits at position context_len - query_len + i."""
    n = seq.query_len
    rows = torch.arange(seq.query_start, seq.query_start + n)
    lens = torch.arange(seq.context_len - n + 1, seq.context_len + 1)
    return rows, seq.block_ids.unsqueeze(0).expand(n, -1).contiguous(), lens


class CpuPagedAttention(TorchPagedAttention):
    """Same contract and results as `TorchPagedAttention` (to float rounding); faster on CPU."""

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale):
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        q = q.contiguous()
        out = torch.empty_like(q)
        for group in meta.decodes:
            cpu_kernels.paged_attention(q, k_cache, v_cache, out, group.query_idx, group.block_tables,
                                        group.context_lens, scale)
        for seq in meta.prefills:
            if seq.query_len <= IN_PLACE_MAX_QUERY:
                rows, tables, lens = _chunk_rows(seq)
                cpu_kernels.paged_attention(q, k_cache, v_cache, out, rows, tables, lens, scale)
            else:
                self._prefill(q, k_cache, v_cache, seq, scale, out)
        return out.view(num_tokens, num_heads * head_dim)
