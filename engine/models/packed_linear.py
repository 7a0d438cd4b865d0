"""Linear layers for CPU whose weights are prepacked once into oneDNN's blocked layout.

`nn.Linear` on CPU hands its weight to the GEMM in plain row-major layout every call, and the
library re-blocks it each time. Packing once at load (what vLLM's CPU build and inductor's
freezing pass do) removes that work from every step: measured on the demo model's shapes here,
fp32 GEMMs ran 1.4-2x faster. The outputs differ from `nn.Linear`'s in the last bits only (another
summation order), which keeps greedy tokens identical to transformers on the parity suite.

bfloat16 weights on a CPU with AMX, and float32 weights on one with AVX2 or AVX-512, go to
kvtier's own kernels instead (engine/cpu_kernels/linear.py): oneDNN streams a decode step's weights
at half the memory's rate.
"""
from __future__ import annotations

import enum
import itertools
import logging
import weakref

import torch
from torch import nn

from engine.cpu_kernels import linear as amx_linear

log = logging.getLogger(__name__)

# Under torch.compile, a packed GEMM is the opaque op `kvtier::packed_linear`, which finds its
# weights here by key: inductor cannot take oneDNN's packed tensors as graph constants, and its
# own prepacking (freezing) bypasses its on-disk cache, so every process recompiled (27 s).
_live: dict[int, weakref.ref[PackedLinear]] = {}
_keys = itertools.count()


@torch.library.custom_op("kvtier::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, key: int, part: int, out_features: int) -> torch.Tensor:
    """`PackedLinear` number `key`'s part `part` applied to `x`."""
    owner = _live[key]()
    if owner is None:
        raise RuntimeError(f"packed linear {key} was released")
    return owner.run_part(x, part)


@packed_linear.register_fake
def _(x, key, part, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("kvtier::packed_silu_mul", mutates_args=())
def packed_silu_mul(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """`PackedLinear` number `key`'s `silu_mul(x)`."""
    owner = _live[key]()
    if owner is None:
        raise RuntimeError(f"packed linear {key} was released")
    return owner.silu_mul(x)


@packed_silu_mul.register_fake
def _(x, key, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


class Kernel(enum.Enum):
    """Which GEMM a `PackedLinear` runs (engine/cpu_kernels/linear.py for kvtier's own)."""
    ONEDNN = "onednn"  # torch's mkldnn linear on oneDNN's blocked layout
    AMX = "amx"  # bfloat16 on AMX tiles: 1.3-1.8x oneDNN at decode sizes
    F32 = "f32"  # float32 on AVX2/AVX-512 panels: 1.1-1.6x oneDNN at decode sizes


_PACK = {Kernel.ONEDNN: lambda w: torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None),
         Kernel.AMX: amx_linear.pack, Kernel.F32: amx_linear.pack_f32}


def _kernel_for(dtype: torch.dtype, parts: tuple[int, ...], in_features: int) -> Kernel:
    if dtype == torch.bfloat16 and all(amx_linear.fits(n, in_features) for n in parts) and amx_linear.amx_ready():
        return Kernel.AMX
    if dtype == torch.float32 and all(amx_linear.f32_fits(n, in_features) for n in parts) and amx_linear.f32_ready():
        return Kernel.F32
    return Kernel.ONEDNN


_SUPPORTED: dict[torch.dtype, bool] = {}


def packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN packs and multiplies `dtype` weights on this CPU. bfloat16 needs AVX-512
    (BW/VL/DQ) or AVX-NE-CONVERT: on an AVX2-only CPU the reorder raises, and the model must keep
    its plain linears rather than fail to load. Probed once per dtype on a tiny weight."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    if dtype not in _SUPPORTED:
        try:
            w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
            torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 16, dtype=dtype), w, None, "none", [], "")
            _SUPPORTED[dtype] = True
        except RuntimeError as e:
            log.warning("oneDNN cannot pack %s linears on this CPU (%s); they run unpacked", dtype,
                        str(e).splitlines()[0][:200])
            _SUPPORTED[dtype] = False
    return _SUPPORTED[dtype]


class PackedLinear(nn.Module):
    """`y = x W^T + b` with W held only in a packed layout, the one of its `kernel`; the plain copy is
    released unless another module shares the Parameter (e.g. tied input embeddings).

    `parts` (output sizes summing to `out_features`) packs the rows of W as that many matrices:
    `forward_parts` then returns each part as its own contiguous tensor. The results are the same
    bits as slicing the fused output (each output column is the same dot product)."""

    def __init__(self, linear: nn.Linear, parts: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        b = None if linear.bias is None else linear.bias.detach()
        self.parts: tuple[int, ...] = (self.out_features,) if parts is None else tuple(parts)
        if sum(self.parts) != self.out_features or min(self.parts) < 1:
            raise ValueError(f"parts {parts} do not split {self.out_features} output features")
        ws = w.split(self.parts)
        self.kernel = _kernel_for(w.dtype, self.parts, self.in_features)
        self.packed = [_PACK[self.kernel](wi) for wi in ws]
        self.biases = list(b.split(self.parts)) if b is not None else [None] * len(self.parts)
        self.key = next(_keys)
        _live[self.key] = weakref.ref(self, lambda _, k=self.key: _live.pop(k, None))

    @property
    def amx(self) -> bool:
        return self.kernel is Kernel.AMX

    @property
    def splits_output(self) -> bool:
        """Whether `forward_parts` returns more than one tensor (a caller that can take the parts
        apart skips the concatenation)."""
        return len(self.packed) > 1

    @property
    def fuses_silu_mul(self) -> bool:
        """Whether `silu_mul` runs as one kernel: a gated MLP's gate and up packed as two equal
        parts for the AMX kernel, without bias."""
        return self.amx and len(self.parts) == 2 and self.parts[0] == self.parts[1] and self.biases[0] is None

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`silu(gate(x)) * up(x)` for parts (gate, up), in one pass (`fuses_silu_mul`)."""
        if not self.fuses_silu_mul:
            raise RuntimeError(f"this linear does not fuse SiLU-and-multiply ({self.extra_repr()})")
        if torch.compiler.is_compiling():
            return torch.ops.kvtier.packed_silu_mul(x, self.key, self.parts[0])
        return amx_linear.silu_mul(x, self.packed[0], self.packed[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.packed) == 1:
            return self._part(x, 0)
        return torch.cat(self.forward_parts(x), dim=-1)

    def forward_parts(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self._part(x, i) for i in range(len(self.packed))]

    def _part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.kvtier.packed_linear(x, self.key, i, self.parts[i])
        return self.run_part(x, i)

    def run_part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self.kernel is Kernel.AMX:
            return amx_linear.linear(x, self.packed[i], self.biases[i])
        if self.kernel is Kernel.F32:
            return amx_linear.linear_f32(x, self.packed[i], self.biases[i])
        return torch.ops.mkldnn._linear_pointwise(x, self.packed[i], self.biases[i], "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.biases[0] is not None}, parts={self.parts}, kernel={self.kernel.value}")


def pack_linears(model: nn.Module) -> int:
    """Replaces every `nn.Linear` of a CPU model in place; returns how many were packed. A module
    may name linears to pack in parts with a `packed_parts() -> {child name: output sizes}`, and
    a module with weights of its own shape (MoE experts) packs them in its `prepack()`. The
    model's `unpacked_modules()`, if it has one, are left as they are (code that reads
    `linear.weight`)."""
    keep = {id(m) for top in (model.unpacked_modules() if hasattr(model, "unpacked_modules") else ())
            for m in top.modules()}
    targets = [(parent, name, child) for parent in model.modules() if id(parent) not in keep
               for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in targets:
        parts = parent.packed_parts().get(name) if hasattr(parent, "packed_parts") else None
        setattr(parent, name, PackedLinear(child, parts))
    own = [m for m in model.modules() if hasattr(m, "prepack")]
    for m in own:
        m.prepack()
    return len(targets) + len(own)
