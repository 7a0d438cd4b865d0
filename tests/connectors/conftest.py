"""Fixtures shared by the offload tests."""
from __future__ import annotations

import pytest

from offload_helpers import KIND


@pytest.fixture(scope="module")
def model_dir(ckpt_dir):
    """The checkpoint every offload test runs on (see offload_helpers.KIND)."""
    return ckpt_dir(KIND)
