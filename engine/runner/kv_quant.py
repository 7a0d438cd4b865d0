"""fp8 KV scales (--kv-cache-dtype fp8, fp8_e4m3, fp8_e5m2): where each layer's come from.

An fp8 cache holds K / k_scale and V / v_scale, one pair per layer (engine/runner/attention.py
applies them: attention over the dequantized values, no dequantized copy). The scales come from
the checkpoint when it has them (vLLM's per-tensor static `self_attn.k_scale` / `v_scale`), else
from a calibration prefill at start-up: the model reads `CALIBRATION_TEXT` into a model-dtype
cache, and a layer's scale is the power of two that puts its largest |K| (|V|), times `HEADROOM`,
just under the format's largest value.

Why per layer (per tensor), static, and a power of two (benchmarks/kv_quant.py has the figures):
- A per-layer scale folds into the softmax scale and the output, so every attention path reads
  the bytes as they are; per-token or per-head scales need a scale beside every row in G1 and in
  every tier's entries, and kernels that read it.
- Dividing by a power of two is exact: the only error is fp8's rounding, and a scale computed on
  another machine (last-bit differences in the calibration forward) is almost always the same
  one. The scales are part of the model fingerprint, so offload entries written under other
  scales are never read under these.
- Static: the same prompt's KV gets the same bytes whatever ran before it, so prefix caching and
  the tiers stay exact with respect to a fresh fp8 run.
"""
from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from engine.kv.kv_groups import KVLayout
from engine.model_config import FP8_DTYPES, KVScale, ModelConfig
from engine.runner.attention import AttentionMetadata, PrefillSeq

log = logging.getLogger(__name__)

# Room above the calibration text's largest |K| / |V| for prompts that reach further (5 of e4m3's
# ~18 binades; values past it saturate rather than overflow). On the demo model, fp8_e4m3
# perplexity over held-out text: +1.02% at 2x and 8x, +0.93% at 32x (docs/performance/kv-quant.md):
# the binades given up at the bottom cost less than clipping the values a calibration text misses.
HEADROOM = 32.0

# Prose, dialogue, code and numbers: a few hundred tokens whose K/V ranges stand for a prompt's.
CALIBRATION_TEXT = """\
The history of the printing press begins in the fifteenth century, when movable metal type made it
possible to reproduce books far more quickly than scribes could copy them. Within fifty years,
presses were operating in more than two hundred cities across Europe.

User: Can you explain what a hash table is, and why lookups are usually fast?
Assistant: A hash table stores key-value pairs in an array. A hash function turns each key into an
index, so finding a value takes a constant number of steps on average, no matter how many items
the table holds. Collisions, where two keys map to the same slot, are handled by chaining or by
probing for the next free slot.

def fibonacci(n: int) -> list[int]:
    sequence = [0, 1]
    while len(sequence) < n:
        sequence.append(sequence[-1] + sequence[-2])
    return sequence[:n]

Quarterly revenue rose 12.5% to $4,830 million, while operating costs fell from 3,120 to 2,947.
The temperature on 14 March 2024 ranged between -3.2 and 11.8 degrees Celsius; rainfall: 0.4 mm.

Mitochondria convert nutrients into adenosine triphosphate, the molecule cells use to store and
transfer energy. Photosynthesis in chloroplasts does the reverse: it captures light to build sugars.
¿Dónde está la estación? Wo ist der Bahnhof? Où est la gare? 駅はどこですか？
"""

# Takes a float32 tensor and leaves in it the elementwise max over the tensor-parallel ranks (None
# with one rank): every rank then gets the same scales, the ones one rank holding every head would.
ReduceMax = Callable[[torch.Tensor], None] | None

_SCALE_NAME = re.compile(r"(?:model\.)?layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?([kv])_scale$")


def is_scale_weight(name: str) -> bool:
    """A checkpoint's KV-scale tensor (read here, skipped by the weight loader)."""
    return _SCALE_NAME.match(name) is not None


def checkpoint_scales(model_dir: Path, files: list[str], num_layers: int) -> tuple[KVScale, ...] | None:
    """The checkpoint's per-layer (k_scale, v_scale), or None when it has none. A checkpoint with
    scales for some layers only, or scales that are not positive and finite, is an error."""
    found: dict[tuple[int, str], float] = {}
    for name in files:
        with safe_open(str(model_dir / name), framework="pt") as f:
            for key in f.keys():
                m = _SCALE_NAME.match(key)
                if m:
                    found[(int(m.group(1)), m.group(2))] = float(f.get_tensor(key).float().reshape(-1)[0])
    if not found:
        return None
    missing = [f"layer {i} {kv}_scale" for i in range(num_layers) for kv in "kv" if (i, kv) not in found]
    if missing:
        raise ValueError(f"the checkpoint has KV scales for some layers only: missing {', '.join(missing[:4])}")
    try:
        return tuple(KVScale(found[(i, "k")], found[(i, "v")]) for i in range(num_layers))
    except ValueError as e:
        raise ValueError(f"the checkpoint's KV scales: {e}") from None


def power_of_two_scale(amax: float, dtype: torch.dtype) -> float:
    """The smallest power of two s with amax * HEADROOM / s <= the format's largest value."""
    if not math.isfinite(amax) or amax <= 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * HEADROOM / torch.finfo(dtype).max))


@torch.inference_mode()
def calibrate(model: torch.nn.Module, mc: ModelConfig, token_ids: list[int], block_size: int,
              device: str, reduce_max: ReduceMax = None) -> tuple[KVScale, ...]:
    """Per-layer power-of-two scales from one prefill of `token_ids` into a model-dtype cache (the
    model's attention must be unscaled). A layer reusing another's KV (Gemma 4) gets its scales.
    Under tensor parallelism every rank runs this forward together (its all-reduces meet) and
    `reduce_max` takes each layer's largest |K| and |V| over the ranks' heads."""
    from engine.runner.model_runner import layer_cache_views, new_kv_cache

    plain = replace(mc, cache_dtype=None, kv_scales=())
    layout = KVLayout.single(mc.num_layers, sources=mc.kv_sources)  # every layer a slot of its own
    n = len(token_ids)
    nblocks = -(-n // block_size)
    cache = new_kv_cache(plain, layout, nblocks, block_size, device)
    views = layer_cache_views(cache, plain, layout)
    blocks = torch.arange(nblocks, dtype=torch.long)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=device),
                             prefills=[PrefillSeq(0, n, n, blocks, first_block=0)], decodes=[])
    model(torch.tensor(token_ids, device=device), torch.arange(n, device=device), views, meta, ())
    # A layer reusing another's KV writes no cache of its own: its row stays 0 and takes its source's.
    amax = torch.zeros(mc.num_layers, 2, dtype=torch.float32)
    for layer in range(mc.num_layers):
        if mc.kv_source(layer) == layer:
            for j, c in enumerate(views[layer]):
                amax[layer, j] = c.float().abs().amax()  # unwritten slots are zeros
    if reduce_max is not None:
        reduce_max(amax)
    return tuple(KVScale(power_of_two_scale(float(amax[s, 0]), mc.kv_dtype),
                         power_of_two_scale(float(amax[s, 1]), mc.kv_dtype))
                 for s in map(mc.kv_source, range(mc.num_layers)))


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's attention modules, in layer order (those that take a `KVScale`)."""
    found = [m for m in model.modules() if callable(getattr(m, "use_kv_scale", None))]
    return sorted(found, key=lambda m: m.layer_idx)


def scales_for(model: torch.nn.Module, mc: ModelConfig, dtype: torch.dtype, model_dir: Path, files: list[str],
               tokenizer, block_size: int, device: str, max_len: int,
               reduce_max: ReduceMax = None) -> tuple[tuple[KVScale, ...], str]:
    """Per-layer scales for fp8 `dtype`, and where they came from: the checkpoint's, else
    calibrated on `CALIBRATION_TEXT`'s first `max_len` tokens at most (the model's rotary tables
    end there). The model's attention must be unscaled."""
    scales = checkpoint_scales(model_dir, files, mc.num_layers)
    if scales is not None:
        return scales, "the checkpoint's k_scale/v_scale"
    ids = tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"][:max_len]
    return calibrate(model, replace(mc, cache_dtype=dtype), ids, block_size, device, reduce_max), \
        f"calibrated on {len(ids)} tokens, {HEADROOM:g}x headroom"


def describe(scales: tuple[KVScale, ...]) -> str:
    ks, vs = [s.k for s in scales], [s.v for s in scales]
    return f"k {min(ks):g}..{max(ks):g}, v {min(vs):g}..{max(vs):g}"


def prepare(model: torch.nn.Module, mc: ModelConfig, model_dir: Path, files: list[str], tokenizer,
            block_size: int, device: str, max_len: int, reduce_max: ReduceMax = None) -> ModelConfig:
    """For an fp8 cache: the layers' scales (`scales_for`), given to the model's attention
    modules, and `mc` carrying them (its fingerprint then names them). Every tensor-parallel rank
    calls this at the same point of its start-up, with `reduce_max`."""
    if mc.kv_dtype not in FP8_DTYPES:
        return mc
    scales, source = scales_for(model, mc, mc.kv_dtype, model_dir, files, tokenizer, block_size, device, max_len,
                                reduce_max)
    modules = attention_modules(model)
    if [m.layer_idx for m in modules] != list(range(mc.num_layers)):
        raise ValueError(f"{mc.architecture}: fp8 KV needs one attention module per layer")
    for m in modules:
        m.use_kv_scale(scales[m.layer_idx])
    log.info("fp8 KV cache (%s): per-layer scales %s; %s", str(mc.kv_dtype)[6:], source, describe(scales))
    return replace(mc, kv_scales=scales)
