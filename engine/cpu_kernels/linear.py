"""kvtier's own CPU linears: the weights packed once into a kernel's order, then `y = x W^T + b`
at any row count.

- bfloat16 on AMX tiles (`linear_amx.cpp`): 1.3-1.8x oneDNN's packed GEMM at 1-64 rows on the
  demo model's shapes; at prefill sizes the two are even.
- float32 on the vector units (`linear_f32.cpp`, AVX2 or AVX-512): 1.1-1.6x oneDNN's packed GEMM
  at 1-256 rows on an AVX2 EPYC, even with it at 4096; on an AVX-512 Xeon 1.2x at 1-64 rows,
  0.91-0.94x at 256-4096.

Decode steps are where they pay: each thread streams its own columns of W at the memory's rate
(docs/CPU.md). `engine/models/packed_linear.py` uses them for every linear whose dtype and shape
fit when the kernel is ready here (`amx_ready`, `f32_ready`), and oneDNN otherwise.
"""
from __future__ import annotations

import enum
import os
from collections.abc import Callable

import torch

from engine.cpu_kernels import _traced, get

TILE_N, TILE_K = 16, 32  # W's rows and columns must be multiples of these
# "0": oneDNN for every linear of that dtype (for comparisons), "1": kvtier's kernel wherever it is
# built; unset, the measured default below. Read when a model loads.
ENV = "KVTIER_AMX_LINEAR"
F32_ENV = "KVTIER_F32_LINEAR"
F32_TILE_N = 16  # the float32 kernel's W rows must be a multiple of this


class F32Build(enum.IntEnum):
    """What the float32 kernel multiplies on in this build (`kvt_linear_f32_ready`)."""
    NONE = 0  # scalar lanes: slower than oneDNN, never used
    AVX2 = 1
    AVX512 = 2


def _choice(env: str) -> bool | None:
    choice = os.environ.get(env)
    if choice not in (None, "0", "1"):
        raise ValueError(f"{env} must be 0 (oneDNN linears) or 1 (kvtier's kernel), or unset for this CPU's "
                         f"default; got {choice!r}")
    return None if choice is None else choice == "1"


def amx_ready() -> bool:
    """Whether `linear` runs here: the kernels built for AMX-BF16, Linux granting the tile state,
    and not turned off with KVTIER_AMX_LINEAR=0."""
    lib = get() if _choice(ENV) is not False else None
    return lib is not None and bool(lib.kvt_linear_amx_ready())


def f32_build() -> F32Build:
    """What `linear_f32` multiplies on here (NONE: not built with vector units, or no kernels)."""
    lib = get()
    return F32Build(lib.kvt_linear_f32_ready()) if lib is not None else F32Build.NONE


def f32_ready() -> bool:
    """Whether float32 `PackedLinear`s run on `linear_f32` here. By default only on an AVX2 build:
    there it beat oneDNN on the throughput workload and the 4k prefill. On AVX-512 it ties oneDNN on
    the workload and loses 8% on a 4k prefill (docs/CPU.md), so oneDNN keeps them unless
    KVTIER_F32_LINEAR=1; KVTIER_F32_LINEAR=0 keeps oneDNN everywhere."""
    choice, build = _choice(F32_ENV), f32_build()
    return build is not F32Build.NONE and (build is F32Build.AVX2 if choice is None else choice)


def f32_fits(out_features: int, in_features: int) -> bool:
    return out_features % F32_TILE_N == 0 and out_features > 0 and in_features > 0


def fits(out_features: int, in_features: int) -> bool:
    return out_features % TILE_N == 0 and in_features % TILE_K == 0 and out_features > 0 and in_features > 0


def _pack(w: torch.Tensor, dtype: torch.dtype, fit: bool, kernel: str, needs: str, entry: Callable) -> torch.Tensor:
    """`entry(lib)`: the library's packing function for this kernel."""
    lib = get()
    if lib is None or w.dtype != dtype or w.dim() != 2 or not fit:
        raise ValueError(f"cannot pack a {tuple(w.shape)} {w.dtype} weight for the {kernel} linear ({needs})")
    w = w.contiguous()
    out = torch.empty_like(w)
    if entry(lib)(w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr(), torch.get_num_threads()) != 0:
        raise ValueError(f"the {kernel} linear refused a {tuple(w.shape)} weight")
    return out


def pack(w: torch.Tensor) -> torch.Tensor:
    """`w` `[out, in]` bfloat16 in the kernel's tile order (a new tensor of the same size)."""
    return _pack(w, torch.bfloat16, w.dim() == 2 and fits(*w.shape), "AMX",
                 f"bfloat16, out % {TILE_N} == 0, in % {TILE_K} == 0", lambda lib: lib.kvt_linear_pack)


def _rows(x: torch.Tensor, k: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if x.dtype != dtype or x.shape[-1] != k:
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"this linear takes {name} [..., {k}], got {x.dtype} {tuple(x.shape)}")
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


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    """`w` `[out, in]` float32 in the float32 kernel's panel order (a new tensor of the same size)."""
    return _pack(w, torch.float32, w.dim() == 2 and f32_fits(*w.shape), "float32",
                 f"float32, out % {F32_TILE_N} == 0", lambda lib: lib.kvt_linear_f32_pack)


def linear_f32(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W^T + bias` for `x` `[..., in]` float32 and `packed` from `pack_f32(W)`. Each output is
    the same sum in the same order whatever the batch around its row (batch-invariant)."""
    n, k = packed.shape
    x2 = _rows(x, k, torch.float32)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    b = None if bias is None else bias.contiguous()
    with _traced("kvtier::cpu_linear_f32"):
        rc = get().kvt_linear_f32(x2.data_ptr(), x2.stride(0), x2.shape[0], packed.data_ptr(), n, k,
                                  None if b is None else b.data_ptr(), y.data_ptr(), n, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"the float32 linear refused {tuple(x2.shape)} x {tuple(packed.shape)}")
    return y.view(*x.shape[:-1], n)
