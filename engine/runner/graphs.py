"""Decode steps replayed from CUDA graphs captured at a set of batch sizes (vLLM's FULL_DECODE_ONLY).

A step whose requests all decode one token (no prompt chunk, no proposed tokens, no hidden states
to keep) is padded up to the smallest capture size that holds it and run from static buffers:
input ids, positions, slots, block tables and context lengths are copied in place, and the graph
captured at that size replays every kernel of the forward with one launch. Padded rows decode
token 0 at position 0 against one reserved block (`pad_block`, past the scheduler's blocks), so
they write only there and never into a live block; their outputs are dropped.

`GraphMode.EAGER_REPLAY` runs the same static buffers, padding and capture-size choice without
capturing (the forward runs eagerly on the padded batch): how CI checks this bookkeeping on CPU.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import GraphMode
from engine.runner.attention import AttentionMetadata, DecodeGroup

log = logging.getLogger(__name__)


def padded_size(sizes: tuple[int, ...], batch: int) -> int | None:
    """The smallest capture size that holds `batch` rows; None past the largest."""
    for s in sizes:
        if s >= batch:
            return s
    return None


def load_inputs(ids: torch.Tensor, positions: torch.Tensor, step_ids: torch.Tensor, step_positions: torch.Tensor,
                size: int) -> None:
    """Copies a step's input ids and positions into a graph's static buffers; the rows after them,
    up to `size`, become padding (token 0 at position 0)."""
    n = step_ids.shape[0]
    ids[:n].copy_(step_ids)
    positions[:n].copy_(step_positions)
    if size > n:
        ids[n:size].zero_()
        positions[n:size].zero_()


@dataclass(frozen=True)
class GraphStats:
    replays: dict[int, int]  # capture size -> steps run at it
    eager_steps: int  # decode-capable runner steps that did not fit (and every other step is eager too)


Forward = Callable[..., tuple[torch.Tensor, list[torch.Tensor]]]


def graph_mode_for(mode: GraphMode, model: torch.nn.Module) -> GraphMode:
    """`mode` (config.cudagraph_mode), unless the model syncs with the host inside its forward (MoE
    routing reads expert counts), which a CUDA graph cannot hold: then decode runs eagerly, and the
    log says so."""
    if mode.captures and any(getattr(m, "syncs_with_host", False) for m in model.modules()):
        log.warning("CUDA graphs off for %s: its MoE layers read expert counts on the host each step "
                    "(engine/models/moe.py), which a graph cannot replay; decode runs eagerly", type(model).__name__)
        return GraphMode.NONE
    return mode


class _GroupBuffers:
    """One KV group's static decode metadata (engine/kv/kv_groups.py: each group has its own tables and slots)."""

    def __init__(self, n: int, max_blocks: int, block_size: int, pad_block: int, masks: bool, dev: torch.device) -> None:
        self.pad_slot, self.pad_block = pad_block * block_size, pad_block
        self.slots = torch.full((n,), self.pad_slot, dtype=torch.long, device=dev)
        self.tables = torch.full((n, max_blocks), pad_block, dtype=torch.long, device=dev)
        self.lens = torch.ones(n, dtype=torch.long, device=dev)
        # Each decode row's query row: the plain path's order (longest first for kernels that take
        # each row's length), so that a row's kernel work and its result are the plain path's.
        self.rows = torch.arange(n, dtype=torch.long, device=dev)
        self._arange = torch.arange(n, dtype=torch.long, device=dev)
        self._cols = torch.arange(max_blocks * block_size if masks else 0, device=dev)
        self.mask = torch.ones(n, 1, 1, self._cols.numel(), dtype=torch.bool, device=dev)
        self._masks = masks

    def meta(self, size: int) -> AttentionMetadata:
        group = DecodeGroup(self.rows[:size], self.tables[:size], self.lens[:size], self.mask[:size])
        return AttentionMetadata(slot_mapping=self.slots[:size], prefills=[], decodes=[group])

    def load(self, meta: AttentionMetadata, b: int, size: int) -> None:
        """The step's decode groups one after another, then padding rows up to `size`."""
        self.slots[:b].copy_(meta.slot_mapping)
        at = 0
        for g in meta.decodes:
            n, width = g.query_idx.numel(), g.block_tables.shape[1]
            self.rows[at:at + n] = g.query_idx
            self.tables[at:at + n, :width] = g.block_tables
            self.lens[at:at + n] = g.context_lens
            at += n
        if size > b:  # rows a larger step left behind become padding again
            self.rows[b:size] = self._arange[b:size]
            self.slots[b:size] = self.pad_slot
            self.tables[b:size, 0] = self.pad_block
            self.lens[b:size] = 1
        if self._masks:
            torch.lt(self._cols, self.lens[:size, None], out=self.mask[:size, 0, 0])


class DecodeGraphs:
    """Owns the static decode buffers and the graphs captured over them (one per capture size,
    sharing one memory pool). The model runner asks `fits` and then `run`; `capture` happens
    once, after warm-up, with the G1 cache in place (graphs bake its address in)."""

    def __init__(self, mode: GraphMode, sizes: tuple[int, ...], *, block_size: int, max_blocks: int,
                 pad_block: int, device: str, masks: bool, layer_groups: tuple[int, ...] = (),
                 capture_ids: tuple[int, ...] = ()) -> None:
        """`max_blocks`: a block table row's width; `pad_block`: the block padded rows write to;
        `masks`: whether the attention backend reads `DecodeGroup.mask` (one that pads decodes);
        `layer_groups`: each layer's KV group when there are several (else empty); `capture_ids`:
        the layers whose outputs every step keeps (EAGLE-3's features, exported hidden states),
        which become static outputs of the graphs too."""
        if mode is GraphMode.NONE:
            raise ValueError("DecodeGraphs needs a graph mode other than none")
        self.mode, self.sizes, self.pad_block, self.layer_groups = mode, sizes, pad_block, layer_groups
        self.capture_ids = capture_ids
        n, dev = self.sizes[-1], torch.device(device)
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self._groups = [_GroupBuffers(n, max_blocks, block_size, pad_block, masks, dev)
                        for _ in range(max(layer_groups, default=0) + 1)]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._replays = dict.fromkeys(self.sizes, 0)
        self._eager = 0

    def meta(self, size: int) -> AttentionMetadata:
        """The static metadata of a `size`-row step: views of the buffers, the same every step."""
        metas = [g.meta(size) for g in self._groups]
        if len(metas) == 1:
            return metas[0]
        return AttentionMetadata(metas[0].slot_mapping, [], metas[0].decodes, groups=tuple(metas),
                                 layer_groups=self.layer_groups)

    def fits(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether a step runs here: only decodes, and a batch no bigger than the largest capture
        size. Counts the ones that do not fit but decode only."""
        metas = meta.groups or (meta,)
        if len(metas) != len(self._groups) or any(m.prefills or not m.decodes for m in metas):
            return False
        if sum(g.query_idx.numel() for g in meta.decodes) != num_tokens:  # proposed tokens ride along
            return False
        if num_tokens > self.sizes[-1]:
            self._eager += 1
            return False
        return True

    @torch.inference_mode()
    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copies a fitting step into the buffers; pads up to the capture size."""
        b = input_ids.shape[0]
        size = padded_size(self.sizes, b)
        load_inputs(self.ids, self.positions, input_ids, positions, size)
        for buffers, m in zip(self._groups, meta.groups or (meta,)):
            buffers.load(m, b, size)
        return size

    def run(self, forward: Forward, caches: list, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The hidden states of a fitting step's rows (`fits` said yes), and the `capture_ids`
        layers' outputs of those rows."""
        b = input_ids.shape[0]
        size = self._load(input_ids, positions, meta)
        self._replays[size] += 1
        graph = self._graphs.get(size)
        if graph is None:  # EAGER_REPLAY, or a size whose capture has not happened
            hidden, captured = forward(self.ids[:size], self.positions[:size], caches, self.meta(size), self.capture_ids)
        else:
            graph.replay()
            hidden, captured = self._outputs[size]
        return hidden[:b], [c[:b] for c in captured]

    @torch.inference_mode()
    def capture(self, forward: Forward, caches: list, pool: tuple | None = None) -> None:
        """Captures every size, largest first into one shared pool (smaller graphs reuse its
        blocks). Each size runs once eagerly first, so lazy work (Triton compiles, cuBLAS
        handles) happens outside the capture. The buffers hold padding rows only then: every row
        writes `pad_block`. `pool`: a pool to share (the piecewise graphs'), else a new one."""
        if not self.mode.captures:
            return
        start, dev = time.perf_counter(), self.ids.device
        free_before = torch.cuda.mem_get_info(dev)[0]
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                forward(self.ids[:size], self.positions[:size], caches, self.meta(size), self.capture_ids)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = forward(self.ids[:size], self.positions[:size], caches, self.meta(size), self.capture_ids)
                self._graphs[size], self._outputs[size] = graph, (out[0], list(out[1]))
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        log.info("CUDA graphs: %d decode sizes (1..%d) captured in %.1f s, %.2f GiB", len(self.sizes),
                 self.sizes[-1], time.perf_counter() - start, (free_before - torch.cuda.mem_get_info(dev)[0]) / 2**30)

    def stats(self) -> GraphStats:
        return GraphStats(dict(self._replays), self._eager)

    def check_integrity(self) -> None:
        if set(self._graphs) - set(self.sizes) or set(self._graphs) != set(self._outputs):
            raise RuntimeError("a captured graph without its size or its output")
        if self.mode is GraphMode.EAGER_REPLAY and self._graphs:
            raise RuntimeError("graphs captured in eager-replay mode")
