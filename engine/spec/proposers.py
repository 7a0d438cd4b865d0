"""Builds the proposer a `speculative_config` names, with what the engine needs to know first:
the G1 bytes per block its KV adds and the target layers it reads."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.runner.attention import AttentionBackend
from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.spec.draft_proposer import DraftModelProposer, draft_model_config
from engine.spec.eagle3_proposer import Eagle3Proposer
from engine.kv.kv_cache_manager import KVCacheManager
from engine.runner.loader import load_model
from engine.runner.graphs import graph_mode_for
from engine.runner.model_runner import ModelRunner, kv_cache_bytes_per_block
from engine.models.eagle3 import Eagle3Config, Eagle3Draft, load_eagle3_config
from engine.models.packed_linear import pack_linears, packing_available
from engine.spec.config import SpeculativeConfig, SpecMethod
from engine.spec.decode import Proposer, ngram_proposer


@dataclass(frozen=True)
class DraftPlan:
    """What a draft needs before the target's runner and G1 exist (checked, nothing loaded)."""

    spec: SpeculativeConfig
    draft: ModelConfig | None = None  # draft_model
    eagle3: Eagle3Config | None = None

    @staticmethod
    def make(spec: SpeculativeConfig, config: EngineConfig, target: ModelConfig) -> DraftPlan:
        if spec.method is SpecMethod.DRAFT_MODEL:
            return DraftPlan(spec, draft=draft_model_config(Path(spec.model), config.dtype, config.device, target))
        if spec.method is SpecMethod.EAGLE3:
            return DraftPlan(spec, eagle3=load_eagle3_config(Path(spec.model), target))
        return DraftPlan(spec)

    def kv_bytes_per_block(self, block_size: int) -> int:
        """The draft's KV per G1 block: it indexes the target's block ids."""
        layer = self.draft or (self.eagle3.layer if self.eagle3 else None)
        return kv_cache_bytes_per_block(layer, block_size) if layer is not None else 0

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return self.eagle3.aux_layer_ids if self.eagle3 else ()

    def build(self, config: EngineConfig, backend: AttentionBackend, num_blocks: int, max_len: int,
              target: torch.nn.Module, kv: KVCacheManager, generator: torch.Generator) -> Proposer:
        if self.draft is None and self.eagle3 is None:
            return ngram_proposer(self.spec)
        bs, dev = config.block_size, config.device
        if self.draft is not None:
            model, layer = load_model(Path(self.spec.model), self.draft, backend, max_len, dev), self.draft
        else:
            layer = self.eagle3.layer
            model = Eagle3Draft(self.eagle3, backend, max_len).to(dev, layer.dtype)
            model.load(Path(self.spec.model), target.embed_tokens.weight)
            model.eval().requires_grad_(False)
            if dev == "cpu" and layer.dtype in (torch.float32, torch.bfloat16) and packing_available(layer.dtype):
                pack_linears(model)  # oneDNN's prepacked GEMMs, as the target's
        # Proposal steps after the first decode one token per request: they replay the draft's own
        # decode graphs (EAGLE-3's proposer captures its own: its forward also takes fed-back rows).
        runner = ModelRunner(model, layer, num_blocks, bs, dev, group_decodes=backend.pads_decodes,
                             max_rows=config.max_num_seqs, max_model_len=max_len,
                             graph_mode=graph_mode_for(config.cudagraph_mode, model),
                             capture_sizes=config.cudagraph_capture_sizes or ())
        if self.draft is not None:
            runner.capture_graphs()
            return DraftModelProposer(runner, kv, generator)
        return Eagle3Proposer(runner, kv, generator)
