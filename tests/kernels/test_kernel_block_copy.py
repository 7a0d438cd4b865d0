"""gather_blocks / scatter_blocks vs index_select / index_copy_ on the full 6-d cache layout."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test])")

from engine.kernels import gather_blocks, reference, scatter_blocks  # noqa: E402


@pytest.mark.parametrize("bs,heads,dim,dtype,id_dtype", [
    (16, 2, 64, torch.bfloat16, torch.int64),
    (32, 4, 128, torch.float32, torch.int32),  # 16384 elements per block: several programs each
])
def test_gather_scatter_full_cache(bs, heads, dim, dtype, id_dtype, device):
    gen = torch.Generator().manual_seed(bs + dim)
    layers, num_blocks = 3, 12
    cache = torch.randn(layers, 2, num_blocks, bs, heads, dim, generator=gen).to(dtype).to(device)
    ids = torch.tensor([7, 2, 2, 11, 0], dtype=id_dtype, device=device)  # any order, repeats allowed
    staged = gather_blocks(cache, ids)
    assert torch.equal(staged, reference.gather_blocks_ref(cache, ids))
    out = torch.empty_like(staged)
    assert gather_blocks(cache, ids, out=out) is out and torch.equal(out, staged)

    dst = torch.tensor([9, 1, 4], dtype=id_dtype, device=device)  # scatter: distinct ids
    src = torch.randn(layers, 2, 3, bs, heads, dim, generator=gen).to(dtype).to(device)
    want = cache.clone()
    reference.scatter_blocks_ref(src, dst, want)
    scatter_blocks(src, dst, cache)
    assert torch.equal(cache, want)


def test_block_dim_zero_hidden_cache(device):
    """Any contiguous tensor: the hidden-state cache `[num_blocks, bs, ids, hidden]` has blocks first."""
    cache = torch.randn(5, 16, 2, 48, device=device)
    ids = torch.tensor([4, 0, 3], device=device)
    staged = gather_blocks(cache, ids, block_dim=0)
    assert torch.equal(staged, cache[ids])
    cache2 = torch.zeros_like(cache)
    scatter_blocks(staged, ids, cache2, block_dim=0)
    assert torch.equal(cache2[ids], cache[ids]) and torch.count_nonzero(cache2[[1, 2]]) == 0


def test_wrong_staging_shape_is_refused(device):
    cache = torch.zeros(2, 2, 4, 16, 2, 64, device=device)
    with pytest.raises(ValueError, match="staging buffer"):
        gather_blocks(cache, torch.tensor([1, 2], device=device), out=torch.empty(2, 2, 3, 16, 2, 64, device=device))
