"""Worker side: owns the model and the G1 cache tensors, turns a schedule into one forward pass.

The cache is one tensor `[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`, so a
block's bytes for every layer can be gathered with one index (what offload tiers copy).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from engine.runner.attention import AttentionBackend, AttentionMetadata, DecodeGroup, PrefillSeq
from engine.runner.compiled import EagerThroughOp
from engine.model_config import ModelConfig
from engine.config import GraphMode
from engine.runner.graphs import DecodeGraphs
from engine.runner.piecewise import PiecewiseGraphs
from engine.runner.h2d import to_device
from engine.runner.step_timer import StepTimer
from engine.runner.input_batch import InputBatch
from engine.mm.encoder import EncoderCache
from engine.mm.spec import ImageAttention
from engine.lora.layers import LoRARows
from engine.lora.slots import LoRASlots
from engine.kv.kv_groups import KVLayout
from engine.sample.prompt_logprobs import PromptLogprob, PromptRows, prompt_logprobs
from engine.sample.prompt_logprobs import select as select_prompt_rows
from engine.core.request import RequestId
from connectors.hidden_spec import HiddenStatesSpec
from engine.core.step_io import RunPlan


MIN_DECODE_GROUP = 8


class Peers(Protocol):
    """The other tensor-parallel ranks, as the runner drives them (engine/parallel/ranks.py)."""
    def step(self, plan: RunPlan, block_tables: list, filled: dict[RequestId, int]) -> None: ...
    def release(self, req_id: RequestId) -> None: ...
    def check_alive(self) -> None: ...
    def close(self) -> None: ...


@dataclass
class ModelOutput:
    # [rows, vocab] float32: for each entry of `sampled` in order, 1 + its number of spec tokens
    # rows (the logits after the last known token, then after each proposed token).
    logits: torch.Tensor
    sampled: list[int]  # indices into scheduler_output.scheduled that produce a token
    row_starts: list[int] = field(default_factory=list)  # first logits row of each `sampled` entry
    # prompt_logprobs: {scheduled index: (first position, entries)} (engine/sample/prompt_logprobs.py)
    prompt_logprobs: dict[int, tuple[int, list[PromptLogprob]]] = field(default_factory=dict)

    def rows(self, i: int) -> torch.Tensor:
        """The logits rows of the i-th sampled entry."""
        end = self.row_starts[i + 1] if i + 1 < len(self.row_starts) else self.logits.shape[0]
        return self.logits[self.row_starts[i]:end]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: list[int]  # token rows whose logits are sampled, per `sampled` entry in order
    sampled: list[int]
    row_starts: list[int]
    # Async scheduling: (index into input_ids, request) for tokens an earlier, still running step
    # samples; whoever runs the step writes them in first (`fill_placeholders`).
    placeholders: list[tuple[int, RequestId]] = field(default_factory=list)
    prompt_rows: list[PromptRows] = field(default_factory=list)  # prompt_logprobs' rows
    # What it was prepared from: the other tensor-parallel ranks get these when it runs.
    plan: RunPlan | None = None
    tables: list | None = None
    mm: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, embeddings) of images' placeholders
    lora: list[tuple[int, LoRARows]] = field(default_factory=list)  # (adapter slot, its rows)

    @torch.inference_mode()
    def fill_placeholders(self, tokens: dict[RequestId, int]) -> None:
        """Writes the sampled tokens in; a request that sampled none (it failed) gets 0, and
        its row is discarded."""
        if self.placeholders:
            dev = self.input_ids.device
            at = to_device([pos for pos, _ in self.placeholders], dev)
            self.input_ids[at] = to_device([tokens.get(rid, 0) for _, rid in self.placeholders], dev)

    @torch.inference_mode()
    def fill_placeholders_on_device(self, ids: torch.Tensor, rows: dict[RequestId, int]) -> bool:
        """Writes in tokens a step sampled and left on the device (`ids[rows[request]]`,
        engine/sample/device_tokens.py) without reading them on the host; False, writing nothing,
        when a placeholder's request has no row there."""
        src = [rows.get(rid) for _, rid in self.placeholders]
        if None in src:
            return False
        if src:
            dev = self.input_ids.device
            self.input_ids[to_device([pos for pos, _ in self.placeholders], dev)] = ids[to_device(src, dev)]
        return True


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, hidden_layers: int = 0, slots: int | None = None) -> int:
    """G1 bytes per block: K and V of `slots` layers (every layer by default; a KV group's with
    several groups), plus `hidden_layers` exported hidden states."""
    if slots is None:
        slots = sum(cfg.kv_source(i) == i for i in range(cfg.num_layers))
    kv = slots * 2 * max(cfg.kv_widths) * cfg.kv_dtype.itemsize  # --kv-cache-dtype
    return block_size * (kv + hidden_layers * cfg.hidden_size * cfg.dtype.itemsize)  # hidden states: the weights' dtype


def new_kv_cache(cfg: ModelConfig, layout: KVLayout, num_blocks: int, block_size: int, device) -> torch.Tensor:
    """Zeroed G1 `[slots, 2, num_blocks, block_size, kv_heads, head_dim]`; with layers of different
    shapes, rows of the widest layer's width, `[..., 1, width]` (engine/kv/kv_groups.py)."""
    token_shape = (cfg.num_kv_heads, cfg.head_dim) if cfg.uniform_kv else (1, max(cfg.kv_widths))
    return torch.zeros(layout.slots, 2, num_blocks, block_size, *token_shape, dtype=cfg.kv_dtype, device=device)


def layer_cache_views(kv_cache: torch.Tensor, cfg: ModelConfig, layout: KVLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) as `[num_blocks, block_size, kv_heads, head_dim]` views of the cache
    (engine/kv/kv_groups.py): its slot's, or with per-layer shapes a strided view of its part of the row."""
    out = []
    for layer, (_, slot, part) in enumerate(layout.placement()):
        if cfg.uniform_kv:
            out.append((kv_cache[slot, 0], kv_cache[slot, 1]))
            continue
        heads, dim = cfg.kv_shape(layer)
        row = kv_cache.shape[-1]
        views = []
        for kv in (0, 1):
            base = kv_cache[slot, kv]
            views.append(base.as_strided((base.shape[0], base.shape[1], heads, dim), (base.shape[1] * row, row, dim, 1),
                                         base.storage_offset() + part * heads * dim))
        out.append((views[0], views[1]))
    return out


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int, device: str,
                 hidden_spec: HiddenStatesSpec | None = None, group_decodes: bool = True, *, max_rows: int,
                 max_model_len: int, forward: Callable[..., tuple[torch.Tensor, list[torch.Tensor]]] | None = None,
                 aux_layer_ids: tuple[int, ...] = (), layout: KVLayout | None = None,
                 peers: Peers | None = None, computes_logits: bool = True, graph_mode: GraphMode = GraphMode.NONE,
                 capture_sizes: tuple[int, ...] = (), lora: LoRASlots | None = None,
                 one_token_prefills: bool = False, backend: AttentionBackend | None = None) -> None:
        """`peers`: the other tensor-parallel ranks (engine/parallel/ranks.py), sent each step before
        this rank runs its shard; `computes_logits=False`: a worker rank, whose logits nobody reads;
        `graph_mode`/`capture_sizes`: decode steps through CUDA graphs (engine/runner/graphs.py),
        which pad into one more G1 block than the scheduler's `num_blocks`. `lora`: the adapters'
        slots in the model's projections (engine/lora/slots.py), told each step's rows.
        `one_token_prefills`: the backend's (a one-token prompt chunk goes to its prefill). `backend`:
        the attention backend; given, a piecewise `graph_mode` also runs the steps that do not only
        decode through engine/runner/piecewise.py (drafts leave it out)."""
        self.model = model
        self.lora = lora
        self.peers = peers
        self.computes_logits = computes_logits
        self.forward = forward or model  # engine/runner/compiled.py's CompiledForward, or the eager model
        self._backend = backend
        # The forward with attention through the op the piecewise graphs split at.
        self._op_forward = forward if forward is not None or backend is None else EagerThroughOp(model, backend)
        self.group_decodes = group_decodes  # the backend's `pads_decodes`
        self.one_token_prefills = one_token_prefills
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        self._dev = torch.device(device)
        # A block holds one KV group's layers, slot by slot (engine/kv/kv_groups.py); with one group,
        # every layer: [num_layers, 2, num_blocks, ...], which is what connectors copy from.
        self.layout = layout or KVLayout.single(cfg.num_layers, sources=cfg.kv_sources)
        graphs = graph_mode is not GraphMode.NONE
        self.kv_cache = new_kv_cache(cfg, self.layout, num_blocks + graphs, block_size, device)
        self.layer_caches = layer_cache_views(self.kv_cache, cfg, self.layout)
        self.layer_groups = tuple(g for g, _, _ in self.layout.placement())
        max_blocks = -(-max_model_len // block_size)
        self.batches = [InputBatch(max_rows, max_blocks, device) for _ in self.layout.groups]
        self.batch = self.batches[0]  # group 0's (connectors and drafts index that group)
        # Exported hidden states live in paged blocks beside the KV, so a prefix hit has them.
        self.hidden_spec = hidden_spec
        self.hidden_cache: torch.Tensor | None = None
        if hidden_spec is not None:
            self.hidden_cache = torch.zeros(num_blocks, block_size, len(hidden_spec.layer_ids), cfg.hidden_size,
                                            dtype=cfg.dtype, device=device)
        # EAGLE-3: these layers' residual streams, concatenated, are kept from each step (`last_aux`).
        self.aux_layer_ids = aux_layer_ids
        self.capture_ids = tuple(sorted(set(aux_layer_ids) | set(hidden_spec.capture_order if hidden_spec else ())))
        self.graphs = DecodeGraphs(graph_mode, capture_sizes, block_size=block_size, max_blocks=max_blocks,
                                   pad_block=num_blocks, device=device, masks=group_decodes,
                                   layer_groups=self.layer_groups if len(self.layout.groups) > 1 else (),
                                   capture_ids=self.capture_ids) if graphs else None
        self.pieces = PiecewiseGraphs(graph_mode, capture_sizes, device=device, capture_ids=self.capture_ids) \
            if graph_mode.piecewise and backend is not None else None
        # With decode graphs, a speculative verify entry (1 + k tokens over cached context) becomes
        # 1 + k decode rows, row j seeing the context up to its own token (the step writes all of
        # their K/V before attending), so verify steps replay the decode graphs too. Each row reads
        # the context again: k more reads of it, against a launch per kernel saved.
        self._verify_as_decodes = graphs
        self.last_aux: torch.Tensor | None = None
        # A model that takes images: their encoder outputs, kept by digest (engine/mm/encoder.py).
        self.encoder = EncoderCache(model.encode_images) if cfg.multimodal else None
        # How image placeholders attend in the prefill: their spans go to the attention metadata.
        attn = cfg.image_spec.attention if cfg.multimodal else ImageAttention.CAUSAL
        self._image_spans = attn is not ImageAttention.CAUSAL
        self._spans_sliding_only = attn is ImageAttention.BIDIRECTIONAL_SLIDING

    def use_eager(self) -> None:
        """Runs the model as it is from now on (the compiled forward failed)."""
        self.forward = self.model
        if self._backend is not None:
            self._op_forward = EagerThroughOp(self.model, self._backend)

    def synchronize(self) -> None:
        """Waits for the queued device work: on a GPU a forward returns once launched, and a step's
        forward time (stats, the step-cost fits) must be the GPU's, not the launches'."""
        if self.kv_cache.is_cuda:
            torch.cuda.current_stream(self.kv_cache.device).synchronize()

    def timer(self) -> StepTimer:
        """Times a forward without waiting for it (engine/runner/step_timer.py)."""
        return StepTimer(self._dev)

    def capture_graphs(self) -> None:
        """Captures the decode graphs and the piecewise ones, into one pool (after warm-up: the forward
        is compiled, G1 in place)."""
        if self.graphs is None or not self.graphs.mode.captures:
            return
        pool = torch.cuda.graph_pool_handle()
        self.graphs.capture(self.forward, self.layer_caches, pool)
        if self.pieces is not None:
            self.pieces.capture(self._op_forward, self.layer_caches, pool)

    def release(self, req_id: RequestId) -> None:
        """The request finished: its input-batch row is free for another (on every rank)."""
        self._drop(req_id)
        if self.peers is not None:
            self.peers.release(req_id)

    def _drop(self, req_id: RequestId) -> None:
        for batch in self.batches:
            batch.release(req_id)

    def check_peers(self) -> None:
        """Raises (engine/parallel/ranks.RankFailed) when another rank has exited."""
        if self.peers is not None:
            self.peers.check_alive()

    def close(self) -> None:
        """Stops the other ranks, if any."""
        if self.peers is not None:
            self.peers.close()
            self.peers = None

    def execute(self, plan: RunPlan, block_tables: list[list[int]]) -> ModelOutput:
        return self.run(self.prepare(plan, block_tables))

    @torch.inference_mode()
    def run(self, step: StepInputs) -> ModelOutput:
        """The forward and the logits of the sampled rows (placeholders must be filled)."""
        if self.peers is not None:  # the other ranks run it too, with the placeholders' tokens
            filled = {rid: int(step.input_ids[pos]) for pos, rid in step.placeholders}
            self.peers.step(step.plan, step.tables, filled)
        capture = self.capture_ids
        if self.lora is not None:
            self.lora.set_step(step.lora)
        if step.mm is not None:  # one step in a prompt's life: eager (the compiled graph takes token ids only)
            hidden, captured = self.model(step.input_ids, step.positions, self.layer_caches, step.meta, capture,
                                          mm=step.mm)
        elif self.graphs is not None and self.graphs.fits(step.meta, step.input_ids.shape[0]):
            hidden, captured = self.graphs.run(self.forward, self.layer_caches, step.input_ids, step.positions,
                                               step.meta)
        elif self.pieces is not None and self.pieces.fits(step.input_ids.shape[0]):
            hidden, captured = self.pieces.run(self._op_forward, self.layer_caches, step.input_ids, step.positions,
                                               step.meta)
        else:
            hidden, captured = self.forward(step.input_ids, step.positions, self.layer_caches, step.meta, capture)
        if self.hidden_cache is not None:
            states = torch.stack([captured[capture.index(i)] for i in self.hidden_spec.layer_ids], dim=1)
            n, h = states.shape[1:]
            self.hidden_cache.view(-1, n, h).index_copy_(0, step.meta.slot_mapping, states)
        if self.aux_layer_ids:  # EAGLE-3 features: the aux layers side by side, in their given order
            self.last_aux = torch.cat([captured[capture.index(i)] for i in self.aux_layer_ids], dim=-1)
        rows = step.sample_rows if self.computes_logits else []
        # Rows rise strictly, so a last row of len - 1 means all of them (a decode step): a view then,
        # where an index would be one more copy to the device.
        if rows:
            picked = hidden[:len(rows)] if rows[-1] == len(rows) - 1 else hidden[to_device(rows, self._dev)]
            logits = self.model.compute_logits(picked)
        else:
            logits = hidden.new_empty(0, 0)
        prompt = prompt_logprobs(hidden, step.prompt_rows, self.model.compute_logits) \
            if step.prompt_rows and self.computes_logits else {}
        return ModelOutput(logits.float(), step.sampled, step.row_starts, prompt)

    @torch.inference_mode()  # inference tensors, as at warm-up: the compiled graph's guards see no change
    def prepare(self, plan: RunPlan, block_tables: list) -> StepInputs:
        """Input ids, positions and attention metadata of a step (its new tokens, proposals
        included), and the rows whose logits are sampled. A request's tokens start after those
        computed or in flight; the ones not sampled yet become placeholders. `block_tables[i]`:
        the i-th request's table per KV group (a tuple), or its one table (a list)."""
        for rid in plan.released:  # every rank drops these itself: they travel in the plan
            self._drop(rid)
        input_ids: list[int] = []
        positions: list[int] = []
        spans: list[tuple[int, int, int]] = []  # each request's (first query row, query tokens, context length)
        sample_rows: list[int] = []
        sampled: list[int] = []
        row_starts: list[int] = []
        placeholders: list[tuple[int, RequestId]] = []
        prompt_rows: list[PromptRows] = []
        for idx, item in enumerate(plan.requests):
            n, spec, start = item.num_new_tokens, item.spec_token_ids, item.start
            q_start = len(input_ids)
            input_ids.extend(item.token_ids)
            for _ in range(item.num_placeholders):
                placeholders.append((len(input_ids), item.request_id))
                input_ids.append(0)
            input_ids.extend(spec)
            positions.extend(range(start, start + n))
            spans.append((q_start, n, start + n))
            if item.prompt_logprobs is not None and (pick := select_prompt_rows(
                    idx, item.prompt_token_ids, start, n - len(spec), q_start, item.prompt_logprobs)):
                prompt_rows.append(pick)
            if item.samples:
                row_starts.append(len(sample_rows))
                sample_rows.extend(range(q_start + n - 1 - len(spec), q_start + n))
                sampled.append(idx)
        positions_t = to_device(positions, self._dev)
        counts = to_device([s.num_new_tokens for s in plan.requests], self._dev)
        tables = [t if isinstance(t, tuple) else (t,) for t in block_tables]
        metas = [self._group_meta(g, plan, [t[g] for t in tables], spans, positions_t, counts)
                 for g in range(len(self.batches))]
        meta = metas[0] if len(metas) == 1 else replace(metas[0], groups=tuple(metas), layer_groups=self.layer_groups)
        return StepInputs(to_device(input_ids, self._dev), positions_t, meta,
                          sample_rows, sampled, row_starts, placeholders, prompt_rows, plan, block_tables,
                          self._image_embeddings(plan, spans), self._lora_rows(plan, spans))

    def _lora_rows(self, plan: RunPlan, spans: list[tuple[int, int, int]]) -> list[tuple[int, LoRARows]]:
        """Each adapter slot's query rows in the step (the requests with no adapter have none):
        a slice when they are side by side (the scheduler orders a step by adapter), else indices."""
        if self.lora is None:
            return []
        rows: dict[int, list[int]] = {}
        for item, (q_start, n, _) in zip(plan.requests, spans):
            if item.lora_slot >= 0:
                rows.setdefault(item.lora_slot, []).extend(range(q_start, q_start + n))
        return [(slot, slice(r[0], r[-1] + 1) if r[-1] - r[0] + 1 == len(r) else
                 to_device(r, self._dev)) for slot, r in sorted(rows.items())]

    def _image_embeddings(self, plan: RunPlan, spans: list[tuple[int, int, int]]
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's image placeholder rows and their embeddings (the encoder's, or its cache's)."""
        if self.encoder is None or not any(item.mm for item in plan.requests):
            return None
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        for item, (q_start, n, _) in zip(plan.requests, spans):
            for it, emb in zip(item.mm, self.encoder.features(item.mm)):
                lo, hi = max(item.start, it.offset), min(item.start + n, it.end)
                rows.extend(range(q_start + lo - item.start, q_start + hi - item.start))
                parts.append(emb[lo - it.offset:hi - it.offset])
        return to_device(rows, self._dev), torch.cat(parts).to(self.device)

    def _group_meta(self, group: int, plan: RunPlan, tables: list[list[int]],
                    spans: list[tuple[int, int, int]], positions_t: torch.Tensor, counts: torch.Tensor
                    ) -> AttentionMetadata:
        """One KV group's slots, prefill block lists and decode tables for the step."""
        bs, batch = self.block_size, self.batches[group]
        batch_rows = [batch.sync(s.request_id, t) for s, t in zip(plan.requests, tables)]
        prefills: list[PrefillSeq] = []
        decode_rows: list[int] = []
        decode_batch_rows: list[int] = []
        decode_lens: list[int] = []
        for (q_start, n, ctx), row, table, item in zip(spans, batch_rows, tables, plan.requests):
            one_row = n == 1 and ctx > 1 and not (item.in_prompt and self.one_token_prefills)
            if one_row or (self._verify_as_decodes and item.spec_token_ids and ctx > n):
                for j in range(n):  # a verify entry's tokens: one decode row each, seeing up to itself
                    decode_rows.append(q_start + j)
                    decode_batch_rows.append(row)
                    decode_lens.append(ctx - n + 1 + j)
            else:
                ids = table[: -(-ctx // bs)]
                run = ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else None
                prefills.append(PrefillSeq(q_start, n, ctx, torch.tensor(ids, dtype=torch.long), run,
                                           bidir=tuple((it.offset, it.end) for it in item.mm)
                                           if self._image_spans else (),
                                           bidir_sliding_only=self._spans_sliding_only))
        token_rows = to_device(batch_rows, self._dev).repeat_interleave(counts)
        return AttentionMetadata(
            slot_mapping=batch.block_table[token_rows, positions_t // bs] * bs + positions_t % bs,
            prefills=prefills,
            decodes=self._decode_groups(batch, decode_rows, decode_batch_rows, decode_lens),
        )

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One 2-token forward into the first block(s) (free at start-up; a sequence that later gets
        them writes each slot before reading it), so that a compiled model compiles here and not
        in the first request's step."""
        blocks = torch.arange(-(-2 // self.block_size), dtype=torch.long)
        meta = AttentionMetadata(slot_mapping=torch.tensor([0, 1], dtype=torch.long, device=self.device),
                                 prefills=[PrefillSeq(0, 2, 2, blocks, first_block=0)], decodes=[])
        ids = torch.zeros(2, dtype=torch.long, device=self.device)
        self.forward(ids, torch.arange(2, device=self.device), self.layer_caches, meta, self.capture_ids)

    def _decode_groups(self, batch: InputBatch, rows: list[int], batch_rows: list[int], lens: list[int]
                       ) -> list[DecodeGroup]:
        """Split decodes, shortest first, into groups whose padding stays under ~25%; or, for a
        backend that does not pad, one group, longest first (the longest rows start first).
        `rows`: query rows; `batch_rows`: their input-batch rows; `lens`: their context lengths."""
        if not rows:
            return []
        if not self.group_decodes:
            order = sorted(range(len(rows)), key=lambda i: -lens[i])
            return [self._decode_group(batch, [rows[i] for i in order], [batch_rows[i] for i in order],
                                       [lens[i] for i in order])]
        order = sorted(range(len(rows)), key=lambda i: lens[i])
        groups: list[list[int]] = []
        bs = self.block_size
        for i in order:
            g = groups[-1] if groups else None
            # A new group pays one more attention call; only worth it once it is big enough.
            if g is None or (len(g) >= MIN_DECODE_GROUP and -(-lens[i] // bs) > 1.25 * -(-lens[g[0]] // bs)):
                groups.append([i])
            else:
                g.append(i)
        return [self._decode_group(batch, [rows[i] for i in g], [batch_rows[i] for i in g], [lens[i] for i in g])
                for g in groups]

    def _decode_group(self, batch: InputBatch, rows: list[int], batch_rows: list[int], lens: list[int]) -> DecodeGroup:
        width = -(-max(lens) // self.block_size)
        # Entries past a row's own blocks are stale or 0; the mask and the kernels' lengths skip them.
        padded = batch.block_table[to_device(batch_rows, self._dev), :width]
        lens_t = to_device(lens, self._dev)
        mask = torch.arange(width * self.block_size, device=self.device).unsqueeze(0) < lens_t.unsqueeze(1)
        return DecodeGroup(to_device(rows, self._dev), padded, lens_t,
                           mask[:, None, None, :])
