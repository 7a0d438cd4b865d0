"""Triton kernels for the GPU path (issue 14), each beside a plain-torch reference.

Importing this package never needs triton or a GPU: without triton the kernel functions raise
a RuntimeError naming the reason, and `available()` says whether they can run (CUDA, or CPU
tensors under TRITON_INTERPRET=1, which must be set before this package is first imported).

- `paged_decode`: decode attention through the block table, split along the context.
- `paged_prefill`: varlen prefill attention over cached context + the chunk itself, causal.
- `kv_write`: store a step's new K/V at their slots.
- `gather_blocks` / `scatter_blocks`: many cache blocks to/from a contiguous staging buffer.
- `sgmv`: one GEMM per segment of rows, each with its own weight (batched LoRA, engine/lora).
"""
from __future__ import annotations

from typing import Any, Callable

from engine.kernels import reference
from engine.kernels._triton import HAS_TRITON, available, interpreting, unavailable_reason

if HAS_TRITON:
    from engine.kernels.block_copy import gather_blocks, scatter_blocks
    from engine.kernels.kv_write import kv_write
    from engine.kernels.lora_sgmv import sgmv
    from engine.kernels.paged_decode import paged_decode
    from engine.kernels.paged_prefill import paged_prefill
else:
    def _missing(name: str) -> Callable[..., Any]:
        def fn(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"engine.kernels.{name} needs triton: {unavailable_reason()}")
        fn.__name__ = name
        return fn

    paged_decode = _missing("paged_decode")
    paged_prefill = _missing("paged_prefill")
    kv_write = _missing("kv_write")
    gather_blocks = _missing("gather_blocks")
    scatter_blocks = _missing("scatter_blocks")
    sgmv = _missing("sgmv")

__all__ = [
    "HAS_TRITON", "available", "interpreting", "unavailable_reason", "reference",
    "paged_decode", "paged_prefill", "kv_write", "gather_blocks", "scatter_blocks", "sgmv",
]
