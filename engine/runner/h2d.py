"""Small host-to-device copies that never make the host wait (issue 42: device-resident step state).

A copy from pageable host memory to a CUDA device synchronizes the stream before it starts, so each
`torch.tensor(values, device="cuda")` in a step's preparation waited for the forward already
queued: with async scheduling the bookkeeping thread could not prepare step N+1 until step N had
run. Staged through page-locked memory and issued without blocking, the copy is queued on the
stream instead, before the kernels that read it. On a CPU these are plain tensors.
"""
from __future__ import annotations

import torch


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of `values` on `device`, queued rather than waited for on CUDA. The staging
    tensor stays alive until the copy has run: torch's page-locked allocator records the copy's
    stream before it reuses the memory."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
