"""Attention on CPU through the C++ kernels (`engine/cpu_kernels`), which read K/V in place.

Decodes go through `paged_attention`, prompt chunks through `prefill_attention`: all of a step's
chunks in one call, causal without computing the masked part, and with each row's result
depending only on the row and its keys, so rows computed after a prefix hit equal, bit for bit,
the same rows of a fresh prefill (a prefix hit never changes an output). That includes a prompt
chunk of one token (the last prompt token after a prefix or tier hit): `one_token_prefills` has
the runner send it here rather than to `paged_attention`, whose row can differ from the prefill
kernel's in the last bits (1.8e-7 measured on random data). The torch path (SDPA
over the context) is kept for shapes the prefill kernel does not take, and for caches the kernels
do not read (a float16 one: `cpu_kernels.cache_supported`). An fp8 cache is read in place too,
each element widened in registers (engine/cpu_kernels/dtypes.h).
"""
from __future__ import annotations

import torch

from engine import cpu_kernels
from engine.runner.attention import UNSCALED, AttentionMetadata, TorchPagedAttention, scale_values, write_kv


class CpuPagedAttention(TorchPagedAttention):
    """Same contract and results as `TorchPagedAttention` (to float rounding); faster on CPU."""

    pads_decodes = False  # the kernel walks each row's own table; one call per layer balances best
    one_token_prefills = True  # the prefill kernel's rows do not depend on the chunk (its attend_rows)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale, window=0, kv_scale=UNSCALED):
        if not cpu_kernels.cache_supported(q.dtype, k_cache.dtype):  # e.g. a float16 cache: the torch path
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, window, kv_scale)
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = k_cache.shape[2]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scale)
        scale *= kv_scale.k
        # q may be a view into the fused q/k/v output: the kernels take its row stride as is.
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for group in meta.decodes:
            cpu_kernels.paged_attention(q, k_cache, v_cache, out, group.query_idx, group.block_tables,
                                        group.context_lens, scale, window)
        if meta.prefills:
            kernel = cpu_kernels.prefill_supported(num_heads, kv_heads, k_cache.shape[1])
            if kernel:  # every prefill but those with image spans (packed_prefills leaves them out)
                seqs, tables = meta.packed_prefills()
                if seqs.shape[0]:
                    cpu_kernels.prefill_attention(q, k_cache, v_cache, out, seqs, tables, scale, window)
            if not kernel or meta.has_bidir:  # the torch path: its mask has the spans
                q = q.contiguous()
                for seq in meta.prefills:
                    if not kernel or seq.bidir:
                        self._prefill(q, k_cache, v_cache, seq, scale, out, window)
        return scale_values(out, kv_scale).view(num_tokens, num_heads * head_dim)
