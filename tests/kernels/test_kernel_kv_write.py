"""kv_write vs its torch reference (index_copy_ by slot): exact, padding slots skipped."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test])")

from engine.kernels import kv_write, reference  # noqa: E402


@pytest.mark.parametrize("heads,dim,bs,dtype,slot_dtype", [
    (2, 64, 16, torch.float32, torch.int64),
    (8, 128, 32, torch.bfloat16, torch.int32),
    (3, 80, 16, torch.bfloat16, torch.int64),  # neither heads nor head_dim a power of two
])
def test_kv_write(heads, dim, bs, dtype, slot_dtype, device):
    gen = torch.Generator().manual_seed(heads * dim)
    num_blocks, tokens = 6, 23
    k_cache = torch.randn(num_blocks, bs, heads, dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, bs, heads, dim, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:tokens]
    slots[[3, 11]] = -1  # padding rows: must not be written anywhere
    slots = slots.to(slot_dtype).to(device)
    # Strided k/v, as sliced out of a fused qkv projection: rows are not contiguous.
    qkv = torch.randn(tokens, 3, heads, dim, generator=gen).to(dtype).to(device)
    k, v = qkv[:, 1], qkv[:, 2]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.kv_write_ref(k, v, want_k, want_v, slots)
    kv_write(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_kv_write_layer_view_of_full_cache(device):
    """The engine's layer caches are views `kv_cache[layer, 0|1]` of one 6-d tensor."""
    full = torch.zeros(3, 2, 4, 16, 2, 64, device=device)
    k = torch.randn(5, 2, 64, device=device)
    v = torch.randn(5, 2, 64, device=device)
    slots = torch.tensor([0, 17, 63, 40, 5], device=device)
    kv_write(k, v, full[1, 0], full[1, 1], slots)
    want = torch.zeros_like(full)
    reference.kv_write_ref(k, v, want[1, 0], want[1, 1], slots)
    assert torch.equal(full, want)
