"""Attention on CPU through the C++ kernel (`engine/cpu_kernels`), which reads K/V in place.

Decodes go through the kernel. Prompt chunks keep the torch path (SDPA over the context,
gathered unless its blocks are one run), for two reasons:
- a chunk's attention costs query_len x context_len per layer while the gather costs context_len,
  so for all but the shortest chunks the copy is noise and SDPA's blocked GEMMs beat a row-at-a-time
  kernel;
- the rows of a chunk computed after a prefix hit must equal, bit for bit, the same rows computed
  in a fresh prefill (SDPA over the whole prompt), or a prefix hit could change an output; the
  kernel sums in another order than SDPA.
"""
from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.attention import AttentionMetadata, TorchPagedAttention


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
            self._prefill(q, k_cache, v_cache, seq, scale, out)
        return out.view(num_tokens, num_heads * head_dim)
