"""The shared-memory all-reduce that tensor-parallel ranks use for small tensors: against a plain
sum, with every rank getting the same bits, alternating buffers over many calls, and a timeout
(not a hang) when a rank never arrives. Two ranks are two threads here, each with its own handle
on the segment, as two processes would have."""
from __future__ import annotations

import threading

import pytest
import torch

from engine.parallel.shm import MAX_ELEMENTS, ShmAllReduce


def test_ranks_get_the_sum_in_the_same_bits_call_after_call():
    owner = ShmAllReduce(None, 0, 2, torch.float32, timeout_s=10)
    other = ShmAllReduce(owner.name, 1, 2, torch.float32, timeout_s=10)
    gen = torch.Generator().manual_seed(0)
    inputs = [[torch.randn(n, generator=gen) for n in (5, 4096, 577, 1)] * 3 for _ in range(2)]
    results: list[list[torch.Tensor]] = [[], []]

    def rank(r: int, handle: ShmAllReduce) -> None:
        for t in inputs[r]:
            t = t.clone()
            handle(t)
            results[r].append(t)

    threads = [threading.Thread(target=rank, args=(r, h)) for r, h in ((0, owner), (1, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results[0]) == len(results[1]) == len(inputs[0])
    for a, b, x, y in zip(results[0], results[1], inputs[0], inputs[1]):
        assert torch.equal(a, b)
        assert torch.equal(a, x + y)
    other.close()
    owner.close()


def test_what_does_not_fit_is_left_to_gloo_and_a_missing_rank_times_out():
    owner = ShmAllReduce(None, 0, 2, torch.float32, timeout_s=0.2)
    try:
        assert owner.fits(torch.zeros(MAX_ELEMENTS))
        assert not owner.fits(torch.zeros(MAX_ELEMENTS + 1))
        assert not owner.fits(torch.zeros(8, dtype=torch.bfloat16))
        assert not owner.fits(torch.zeros(8, 2).t())  # not contiguous
        with pytest.raises(RuntimeError, match="did not arrive"):
            owner(torch.zeros(8))
    finally:
        owner.close()
