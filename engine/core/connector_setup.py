"""The engine's KV connector from its config: offload tiers, a kv_transfer_config, or none.

Under tensor parallelism every rank builds the offload tiers for its own shard: the namespace
names the layout (`tp{size}.{rank}`), so no rank, and no engine of another TP size, reads
another's entries; the G2 and G3 sizes given are the engine's, split evenly across the ranks (as
vLLM's kv_offloading_size is)."""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from dataclasses import dataclass

import msgspec
import torch

from connectors.base import KVConnector
from connectors.codec import BlockLayout
from connectors.factory import ConnectorContext, build_connector, builds_tiered, has_hidden_states_connector
from connectors.hidden_spec import HiddenStatesSpec
from connectors.sharded import TransferPeers
from engine.config import EngineConfig, offload_flags_on
from engine.model_config import FP8_DTYPES, KVScale, ModelConfig, resolve_offload_dtype
from engine.runner import kv_quant
from engine.runner.kv_quant import ReduceMax
from engine.runner.loader import weight_files
from engine.kv.fingerprint import fingerprint_description, namespace_digest
from engine.runner.model_runner import ModelRunner
from kvstore.events import EventBuffer
from kvstore.g1 import BlockPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadQuant:
    """--kv-offload-dtype: the offload tiers' KV dtype (narrower than G1's) and, for fp8, per-layer
    scales (engine/runner/kv_quant.py); entries are narrowed on the way down (connectors/codec.py)."""

    dtype: torch.dtype
    scales: tuple[KVScale, ...] = ()

    @classmethod
    def make(cls, name: str, mc: ModelConfig, model: torch.nn.Module, model_dir: Path, tokenizer, block_size: int,
             device: str, max_len: int, reduce_max: ReduceMax = None) -> OffloadQuant | None:
        """For --kv-offload-dtype `name` (None when the tiers keep G1's dtype). Before G1's own fp8
        scales are set: calibration needs unscaled attention. Every tensor-parallel rank calls this
        at the same point of its start-up, with `reduce_max` (engine/runner/kv_quant.calibrate)."""
        dtype = resolve_offload_dtype(name, mc.kv_dtype)
        if dtype is None:
            return None
        scales: tuple[KVScale, ...] = ()
        if dtype in FP8_DTYPES:
            scales, source = kv_quant.scales_for(model, mc, dtype, model_dir, weight_files(model_dir), tokenizer,
                                                 block_size, device, max_len, reduce_max)
            log.info("offload tiers store %s KV: per-layer scales %s; %s", str(dtype)[6:], source,
                     kv_quant.describe(scales))
        else:
            log.info("offload tiers store %s KV (G1: %s)", str(dtype)[6:], str(mc.kv_dtype)[6:])
        return cls(dtype, scales)

    def slot_scales(self, mc: ModelConfig, runner: ModelRunner) -> tuple[tuple[float, float], ...]:
        """Per cache slot (a layer that owns its KV, in order, with one KV group), its (k, v)."""
        if not self.scales:
            return ()
        if len(runner.layout.groups) > 1 or not mc.uniform_kv:
            raise ValueError("kv_offload_dtype fp8 with several KV groups or per-layer KV shapes is not built")
        return tuple((s.k, s.v) for i, s in enumerate(self.scales) if mc.kv_source(i) == i)


class OffloadSettings(msgspec.Struct, frozen=True):
    """The engine settings the connector is built from (EngineConfig's, by the same names): what a
    tensor-parallel worker gets to build its own tiers (engine/parallel/ranks.WorkerSpec)."""

    enable_prefix_caching: bool
    block_size: int
    kv_namespace: str | None
    kv_offload_block_size: int
    kv_eviction_policy: str | dict[str, Any]
    kv_offloading_size: float | None
    kv_offload_disk: str | None
    kv_offload_disk_size: float
    kv_offload_remote: str | None
    kv_transfer_config: dict[str, Any] | None
    kv_offload_secret: bytes | None
    kv_offload_remote_trusted: bool

    @classmethod
    def of(cls, cfg: EngineConfig) -> OffloadSettings:
        return cls(**{f: getattr(cfg, f) for f in cls.__struct_fields__})

    @property
    def offload_enabled(self) -> bool:
        return offload_flags_on(self.kv_offloading_size, self.kv_offload_disk, self.kv_offload_remote)

    @property
    def tiered(self) -> bool:
        """Whether these settings build the tiered offload connector (which every rank runs a share of)."""
        return builds_tiered(self.kv_transfer_config, self.offload_enabled)


def make_connector(cfg: OffloadSettings, mc: ModelConfig, model_dir: Path, hidden_spec: HiddenStatesSpec | None,
                   pool: BlockPool, events: EventBuffer | None, runner: ModelRunner,
                   rank: int = 0, tp_size: int = 1, peers: TransferPeers | None = None,
                   offload: OffloadQuant | None = None) -> KVConnector | None:
    """Builds the connector (None when nothing asks for one) and registers the runner's caches.
    `rank` / `tp_size`: which tensor-parallel shard this process holds (its tiers' namespace);
    `peers`: on rank 0 of several, the other ranks, which run the connector's plans too;
    `offload`: the tiers' narrower KV dtype (--kv-offload-dtype)."""
    tc = dict(cfg.kv_transfer_config or {})
    if not (cfg.offload_enabled or tc):
        if hidden_spec is not None:
            raise ValueError("speculative_config extract_hidden_states needs kv_transfer_config with "
                             '{"kv_connector": "HiddenStatesConnector", "kv_connector_extra_config": '
                             '{"shared_storage_path": DIR}}')
        return None
    explicit_tiers = isinstance(tc.get("kv_connector_extra_config"), dict) and "tiers" in tc["kv_connector_extra_config"]
    if (cfg.offload_enabled or explicit_tiers) and not cfg.enable_prefix_caching:
        raise ValueError("KV offload needs prefix caching (block keys); drop --no-enable-prefix-caching")
    extra = dict(tc.get("kv_connector_extra_config") or {})
    desc = fingerprint_description(model_dir, mc, cfg.block_size, cfg.kv_namespace)
    fp = namespace_digest(desc)
    # What the persistent tiers record about their namespace (kvstore.namespace_info): for people.
    info: dict[str, Any] = {"model": str(model_dir), "dtype": str(mc.dtype), "kv_dtype": str(mc.kv_dtype),
                            "offload_block_tokens": cfg.kv_offload_block_size, "fingerprint": desc}
    hs = hidden_spec
    if hs is not None:  # blocks carry hidden states too: a G3 namespace of their own
        fp = hashlib.sha256(fp + repr(hs.layer_ids).encode()).digest()[:16]
        info["hidden_state_layers"] = list(hs.layer_ids)
    groups = runner.layout.groups
    grouped = len(groups) > 1 or any(g.window for g in groups)
    if grouped:  # an entry holds one group's layers: a namespace per layout
        fp = hashlib.sha256(fp + repr([(g.layer_ids, g.window, g.per_slot) for g in groups]).encode()).digest()[:16]
        info["kv_groups"] = [{"layers": list(g.layer_ids), "window": g.window} for g in groups]
    if offload is not None:  # other bytes for the same tokens: a namespace of their own
        fp = hashlib.sha256(fp + repr((str(offload.dtype), [(x.k, x.v) for x in offload.scales])).encode()).digest()[:16]
        info["offload_dtype"] = str(offload.dtype)
        if offload.scales:
            info["offload_kv_scales"] = [[x.k, x.v] for x in offload.scales]
    if tp_size > 1:  # this rank's shard of each block: a namespace of its own
        fp = hashlib.sha256(fp + f"tp{tp_size}.{rank}".encode()).digest()[:16]
        info["tensor_parallel"] = {"size": tp_size, "rank": rank}
    # Connectors may override the offload block size in their extra config ("block_size").
    # The cache tensor's own shape: with per-layer head sizes it is rows of the widest layer, and
    # layers that reuse another's KV have no slot (engine/kv/kv_groups.py).
    slots, _, _, _, kv_heads, head_dim = runner.kv_cache.shape
    layout = BlockLayout(slots, cfg.kv_offload_block_size // cfg.block_size, cfg.block_size,
                         kv_heads, head_dim, offload.dtype if offload else mc.kv_dtype, fp.hex(),
                         hs.layer_ids if hs else (), mc.hidden_size if hs else 0, mc.dtype,
                         g1_dtype=mc.kv_dtype if offload else None,
                         kv_scales=offload.slot_scales(mc, runner) if offload else ())
    ctx = ConnectorContext(layout, pool, fp, cfg.kv_eviction_policy, cfg.kv_offloading_size,
                           cfg.kv_offload_disk, cfg.kv_offload_disk_size, extra, events,
                           hidden_spec=hs, model_name=model_dir.name, remote_url=cfg.kv_offload_remote,
                           kv_secret=cfg.kv_offload_secret, remote_trusted=cfg.kv_offload_remote_trusted,
                           namespace_info=info, size_share=1 / tp_size)
    connector = build_connector(ctx, tc)
    if connector is not None and grouped:
        connector.set_kv_groups(tuple(g.window for g in groups))
    if connector is not None and peers is not None:
        connector.shard_over(peers)
    if connector is not None:
        connector.register_kv_caches(runner.kv_cache)
        if runner.hidden_cache is not None:
            if not has_hidden_states_connector(connector):
                raise ValueError("speculative_config extract_hidden_states needs the HiddenStatesConnector in "
                                 "kv_transfer_config (alone, or inside a MultiConnector)")
            connector.register_hidden_cache(runner.hidden_cache)
    return connector
