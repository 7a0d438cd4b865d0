"""Loads a local Hugging Face checkpoint: config, safetensors weights (sharded or not), tokenizer."""
from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine import cpu_kernels
from engine.runner.attention import AttentionBackend
from engine.model_config import ModelConfig
from engine.models import SUPPORTED_ARCHITECTURES
from engine.models.packed_linear import PackedLinear, pack_linears, packing_available
from engine.runner.kv_quant import is_scale_weight
from engine.parallel.shard import TPShard

log = logging.getLogger(__name__)


def weight_files(model_dir: Path) -> list[str]:
    """Names of the safetensors files the weights are loaded from (and the fingerprint hashes)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {model_dir}")
    return files


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for name in weight_files(model_dir):
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def load_model(model_dir: Path, cfg: ModelConfig, backend: AttentionBackend, max_len: int, device: str,
               fused_ops: bool = True, compiled: bool = False, shard: TPShard | None = None,
               full_config: ModelConfig | None = None):
    """`compiled`: for torch.compile (engine/runner/compiled.py), which fuses the norms and rotary
    embedding by itself, so the eager fused C++ ops are not switched on. `shard`: a tensor-parallel
    rank's part (`cfg` its shapes, `full_config` the checkpoint's; engine/parallel/shard.py)."""
    start = time.perf_counter()
    spec = SUPPORTED_ARCHITECTURES[cfg.architecture]
    with torch.device("meta"):
        # Build on meta first so a large model is not initialised twice.
        model = spec.model_cls(cfg, backend, max_len)
    model = model.to_empty(device=device).to(cfg.dtype)
    model.reset_rope(max_len, device)  # to_empty() left the rope buffers uninitialised
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    # KV scales (an fp8 cache's) are not weights: engine/runner/kv_quant.py reads them.
    tensors = ((k, v) for k, v in iter_safetensors(model_dir) if not is_scale_weight(k))
    if shard is not None:
        tensors = shard.weights(full_config or cfg, tensors)
    model.load_weights((k, v.to(cfg.dtype)) for k, v in tensors)
    model.eval().requires_grad_(False)
    cpu = device == "cpu" and cfg.dtype in (torch.float32, torch.bfloat16)
    if cpu and packing_available(cfg.dtype):
        packed = pack_linears(model)
        kernels = Counter(m.kernel.value for m in model.modules() if isinstance(m, PackedLinear))
        own = " (amx and f32 are kvtier's own: engine/cpu_kernels/linear.py)" if {"amx", "f32"} & set(kernels) else ""
        log.info("prepacked %d linear layers, by kernel: %s%s", packed,
                 ", ".join(f"{n} {k}" for k, n in sorted(kernels.items())) or "none", own)
    if cpu and fused_ops and not compiled and cfg.head_dim <= 512 and model.supports_fused_cpu_ops \
            and cpu_kernels.get() is not None:
        model.use_fused_cpu_ops()
        log.info("norms and rotary embedding run as fused C++ ops")
    log.info("loaded %s (%s, %d layers) from %s in %.1fs", cfg.architecture, cfg.dtype, cfg.num_layers,
             model_dir, time.perf_counter() - start)
    return model


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
