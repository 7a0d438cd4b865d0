"""kvstore/threads.py: side threads run torch at one intra-op thread, and CopyPool's split copies
equal a plain copy_ (the oracle) for every shape and layout the offload loads use."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvstore.threads import CopyPool, one_torch_thread


def test_side_threads_get_one_torch_thread_and_leave_the_callers_alone():
    before = torch.get_num_threads()
    with ThreadPoolExecutor(1, initializer=one_torch_thread) as pool:
        assert pool.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", [(1, 2, 3), (2, 2, 4, 5), (5, 2, 3, 7), (30, 2, 1, 16, 3, 8)])
def test_split_copies_equal_a_plain_copy(threads, shape):
    pool = CopyPool(threads)
    try:
        src = torch.randn(*shape)
        dst = torch.zeros(*shape)
        pool.copy(dst, src)
        assert torch.equal(dst, src)
        # strided both ways, as the G2 -> G1 load copies a permuted slab into a slice of G1
        big = torch.zeros(shape[0], shape[1] + 2, *shape[2:])
        perm = src.transpose(0, 1).contiguous().transpose(0, 1)
        pool.copy(big[:, 1:1 + shape[1]], perm)
        assert torch.equal(big[:, 1:1 + shape[1]], src) and not big[:, 0].any() and not big[:, -1].any()
    finally:
        pool.close()
