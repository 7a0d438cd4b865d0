"""Steps that mix prompt chunks with decodes, replayed as CUDA graphs between their attention calls
(vLLM's piecewise graphs; with engine/runner/graphs.py taking decode-only steps, FULL_AND_PIECEWISE).

A step of n tokens pads to the smallest capture size S >= n. Everything in the forward but attention
depends on the token count alone and works row by row (embeddings, GEMMs, norms, rotary, the MLP),
so it can be captured once per S. Attention depends on the step's mix of prompts and decodes, so
it runs eagerly between the graphs, on the n real rows with the step's metadata. Padded rows (token
0 at position 0) never reach attention: they write no KV, and their outputs are dropped.

The pieces come from the forward itself, not from an FX graph split at the attention op as in vLLM:
the model calls `kvtier::attention` (engine/runner/compiled.py) with the step context's `split`
set, and during capture that hook copies the call's q/k/v into static buffers, ends the current
graph and begins the next one, whose first work copies the attention output out of its static
buffer. So eager and compiled forwards split alike, a model needs nothing but the opaque attention
op that compiling already requires, and the graphs of one step share one memory pool (captured and
replayed in the same order). The static q/k/v/output buffers are one set per shape, shared by every
layer and size: a layer's are consumed before the next layer's are written.

`GraphMode.EAGER_REPLAY` runs the same padding, static buffers and split (attention on the real
rows only, through the buffers) without capturing: how CI checks this on CPU.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine.config import GraphMode
from engine.runner.attention import AttentionMetadata
from engine.runner.compiled import AttentionCall, Split, StepContext
from engine.runner.graphs import GraphStats, load_inputs, padded_size

log = logging.getLogger(__name__)

# (input_ids, positions, caches, meta, capture, split) -> (hidden, captured): CompiledForward or EagerThroughOp
OpForward = Callable[..., tuple[torch.Tensor, list[torch.Tensor]]]


@dataclass(frozen=True, eq=False)
class _Piece:
    """What runs after graph i of a captured size: attention call i, from and into static buffers."""
    call: AttentionCall  # q/k/v: views of the static buffers, `size` rows
    out: torch.Tensor  # [size, heads * head_dim], which graph i + 1 reads


@dataclass(frozen=True, eq=False)
class _Captured:
    graphs: tuple[torch.cuda.CUDAGraph, ...]  # one more than `pieces`
    pieces: tuple[_Piece, ...]
    hidden: torch.Tensor
    captured: tuple[torch.Tensor, ...]


class _Buffers:
    """Static tensors by role and shape, `rows` long; allocated on first use, never while capturing
    (that would put them in a graph's pool)."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._by_key: dict[tuple, torch.Tensor] = {}

    def get(self, role: str, shape: tuple[int, ...], like: torch.Tensor, size: int) -> torch.Tensor:
        key = (role, shape, like.dtype, like.device)
        buf = self._by_key.get(key)
        if buf is None:
            if like.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"piecewise graphs: no static {role} buffer of shape {shape} from warm-up")
            buf = self._by_key[key] = torch.zeros(self.rows, *shape, dtype=like.dtype, device=like.device)
        return buf[:size]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._by_key.values())


class PiecewiseGraphs:
    """Owns the static inputs, the split buffers and the graphs of every capture size. The model
    runner asks `fits` and then `run`; `capture` happens once, after warm-up, with G1 in place."""

    def __init__(self, mode: GraphMode, sizes: tuple[int, ...], *, device: str, capture_ids: tuple[int, ...] = ()) -> None:
        """`sizes`: the capture sizes, in tokens; `capture_ids`: the layers whose outputs every step
        keeps (EAGLE-3's features, exported hidden states), static outputs of the last graph."""
        if not mode.piecewise:
            raise ValueError(f"PiecewiseGraphs needs a piecewise graph mode, not {mode.value}")
        self.mode, self.sizes, self.capture_ids = mode, sizes, capture_ids
        n, dev = sizes[-1], torch.device(device)
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self._buffers = _Buffers(n)
        self._captured: dict[int, _Captured] = {}
        self._replays = dict.fromkeys(sizes, 0)
        self._eager = 0
        self._failed: str | None = None  # why the capture failed: steps then run as without pieces

    def fits(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` runs here; counts the ones too big."""
        if self._failed is not None:
            return False
        if num_tokens > self.sizes[-1]:
            self._eager += 1
            return False
        return True

    def _static(self, call: AttentionCall, size: int) -> tuple[AttentionCall, torch.Tensor]:
        """The call with its q/k/v copied into the static buffers, and the static output buffer."""
        q, k, v = (self._buffers.get(role, tuple(t.shape[1:]), t, size).copy_(t)
                   for role, t in (("q", call.q), ("k", call.k), ("v", call.v)))
        out = self._buffers.get("out", (call.q.shape[1] * call.q.shape[2],), call.q, size)
        return replace(call, q=q, k=k, v=v), out

    def _eager_split(self, n: int, size: int) -> Split:
        """Attention now, on the first `n` rows, through the static buffers (warm-up, eager replay)."""
        def split(call: AttentionCall, ctx: StepContext) -> torch.Tensor:
            static, out = self._static(call, size)
            if n:
                out[:n].copy_(ctx.run(static.rows(n)))
            return out.clone()
        return split

    @torch.inference_mode()
    def run(self, forward: OpForward, caches: list, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The hidden states of a fitting step's rows, and the `capture_ids` layers' outputs of them."""
        n = input_ids.shape[0]
        size = padded_size(self.sizes, n)
        load_inputs(self.ids, self.positions, input_ids, positions, size)
        self._replays[size] += 1
        done = self._captured.get(size)
        if done is None:  # EAGER_REPLAY
            hidden, captured = forward(self.ids[:size], self.positions[:size], caches, meta, self.capture_ids,
                                       split=self._eager_split(n, size))
            return hidden[:n], [c[:n] for c in captured]
        ctx = StepContext(forward.backend, caches, meta)
        for graph, piece in zip(done.graphs, done.pieces):
            graph.replay()
            piece.out[:n].copy_(ctx.run(piece.call.rows(n)))
        done.graphs[-1].replay()
        return done.hidden[:n], [c[:n] for c in done.captured]

    @torch.inference_mode()
    def capture(self, forward: OpForward, caches: list, pool: tuple) -> None:
        """Captures every size, largest first, into `pool` (shared with the decode graphs: no two
        graphs' steps overlap). Each size first runs once without attention (`n` = 0), so lazy
        work happens outside the capture and the static buffers exist. A capture that fails (an
        op that cannot be captured) is logged and leaves those steps to run as without pieces: the
        engine then starts as with full_decode_only."""
        if not self.mode.captures:
            return
        start, dev = time.perf_counter(), self.ids.device
        free_before = torch.cuda.mem_get_info(dev)[0]
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        size = self.sizes[-1]
        try:
            with torch.cuda.stream(stream):
                for size in reversed(self.sizes):
                    forward(self.ids[:size], self.positions[:size], caches, None, self.capture_ids,
                            split=self._eager_split(0, size))
                    self._captured[size] = self._capture(forward, caches, size, pool)
        except RuntimeError as e:  # CUDA's capture errors (torch.cuda reports them as RuntimeError)
            self._failed, self._captured = f"{type(e).__name__}: {e}", {}
            log.error("piecewise CUDA graphs: the capture at %d tokens failed (%s); steps that do not only decode "
                      "run without graphs (--cudagraph-mode full_decode_only skips this capture)", size, self._failed)
            return
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        pieces = len(self._captured[self.sizes[-1]].graphs)
        log.info("CUDA graphs: %d piecewise sizes (1..%d tokens), %d graphs each, captured in %.1f s, %.2f GiB "
                 "(%.0f MiB of attention buffers)", len(self.sizes), self.sizes[-1], pieces,
                 time.perf_counter() - start, (free_before - torch.cuda.mem_get_info(dev)[0]) / 2**30,
                 self._buffers.nbytes() / 2**20)

    def _capture(self, forward: OpForward, caches: list, size: int, pool: tuple) -> _Captured:
        graphs = [torch.cuda.CUDAGraph()]
        pieces: list[_Piece] = []

        def split(call: AttentionCall, ctx: StepContext) -> torch.Tensor:
            static, out = self._static(call, size)  # the copies are the end of this graph
            graphs[-1].capture_end()
            pieces.append(_Piece(static, out))
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=pool)
            return out.clone()  # the next graph's first work: its own copy, in the pool

        graphs[0].capture_begin(pool=pool)
        try:
            hidden, captured = forward(self.ids[:size], self.positions[:size], caches, None, self.capture_ids,
                                       split=split)
        except BaseException:
            # Leave capture mode so that the error, not a broken CUDA stream, is what the caller sees.
            with contextlib.suppress(RuntimeError):
                graphs[-1].capture_end()
            raise
        graphs[-1].capture_end()
        return _Captured(tuple(graphs), tuple(pieces), hidden, tuple(captured))

    def stats(self) -> GraphStats:
        return GraphStats(dict(self._replays), self._eager)

    def check_integrity(self) -> None:
        if set(self._captured) - set(self.sizes):
            raise RuntimeError("a piecewise capture without its size")
        if any(len(c.graphs) != len(c.pieces) + 1 for c in self._captured.values()):
            raise RuntimeError("a piecewise capture whose graphs and attention calls do not alternate")
        if self.mode is GraphMode.EAGER_REPLAY and self._captured:
            raise RuntimeError("graphs captured in eager-replay mode")
