"""TritonPagedAttention (the CUDA backend) against the torch reference backend, on one step that
mixes everything the model runner emits: prompt chunks after cached context, a fresh prompt,
decodes in two length groups, and decode rows interleaved between the prefill rows."""
from __future__ import annotations

import pytest
import torch

from engine.runner.attention import AttentionMetadata, DecodeGroup, PrefillSeq, TorchPagedAttention

BS, KVH, HEADS, D = 16, 2, 6, 64


def _decode_group(rows: list[int], entries: list[tuple[int, list[int]]]) -> DecodeGroup:
    width = max(len(t) for _, t in entries)
    tables = torch.tensor([t + [0] * (width - len(t)) for _, t in entries])
    lens = torch.tensor([n for n, _ in entries])
    mask = (torch.arange(width * BS)[None, :] < lens[:, None])[:, None, None, :]
    return DecodeGroup(torch.tensor(rows), tables, lens, mask)


def _to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    groups = [DecodeGroup(g.query_idx.to(device), g.block_tables.to(device), g.context_lens.to(device),
                          g.mask.to(device)) for g in meta.decodes]
    return AttentionMetadata(meta.slot_mapping.to(device), meta.prefills, groups)


def _part_of_wider_rows(cache: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`cache` copied into the middle third of rows three times as wide (how G1 holds a layer
    narrower than the widest, engine/kv/kv_groups.py): a strided view."""
    nb, bs, h, d = cache.shape
    rows = torch.full((nb, bs, 3 * h * d), float("nan"), dtype=cache.dtype, device=device)
    view = rows.as_strided(cache.shape, (bs * 3 * h * d, 3 * h * d, d, 1), h * d)
    view.copy_(cache)
    return view


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_triton_backend_matches_torch_backend_on_a_mixed_step(device, dtype, layout):
    from engine.runner.attention_triton import TritonPagedAttention

    g = torch.Generator().manual_seed(11)
    k_cache = torch.randn(64, BS, KVH, D, generator=g).to(dtype)
    v_cache = torch.randn(64, BS, KVH, D, generator=g).to(dtype)
    # Row layout: prefill A (5 rows), decode, prefill B (36 rows), decode, prefill C (30), decode.
    prefills = [PrefillSeq(0, 5, 40, torch.tensor([10, 3, 7])),
                PrefillSeq(6, 36, 70, torch.tensor([20, 21, 22, 23, 24]), 20),
                PrefillSeq(43, 30, 30, torch.tensor([30, 31]), 30)]
    short = [(9, [40]), (33, [50, 51, 52])]
    long_ = [(150, [1, 2, 4, 5, 6, 8, 9, 11, 12, 13])]
    decodes = [_decode_group([5, 42], short), _decode_group([73], long_)]
    total = 74
    slots = [0] * total
    for p in prefills:
        for i, pos in enumerate(range(p.context_len - p.query_len, p.context_len)):
            slots[p.query_start + i] = int(p.block_ids[pos // BS]) * BS + pos % BS
    for row, (n, t) in zip([5, 42, 73], short + long_):
        slots[row] = t[(n - 1) // BS] * BS + (n - 1) % BS
    meta = AttentionMetadata(torch.tensor(slots), prefills, decodes)
    q = torch.randn(total, HEADS, D, generator=g).to(dtype)
    k = torch.randn(total, KVH, D, generator=g).to(dtype)
    v = torch.randn(total, KVH, D, generator=g).to(dtype)

    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    ref = TorchPagedAttention().forward(q.float(), k.float(), v.float(), ref_kc.float(), ref_vc.float(), meta, 0.125)
    kc, vc = k_cache.to(device), v_cache.to(device)
    if layout == "strided":
        kc, vc = _part_of_wider_rows(k_cache, device), _part_of_wider_rows(v_cache, device)
    backend = TritonPagedAttention()
    dmeta = _to(meta, device)
    got = backend.forward(q.to(device), k.to(device), v.to(device), kc, vc, dmeta, 0.125)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), ref, atol=tol, rtol=tol)
    # The K/V writes land at the same slots as the torch path's.
    TorchPagedAttention().forward(q, k, v, ref_kc, ref_vc, meta, 0.125)
    assert torch.equal(kc.cpu(), ref_kc) and torch.equal(vc.cpu(), ref_vc)
    # A second layer of the same step reuses the plan (and gives the same answer).
    again = backend.forward(q.to(device), k.to(device), v.to(device), kc, vc, dmeta, 0.125)
    assert torch.equal(again, got)
