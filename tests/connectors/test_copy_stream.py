"""On CPU the copy stream is a no-op scope (the CUDA behaviour is in tests/gpu)."""
from __future__ import annotations

import pytest
import torch

from connectors.copy_stream import CopyStream


def test_cpu_scope_is_a_plain_block_and_propagates_errors():
    copies = CopyStream(torch.device("cpu"))
    assert not copies.on_device
    ran = []
    with copies.scope():
        ran.append(1)
    assert ran == [1]
    with pytest.raises(ValueError):
        with copies.scope():
            raise ValueError("a failed copy stays an error")
