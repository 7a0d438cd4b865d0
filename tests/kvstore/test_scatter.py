"""`kvstore.backend.Scatter`, a value's destination in pieces: its checks, and `moved`, which the
transfer engine uses to make hundreds of same-shaped targets per load without re-checking each."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.backend import Scatter


def test_shapes_and_lengths_are_checked() -> None:
    with pytest.raises(ValueError, match="1-D arrays"):
        Scatter(np.zeros(2, np.int64), np.ones(3, np.int64))
    with pytest.raises(ValueError, match="1-D arrays"):
        Scatter(np.zeros(0, np.int64), np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="positive"):
        Scatter(np.zeros(2, np.int64), np.array([4, 0], np.int64))
    assert Scatter(np.zeros(2, np.int64), np.array([4, 6], np.int64)).nbytes == 10


def test_moved_fills_other_memory_with_the_same_pieces() -> None:
    mem = torch.zeros(64, dtype=torch.uint8)
    base = mem.data_ptr()
    shape = Scatter(np.zeros(2, np.int64), np.array([3, 5], np.int64))
    moved = shape.moved(np.array([base + 10, base + 40], np.int64), keep=mem)
    assert (moved.nbytes, moved.keep) == (8, mem) and moved.lengths is shape.lengths
    for view, fill in zip(moved.views(), (1, 2)):
        view[:] = bytes([fill]) * len(view)
    want = torch.zeros(64, dtype=torch.uint8)
    want[10:13], want[40:45] = 1, 2
    assert torch.equal(mem, want)
    assert shape.keep is None and int(shape.addresses.sum()) == 0  # the original is unchanged


def test_moved_refuses_another_number_of_pieces() -> None:
    shape = Scatter(np.zeros(2, np.int64), np.array([3, 5], np.int64))
    with pytest.raises(ValueError, match="2,"):
        shape.moved(np.zeros(3, np.int64))
