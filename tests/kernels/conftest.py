"""Kernel tests run on the GPU when there is one, else on CPU under the Triton interpreter.

TRITON_INTERPRET is read when a kernel is defined, so it is set here, before any test module
imports engine.kernels."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernels run; skips when they cannot run in this process."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test])")
    import importlib

    import engine.kernels as K

    mod = importlib.import_module("engine.kernels.paged_decode")  # the module, not the function

    if not K.available():
        pytest.skip(f"Triton kernels unavailable: {K.unavailable_reason()}")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        if type(mod._decode_split_kernel).__name__ != "InterpretedFunction":
            pytest.skip("engine.kernels was imported before TRITON_INTERPRET=1 was set: kernels are not interpreted")
        import numpy
        import triton

        def minor(v: str) -> tuple[int, ...]:
            return tuple(int(x) for x in v.split(".")[:2])

        if minor(triton.__version__) < (3, 8) and minor(numpy.__version__) >= (2, 4):
            # Its interpreter makes loaded scalars 1-element arrays, which numpy 2.4 refuses as loop bounds.
            pytest.skip(f"the triton {triton.__version__} interpreter fails with numpy {numpy.__version__}: "
                        "needs triton>=3.8")
    return dev
