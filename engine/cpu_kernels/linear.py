"""bfloat16 linears on AMX tiles (`linear_amx.cpp`): the weights packed once into the kernel's
tile order, then `y = x W^T + b` at any row count.

Decode steps are where it pays: each thread streams its own columns of W at the memory's rate,
1.3-1.8x oneDNN's packed GEMM at 1-64 rows on the demo model's shapes (docs/CPU.md); at prefill
sizes the two are even. `engine/models/packed_linear.py` uses it for every bfloat16 linear whose
shape fits when `amx_ready()`, and oneDNN otherwise.
"""
from __future__ import annotations

import os

import torch

from engine.cpu_kernels import _traced, get

TILE_N, TILE_K = 16, 32  # W's rows and columns must be multiples of these
ENV = "KVTIER_AMX_LINEAR"  # "0": oneDNN for every linear (for comparisons), read when a model loads


def amx_ready() -> bool:
    """Whether `linear` runs here: the kernels built for AMX-BF16, Linux granting the tile state,
    and not turned off with KVTIER_AMX_LINEAR=0."""
    choice = os.environ.get(ENV, "1")
    if choice not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 (oneDNN linears) or 1 (the default), got {choice!r}")
    lib = get()
    return choice == "1" and lib is not None and bool(lib.kvt_linear_amx_ready())


def fits(out_features: int, in_features: int) -> bool:
    return out_features % TILE_N == 0 and in_features % TILE_K == 0 and out_features > 0 and in_features > 0


def pack(w: torch.Tensor) -> torch.Tensor:
    """`w` `[out, in]` bfloat16 in the kernel's tile order (a new tensor of the same size)."""
    lib = get()
    if lib is None or w.dtype != torch.bfloat16 or w.dim() != 2 or not fits(*w.shape):
        raise ValueError(f"cannot pack a {tuple(w.shape)} {w.dtype} weight for the AMX linear "
                         f"(bfloat16, out % {TILE_N} == 0, in % {TILE_K} == 0)")
    w = w.contiguous()
    out = torch.empty_like(w)
    if lib.kvt_linear_pack(w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr(), torch.get_num_threads()) != 0:
        raise ValueError(f"the AMX linear refused a {tuple(w.shape)} weight")
    return out


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype != torch.bfloat16 or x.shape[-1] != k:
        raise ValueError(f"the AMX linear takes bfloat16 [..., {k}], got {x.dtype} {tuple(x.shape)}")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W^T + bias` for `x` `[..., in]` bfloat16 and `packed` from `pack(W)`."""
    n, k = packed.shape
    x2 = _rows(x, k)
    y = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
    b = None if bias is None else bias.contiguous()
    with _traced("kvtier::cpu_linear"):
        rc = get().kvt_linear(x2.data_ptr(), x2.stride(0), x2.shape[0], packed.data_ptr(), n, k,
                              None if b is None else b.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("the AMX linear is not available in this process")
    return y.view(*x.shape[:-1], n)


def silu_mul(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(x @ Wg^T) * (x @ Wu^T)` (a gated MLP's hidden activation) in one pass, `gate` and `up`
    from `pack`: both products stay float32 until the result is rounded, and no separate SiLU pass
    reads them back from memory."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    n, k = gate.shape
    x2 = _rows(x, k)
    y = torch.empty(x2.shape[0], n, dtype=torch.bfloat16)
    with _traced("kvtier::cpu_linear_silu_mul"):
        rc = get().kvt_linear_silu_mul(x2.data_ptr(), x2.stride(0), x2.shape[0], gate.data_ptr(), up.data_ptr(), n,
                                       k, y.data_ptr(), n, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("the AMX linear is not available in this process")
    return y.view(*x.shape[:-1], n)
