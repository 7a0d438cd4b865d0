"""Small host-to-device copies that never make the host wait (issue 42: device-resident step state).

A copy from pageable host memory to a CUDA device synchronizes the stream before it starts, so each
`torch.tensor(values, device="cuda")` in a step's preparation waited for the forward already
queued: with async scheduling the bookkeeping thread could not prepare step N+1 until step N had
run. Staged through page-locked memory and issued without blocking, the copy is queued on the
stream instead, before the kernels that read it. On a CPU these are plain tensors.
"""
from __future__ import annotations

import torch


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor of `values` (int64 unless `dtype` says otherwise) on `device`, queued rather than
    waited for on CUDA. The staging tensor stays alive until the copy has run: torch's page-locked
    allocator records the copy's stream before it reuses the memory."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`, queued rather than waited for on CUDA (`t` itself on a CPU)."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
