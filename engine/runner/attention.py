"""Attention over the paged KV cache.

The backend interface is one class with one method so that Triton or CUDA kernels can be
added beside the torch path without touching the model code. The torch path here is the
reference: it is exact for any mix of prefill chunks and decodes in one batch.

Cache layout (per layer): K and V are each `[num_blocks, block_size, num_kv_heads, head_dim]`, heads
and dims contiguous; tokens may be further apart (a layer's part of a wider row, engine/kv/kv_groups.py).

The cache may have another dtype than q/k/v (--kv-cache-dtype): K and V are rounded to it when
written and read back in q's dtype, so attention computes in the model's dtype over rounded keys
and values. Every backend keeps that contract (the CPU kernels and Triton read the cache in place).
An fp8 cache holds K / k_scale and V / v_scale (the layer's `KVScale`, engine/runner/kv_quant.py):
attention multiplies the softmax scale by k_scale and the output by v_scale, which is attention
over the dequantized keys and values without a dequantized copy.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from engine.model_config import FP8_DTYPES, UNSCALED, KVScale




@dataclass
class PrefillSeq:
    """One sequence whose query has more than one token (a prompt or a prompt chunk).

    `block_ids` stay on the host (the Triton backend builds its tables from them once per step);
    the torch path copies them to the cache's device once per step, not once per layer."""

    query_start: int
    query_len: int
    context_len: int  # tokens in the cache after this step, including the query
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] int64
    first_block: int | None = None  # set when block_ids is one consecutive run: no gather needed
    # Image placeholders in the query, as [start, end) positions: a query inside one also sees
    # the span's later keys (Gemma 3's vision blocks attend both ways). A chunk never ends inside
    # one (engine/mm/inputs.py `MMInputs.cut`), so those keys are in this step.
    bidir: tuple[tuple[int, int], ...] = ()
    bidir_sliding_only: bool = False  # Gemma 4: the spans hold in sliding-window layers, not full ones

    _on_device: dict[tuple[str, torch.dtype | None], torch.Tensor] = field(default_factory=dict, repr=False)

    def block_ids_on(self, device: torch.device) -> torch.Tensor:
        key = (str(device), None)
        if key not in self._on_device:
            self._on_device[key] = self.block_ids.to(device)
        return self._on_device[key]

    def spans_for(self, window: int) -> tuple[tuple[int, int], ...]:
        """The image spans a layer attending within `window` (0: full attention) sees both ways."""
        return self.bidir if window > 0 or not self.bidir_sliding_only else ()

    def additive_mask(self, dtype: torch.dtype, device: torch.device, window: int = 0,
                      spans: tuple[tuple[int, int], ...] | None = None) -> torch.Tensor:
        """The causal mask of a chunk after cached tokens, `[query_len, context_len]`, as 0 / -inf
        in the query's dtype, built on first use and shared by every layer: given a bool mask,
        SDPA's CPU kernel converted it on each call (`aten::where`: 2.6 s of a 35 s 8k-token
        prefill in 2k chunks). (Splitting the chunk into context and causal parts merged by
        log-sum-exp was faster still, but moved hidden states ~1e-6 of their scale away from
        transformers'.) Query i sits at position context_len - query_len + i; with `window` > 0
        it sees only keys j with position - window < j (sliding-window layers). Inside a `bidir`
        span (`spans`, default `bidir`) it also sees the span's later keys (transformers' blockwise
        mask, under the window)."""
        spans = self.bidir if spans is None else spans
        key = (str(device), dtype, window, spans)
        if key not in self._on_device:
            rows = torch.arange(self.query_len, device=device).unsqueeze(1) + (self.context_len - self.query_len)
            cols = torch.arange(self.context_len, device=device).unsqueeze(0)
            last = rows.clone()  # each query's last visible key
            for a, b in spans:
                last[(rows >= a) & (rows < b)] = b - 1
            allowed = cols <= last
            if window > 0:
                allowed &= cols > rows - window
            zero = torch.zeros((), dtype=dtype, device=device)
            self._on_device[key] = torch.full(allowed.shape, float("-inf"), dtype=dtype, device=device).where(
                ~allowed, zero)
        return self._on_device[key]


@dataclass
class DecodeGroup:
    """Decodes of similar context length, batched into one padded attention call; for a backend
    that does not pad (`AttentionBackend.pads_decodes` False), all of a step's decodes, longest first.

    Grouping by length bounds the padding: one group for the whole batch would gather every
    sequence up to the longest one, and on the torch path that copy is most of decode attention's cost."""

    query_idx: torch.Tensor  # [n] int64 rows of the flat query
    block_tables: torch.Tensor  # [n, max_blocks] int64 (padded with 0)
    context_lens: torch.Tensor  # [n] int64 tokens each row attends to (its own included)
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool: True = attend


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    prefills: list[PrefillSeq]
    decodes: list[DecodeGroup]
    _packed: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    # Several KV groups (engine/kv/kv_groups.py): each group's own metadata (its block tables and
    # slots), and each layer's group. Empty with one group: every layer uses this object.
    groups: tuple[AttentionMetadata, ...] = ()
    layer_groups: tuple[int, ...] = ()

    @property
    def has_bidir(self) -> bool:
        """A prefill holds image placeholders (kernels without span masks hand the step to the torch path)."""
        return any(seq.bidir for seq in self.prefills)

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata decoder layer `layer` attends with."""
        return self.groups[self.layer_groups[layer]] if self.groups else self

    def packed_prefills(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefills without image spans (`bidir`: those need the torch path's mask) as one
        kernel call's input, built on first use and shared by every layer: `[n, 4]` int64 rows
        `(query_start, query_len, context_len, table_offset)` and every sequence's block ids
        concatenated (host tensors)."""
        if self._packed is None:
            rows, offset = [], 0
            plain = [seq for seq in self.prefills if not seq.bidir]
            for seq in plain:
                rows.append((seq.query_start, seq.query_len, seq.context_len, offset))
                offset += seq.block_ids.numel()
            tables = torch.cat([s.block_ids for s in plain]) if plain else torch.empty(0, dtype=torch.long)
            self._packed = (torch.tensor(rows, dtype=torch.long).view(-1, 4), tables.contiguous())
        return self._packed


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`x / scale` in an fp8 `dtype`, saturated at its largest finite value (e5m2 would round
    past it to inf; NaN stays NaN), as uint8 bytes: torch has no fp8 index_copy on CPU."""
    big = torch.finfo(dtype).max
    y = x if scale == 1.0 else x * (1.0 / scale)
    return y.clamp(-big, big).to(dtype).view(torch.uint8)


def as_stored(cache: torch.Tensor) -> torch.Tensor:
    """The cache as torch can index it: fp8 as its bytes (no fp8 index ops on CPU)."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scale: KVScale = UNSCALED) -> None:
    """Stores the step's K/V at their slots, rounded to the cache's dtype (a no-op cast when
    equal); into an fp8 cache, divided by the layer's scales first."""
    kv_heads, head_dim = k_cache.shape[2:]
    if k_cache.dtype in FP8_DTYPES:
        k, v = quantize(k, k_cache.dtype, kv_scale.k), quantize(v, v_cache.dtype, kv_scale.v)
    else:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    as_stored(k_cache).view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    as_stored(v_cache).view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


class AttentionBackend(ABC):
    """Contract: given this step's q/k/v (`[num_tokens, heads, head_dim]`), write k/v into the
    layer's cache at `meta.slot_mapping`, then return the attention output `[num_tokens,
    num_heads * head_dim]` where each token attends causally to its own sequence's cache: to
    every earlier key, or with `window` > 0 (a sliding-window layer) to keys j with
    position - window < j (the last `window` keys, its own included, as transformers masks).
    `kv_scale`: what an fp8 cache's K and V are divided by when written (`write_kv`) and multiplied
    by when read; other caches get `UNSCALED`."""

    # Whether decodes should come as groups of similar context length (a backend that pads every
    # row of a group to its longest): the model runner then bounds the padding. Kernels that take
    # each row's length get all decodes as one group, longest first.
    pads_decodes: ClassVar[bool] = True
    # Whether a prompt chunk of one token after cached context (the last prompt token after a prefix
    # or tier hit) should come as a prefill rather than a decode: a backend whose prefill gives every
    # row the bits of a fresh prefill wants it, so that a hit never changes an output.
    one_token_prefills: ClassVar[bool] = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        kv_scale: KVScale = UNSCALED,
    ) -> torch.Tensor: ...


def scale_values(out: torch.Tensor, kv_scale: KVScale) -> torch.Tensor:
    """Attention's output over V / v_scale, times v_scale (in place; nothing when unscaled)."""
    return out if kv_scale.v == 1.0 else out.mul_(kv_scale.v)


class TorchPagedAttention(AttentionBackend):
    def __init__(self) -> None:
        # Gathers write into persistent scratch: a fresh multi-MB tensor per layer per step
        # costs more in page faults than the copy itself (measured ~6x on CPU).
        self._scratch: dict[str, torch.Tensor] = {}

    def _gather(self, name: str, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """`cache[block_ids]` as `[len(block_ids) * block_size, kv_heads, head_dim]`."""
        num_blocks, block_size, kv_heads, head_dim = cache.shape
        numel = block_ids.numel() * block_size * kv_heads * head_dim
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != cache.dtype:
            buf = self._scratch[name] = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        src, dst = as_stored(cache), as_stored(buf)
        if cache.is_contiguous():
            torch.index_select(src.view(num_blocks, -1), 0, block_ids, out=dst[:numel].view(block_ids.numel(), -1))
        else:  # a layer's part of wider rows (engine/kv/kv_groups.py)
            torch.index_select(src, 0, block_ids, out=dst[:numel].view(-1, block_size, kv_heads, head_dim))
        return buf[:numel].view(-1, kv_heads, head_dim)

    def _context(self, name: str, cache: torch.Tensor, seq: PrefillSeq) -> torch.Tensor:
        """The sequence's cached K or V, `[context_len, kv_heads, head_dim]`."""
        if seq.first_block is not None:  # a view: skips a copy of the whole context per layer
            nb = seq.block_ids.numel()
            return cache[seq.first_block : seq.first_block + nb].flatten(0, 1)[: seq.context_len]
        return self._gather(name, cache, seq.block_ids_on(cache.device))[: seq.context_len]

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window=0, kv_scale=UNSCALED):
        num_tokens, num_heads, head_dim = q.shape
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scale)
        scale *= kv_scale.k
        out = torch.empty_like(q)
        for seq in meta.prefills:
            self._prefill(q, k_cache, v_cache, seq, scale, out, window)
        for group in meta.decodes:
            out.index_copy_(0, group.query_idx, self._decode(q, k_cache, v_cache, group, scale, window))
        return scale_values(out, kv_scale).view(num_tokens, num_heads * head_dim)

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: PrefillSeq,
                 scale: float, out: torch.Tensor, window: int = 0) -> None:
        """SDPA over the sequence's context (a view when its blocks are one run, else gathered)."""
        qs = q[seq.query_start : seq.query_start + seq.query_len].transpose(0, 1).unsqueeze(0)
        ks = self._context("k", k_cache, seq).to(q.dtype).transpose(0, 1).unsqueeze(0)
        vs = self._context("v", v_cache, seq).to(q.dtype).transpose(0, 1).unsqueeze(0)
        gqa = q.shape[1] != k_cache.shape[2]
        windowed = 0 < window < seq.context_len
        spans = seq.spans_for(window)
        if seq.query_len == seq.context_len and not windowed and not spans:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            mask = seq.additive_mask(q.dtype, q.device, window if windowed else 0, spans)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[seq.query_start : seq.query_start + seq.query_len] = o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
                scale: float, window: int = 0) -> torch.Tensor:
        """One query token per sequence as two batched GEMMs over (sequence, KV head) pairs, the
        query heads of a KV head stacked as rows. SDPA's CPU flash kernel tiles for long queries:
        for a batch of 64 one-token queries it took 4 ms a layer in fp32 and 14 ms in bf16 (79% of a
        bf16 decode step). The gathered context is made head-major once (one more copy) so that
        every GEMM reads contiguous rows."""
        n, heads, head_dim = group.block_tables.shape[0], q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[2]
        g = heads // kv_heads

        def context(name: str, cache: torch.Tensor) -> torch.Tensor:  # [n * kv_heads, ctx, head_dim]
            flat = self._gather(name, cache, group.block_tables.flatten()).view(n, -1, kv_heads, head_dim)
            return flat.transpose(1, 2).reshape(n * kv_heads, -1, head_dim).to(q.dtype)

        k, v = context("k", k_cache), context("v", v_cache)
        qd = q.index_select(0, group.query_idx).view(n * kv_heads, g, head_dim)
        scores = torch.bmm(qd, k.transpose(1, 2)).float().mul_(scale).view(n, kv_heads, g, -1)
        mask = group.mask
        if window > 0:  # keys before the last `window` of each row are out of its sight
            pos = torch.arange(mask.shape[-1], device=mask.device)
            mask = mask & (pos >= (group.context_lens - window).view(-1, 1, 1, 1))
        probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1)
        return torch.bmm(probs.to(v.dtype).view(n * kv_heads, g, -1), v).view(n, heads, head_dim)
