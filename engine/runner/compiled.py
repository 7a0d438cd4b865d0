"""The model compiled with `torch.compile` (inductor), attention left as one opaque op per layer.

vLLM's approach: the graph sees only tensors whose sizes follow the step's token count; the
step's attention metadata and the paged KV cache stay outside it, in a forward context that the
`kvtier::attention` op reads. So one graph, with the token count as its only dynamic size,
serves every step: nothing about a step's mix of prompts and decodes causes a recompile, and
the attention kernels (C++ on CPU, Triton on CUDA) run exactly as in eager mode. Inductor
compiles everything between them: the norms, rotary embedding, SiLU-and-multiply and residual
adds become fused loops; on CPU the GEMMs stay the eager path's prepacked oneDNN ones
(`kvtier::packed_linear`). Compiled code is cached on disk under `$KVTIER_CACHE_DIR/inductor`
(unless `TORCHINDUCTOR_CACHE_DIR` is set): a restart pays only dynamo's trace, not inductor's
code generation.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from engine.model_config import UNSCALED, KVScale
from engine.runner.attention import AttentionBackend, AttentionMetadata
from kvstore.cache_dir import cache_root

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class AttentionCall:
    """One `kvtier::attention` call: a decoder layer's q/k/v and how it attends."""
    q: torch.Tensor  # [tokens, heads, head_dim]
    k: torch.Tensor
    v: torch.Tensor
    layer: int
    scale: float
    window: int
    k_scale: float
    v_scale: float

    def rows(self, n: int) -> AttentionCall:
        """The call on the first `n` rows (a padded step's real tokens)."""
        return replace(self, q=self.q[:n], k=self.k[:n], v=self.v[:n])

    def run(self, backend: AttentionBackend, caches: list[tuple[torch.Tensor, torch.Tensor]],
            meta: AttentionMetadata) -> torch.Tensor:
        """Writes k/v into the layer's cache and returns `[tokens, heads * head_dim]`."""
        k_cache, v_cache = caches[self.layer]
        kv_scale = UNSCALED if self.k_scale == self.v_scale == 1.0 else KVScale(self.k_scale, self.v_scale)
        return backend.forward(self.q, self.k, self.v, k_cache, v_cache, meta.for_layer(self.layer), self.scale,
                               self.window, kv_scale)


Split = Callable[[AttentionCall, "StepContext"], torch.Tensor]  # (call, its step) -> [tokens, heads * head_dim]


@dataclass(frozen=True)
class StepContext:
    backend: AttentionBackend
    caches: list[tuple[torch.Tensor, torch.Tensor]] | None
    meta: AttentionMetadata | None
    # engine/runner/piecewise.py: takes every attention call instead (pads, records, splits graphs)
    split: Split | None = None

    def run(self, call: AttentionCall) -> torch.Tensor:
        if self.meta is None:
            raise RuntimeError("kvtier::attention: this step context has no attention metadata")
        return call.run(self.backend, self.caches, self.meta)


_local = threading.local()  # `.step`: the step this thread is running (engines in other threads have theirs)


@contextlib.contextmanager
def step_context(backend: AttentionBackend, caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
                 meta: AttentionMetadata | None, split: Split | None = None) -> Iterator[None]:
    outer = getattr(_local, "step", None)
    _local.step = StepContext(backend, caches, meta, split)
    try:
        yield
    finally:
        _local.step = outer


@torch.library.custom_op("kvtier::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float, window: int,
              k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """`AttentionBackend.forward` for decoder layer `layer` (sliding `window`, 0 = none; an fp8
    cache's `KVScale(k_scale, v_scale)`) of the step in `step_context`: writes k/v into that
    layer's cache (state the graph does not see, so nothing is declared mutated) and returns
    `[num_tokens, heads * head_dim]`. With the context's `split` set, the call goes there."""
    ctx = getattr(_local, "step", None)
    if ctx is None:
        raise RuntimeError("kvtier::attention called outside a model step")
    if q.stride()[1:] != (q.shape[2], 1):  # the kernels need contiguous heads; inductor may lay q out otherwise
        q = q.contiguous()
    call = AttentionCall(q, k, v, layer, scale, window, k_scale, v_scale)
    return ctx.split(call, ctx) if ctx.split is not None else ctx.run(call)


@attention.register_fake
def _(q, k, v, layer, scale, window, k_scale=1.0, v_scale=1.0):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def _use_disk_cache() -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # imports dynamo: 2.6 s

    # torch writes its /tmp default into the environment on first use (transformers may trigger
    # that while loading): only a value that is not that default is the user's choice.
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")


def compile_errors() -> tuple[type[BaseException], ...]:
    """What a failed compile raises (inductor's errors derive from dynamo's): a machine without a
    C++ compiler, an op inductor cannot lower. The engine then runs eagerly and says why. A function:
    importing dynamo takes seconds, which a process that never compiles (the API server, -O0,
    `kvtier --help`) should not pay."""
    import torch._dynamo.exc

    return (torch._dynamo.exc.TorchDynamoException,)


class CompiledForward:
    """`model(input_ids, positions, caches, meta, capture)` through one compiled graph for every
    step: the token count is an unbacked size, so dynamo neither specialises 1-token steps nor
    guards on a size (an earlier build with `dynamic=True` compiled a second graph for 1-token
    steps, whose static shape made inductor pick MKL's GEMM: decode 2x slower than eager). The
    graph is compiled on the first call, and that time is logged."""

    # Dynamo caches compiled code per code object and guards on the module instance: every model
    # compiled in one process (engines side by side, a draft beside its target, a test session)
    # is one more "recompile" of the same forward, and at its default limit of 8 the ninth
    # engine failed under fullgraph=True.
    MODELS_PER_PROCESS = 256

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend) -> None:
        _use_disk_cache()
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, self.MODELS_PER_PROCESS)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, self.MODELS_PER_PROCESS)
        self.model, self.backend = model, backend
        self._fn = torch.compile(model, dynamic=False, fullgraph=True)
        self._compiled = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata | None, capture: tuple[int, ...],
                 split: Split | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        start = time.perf_counter()
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        with step_context(self.backend, caches, meta, split):
            out = self._fn(input_ids, positions, None, None, capture)
        if not self._compiled:
            self._compiled = True
            log.info("torch.compile: model compiled in %.1f s, on its first forward (inductor cache: %s)",
                     time.perf_counter() - start, os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return out


class EagerThroughOp:
    """The eager model with its attention through `kvtier::attention`, as compiled: the forward
    engine/runner/piecewise.py splits when the model is not compiled. Same call as CompiledForward."""

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend) -> None:
        self.model, self.backend = model, backend

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata | None, capture: tuple[int, ...],
                 split: Split | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with step_context(self.backend, caches, meta, split):
            return self.model(input_ids, positions, None, None, capture)
