"""--kv-cache-dtype on the Triton backend: float32 q/k/v over a bfloat16 or fp8 cache. kv_write
rounds the step's K/V into the cache, and prefill and decode read it back in q's dtype: the result
is the torch backend's on the same inputs (which computes float32 attention over the rounded K/V)."""
from __future__ import annotations

import pytest
import torch

from engine.model_config import UNSCALED, KVScale
from engine.runner.attention import AttentionMetadata, DecodeGroup, PrefillSeq, TorchPagedAttention

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test])")

BS, KVH, HEADS, D = 16, 2, 4, 64


def run_both(device, cache_dtype: torch.dtype, kv_scale, seed: int):
    """A chunk of 5 after 35 cached tokens, a fresh 20-token prompt and one decode at length 30,
    over a random `cache_dtype` cache: (the torch backend's output and caches, Triton's output
    and caches on `device`), float32 q/k/v."""
    from engine.runner.attention_triton import TritonPagedAttention

    g = torch.Generator().manual_seed(seed)
    k_cache = (torch.randn(32, BS, KVH, D, generator=g) / kv_scale.k).to(cache_dtype)
    v_cache = (torch.randn(32, BS, KVH, D, generator=g) / kv_scale.v).to(cache_dtype)
    prefills = [PrefillSeq(0, 5, 40, torch.tensor([10, 3, 7])), PrefillSeq(5, 20, 20, torch.tensor([20, 21]), 20)]
    tables, lens = torch.tensor([[12, 13]]), torch.tensor([30])
    mask = (torch.arange(2 * BS)[None, :] < lens[:, None])[:, None, None, :]
    decodes = [DecodeGroup(torch.tensor([25]), tables, lens, mask)]
    slots = [int(p.block_ids[pos // BS]) * BS + pos % BS for p in prefills
             for pos in range(p.context_len - p.query_len, p.context_len)] + [13 * BS + 29 % BS]
    meta = AttentionMetadata(torch.tensor(slots), prefills, decodes)
    q, k, v = (torch.randn(26, h, D, generator=g) for h in (HEADS, KVH, KVH))
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    ref = TorchPagedAttention().forward(q, k, v, ref_kc, ref_vc, meta, 0.125, 0, kv_scale)
    kc, vc = k_cache.to(device), v_cache.to(device)
    dmeta = AttentionMetadata(meta.slot_mapping.to(device), prefills,
                              [DecodeGroup(*(t.to(device) for t in (d.query_idx, d.block_tables, d.context_lens,
                                                                     d.mask))) for d in decodes])
    got = TritonPagedAttention().forward(q.to(device), k.to(device), v.to(device), kc, vc, dmeta, 0.125, 0, kv_scale)
    return (ref, ref_kc, ref_vc), (got, kc, vc)


def test_triton_backend_reads_a_bfloat16_cache_under_float32_q(device):
    (ref, ref_kc, ref_vc), (got, kc, vc) = run_both(device, torch.bfloat16, UNSCALED, 17)
    assert got.dtype == torch.float32 and kc.dtype == torch.bfloat16
    assert torch.equal(kc.cpu(), ref_kc) and torch.equal(vc.cpu(), ref_vc)  # the same rounded writes
    torch.testing.assert_close(got.cpu(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_triton_backend_reads_an_fp8_cache_with_scales(device, dt):
    """An fp8 cache with per-layer scales (--kv-cache-dtype fp8*): kv_write stores the same
    quantized bytes as the torch backend, and prefill and decode equal its attention over the
    dequantized values."""
    (ref, ref_kc, ref_vc), (got, kc, vc) = run_both(device, dt, KVScale(0.5, 0.25), 19)
    assert got.dtype == torch.float32 and kc.dtype == dt
    assert torch.equal(kc.cpu().view(torch.uint8), ref_kc.view(torch.uint8))
    assert torch.equal(vc.cpu().view(torch.uint8), ref_vc.view(torch.uint8))
    torch.testing.assert_close(got.cpu(), ref, atol=1e-5, rtol=1e-5)
