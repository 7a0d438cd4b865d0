"""Attention through the Triton kernels of `engine.kernels`: the backend for CUDA devices.

Per step, the `AttentionMetadata` the model runner built is turned once (first layer) into the
kernels' varlen form: the prefill rows packed with `cu_seqlens_q`, one padded block table for all
prefills and one for all decodes. The other layers reuse it. The kernels read K/V through the
block table in place; nothing is gathered.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import kernels
from engine.runner.attention import UNSCALED, AttentionBackend, AttentionMetadata, TorchPagedAttention, scale_values


@dataclass(frozen=True)
class _StepPlan:
    """The kernels' inputs for one step, shared by every layer."""

    prefill_rows: torch.Tensor | None  # [Tp] rows of q that are prefill queries; None = all rows, in order
    prefill_tables: torch.Tensor | None  # [P, max_blocks] int32
    cu_seqlens_q: torch.Tensor | None  # [P + 1] int32
    prefill_lens: torch.Tensor | None  # [P] int32 tokens in cache after this step
    max_query_len: int
    decode_rows: torch.Tensor | None  # [B] rows of q that are decodes
    decode_tables: torch.Tensor | None  # [B, max_blocks] int32
    decode_lens: torch.Tensor | None  # [B] int32
    max_decode_blocks: int  # a host bound, so the launch does not sync with the device


def _padded(tables: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1-D block-id rows (host tensors) as one int32 table padded with block 0 (never read: the lengths bound every access), one copy to `device`."""
    width = max(t.shape[-1] for t in tables)
    out = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, : t.shape[-1]] = t
    return out.to(device, non_blocking=True)


def plan_step(meta: AttentionMetadata, num_tokens: int, device: torch.device) -> _StepPlan:
    """The kernels' view of `meta` (host lists to device tensors, once per step)."""
    pre = meta.prefills
    prefill_rows = prefill_tables = cu = plens = None
    max_q = 0
    if pre:
        starts = [s.query_start for s in pre]
        lens_q = [s.query_len for s in pre]
        cu_list = [0]
        for n in lens_q:
            cu_list.append(cu_list[-1] + n)
        in_order = starts == cu_list[:-1] and cu_list[-1] == num_tokens
        if not in_order:
            prefill_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens_q)]).to(device)
        prefill_tables = _padded([s.block_ids for s in pre], device)
        cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
        plens = torch.tensor([s.context_len for s in pre], dtype=torch.int32, device=device)
        max_q = max(lens_q)
    drows = dtables = dlens = None
    max_d = 0
    if meta.decodes:
        drows = torch.cat([g.query_idx for g in meta.decodes])
        width = max(g.block_tables.shape[1] for g in meta.decodes)
        dtables = torch.cat([F.pad(g.block_tables, (0, width - g.block_tables.shape[1]))
                             for g in meta.decodes]).to(torch.int32)
        dlens = torch.cat([g.context_lens for g in meta.decodes]).to(torch.int32)
        # A host bound, so the kernel launch does not sync: every row fits in its padded table.
        max_d = dtables.shape[1]
    return _StepPlan(prefill_rows, prefill_tables, cu, plens, max_q, drows, dtables, dlens, max_d)


class TritonPagedAttention(AttentionBackend):
    """`AttentionBackend` on the Triton kernels: `kv_write`, one `paged_prefill` for every prompt
    chunk of the step, one `paged_decode` for every decode."""

    pads_decodes = False  # rows carry their own lengths

    def __init__(self) -> None:
        if not kernels.available():
            raise RuntimeError(f"the Triton attention backend cannot run here: {kernels.unavailable_reason()}")
        self._meta: AttentionMetadata | None = None
        self._plan: _StepPlan | None = None
        self._spans = TorchPagedAttention()  # steps with image spans: the kernels mask causally only

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window=0, kv_scale=UNSCALED):
        if meta.has_bidir:
            return self._spans.forward(q, k, v, k_cache, v_cache, meta, scale, window, kv_scale)
        num_tokens, num_heads, head_dim = q.shape
        if meta is not self._meta:  # first layer of a step
            self._plan, self._meta = plan_step(meta, num_tokens, q.device), meta
        plan = self._plan
        kernels.kv_write(k, v, k_cache, v_cache, meta.slot_mapping, kv_scale.k, kv_scale.v)
        scale *= kv_scale.k
        out = torch.empty_like(q)
        if plan.cu_seqlens_q is not None:
            qp = q if plan.prefill_rows is None else q.index_select(0, plan.prefill_rows)
            op = kernels.paged_prefill(qp, k_cache, v_cache, plan.prefill_tables, plan.cu_seqlens_q,
                                       plan.prefill_lens, scale, max_query_len=plan.max_query_len,
                                       window=window, out=out if plan.prefill_rows is None else None)
            if plan.prefill_rows is not None:
                out.index_copy_(0, plan.prefill_rows, op)
        if plan.decode_rows is not None:
            block_size = k_cache.shape[1]
            od = kernels.paged_decode(q.index_select(0, plan.decode_rows), k_cache, v_cache, plan.decode_tables,
                                      plan.decode_lens, scale, window=window,
                                      max_seq_len=plan.max_decode_blocks * block_size)
            out.index_copy_(0, plan.decode_rows, od)
        return scale_values(out, kv_scale).view(num_tokens, num_heads * head_dim)
