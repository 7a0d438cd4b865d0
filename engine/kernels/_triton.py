"""Triton as an optional dependency: one place that imports it and says whether kernels can run.

Kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter. The interpreter is
chosen when a kernel is *defined* (`@triton.jit` reads TRITON_INTERPRET), so the variable must be
set before `engine.kernels` is first imported; tests/kernels/conftest.py does that on CPU.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
    _IMPORT_ERROR = ""
except ImportError as exc:  # triton is optional: the torch paths never need it
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False
    _IMPORT_ERROR = str(exc)


def interpreting() -> bool:
    """True when Triton kernels are (or will be) defined for the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason() -> str | None:
    """None when the kernels can run here, else why not (for skip messages and errors)."""
    if not HAS_TRITON:
        return f"triton is not installed ({_IMPORT_ERROR})"
    if torch.cuda.is_available() or interpreting():
        return None
    return "no CUDA device and TRITON_INTERPRET is not set"


def available() -> bool:
    """Whether the Triton kernels can run in this process (CUDA, or CPU under the interpreter)."""
    return unavailable_reason() is None


def check_device(*tensors: torch.Tensor) -> None:
    """Refuse tensors that the kernels, as defined in this process, cannot touch."""
    dev = tensors[0].device
    for t in tensors:
        if t.device != dev:
            raise ValueError(f"tensors on different devices: {dev} and {t.device}")
    if dev.type == "cpu" and not interpreting():
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1, set before engine.kernels "
                           "is imported")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {dev}")


def dot_options(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """(upcast, input_precision) for the kernels' tl.dot calls.

    The interpreter multiplies bf16 tensors as raw uint16 (triton 3.6), so on CPU the operands are
    upcast to fp32 first; on the GPU fp32 inputs use exact IEEE products, not TF32, so that the
    fp32 results match a torch reference closely."""
    upcast = device.type != "cuda"
    return upcast, "ieee" if dtype == torch.float32 else "tf32"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill (a nominal 8 for the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8
