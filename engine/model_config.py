"""What a checkpoint is: `ModelConfig`, read from its config.json (through transformers'
AutoConfig), and the dtype rules that turn `--dtype` / `--kv-cache-dtype` into torch dtypes.
Frozen once built, so every stage of the engine sees the same facts."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.mm.spec import ImageSpec, image_spec as build_image_spec
from engine.runner.cpu_runtime import cpu_isa

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# vLLM's --kv-cache-dtype values kvtier stores (besides auto: the weights' dtype). fp8 is vLLM's
# alias of fp8_e4m3 (float8_e4m3fn: 3 mantissa bits, up to 448); fp8_e5m2 keeps float16's range
# with 2 mantissa bits. Both are scaled per layer (engine/runner/kv_quant.py). The others vLLM
# takes (fp8_inc, fp8_ds_mla, int8) are refused by name rather than ignored.
KV_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPES = ("auto", *KV_DTYPES)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_OTHER_VLLM_KV_DTYPES = ("fp8_inc", "fp8_ds_mla", "int8")


@dataclass(frozen=True)
class KVScale:
    """A layer's fp8 KV scales: its cache holds K / k and V / v (1.0 for any other cache;
    engine/runner/kv_quant.py)."""

    k: float = 1.0
    v: float = 1.0

    def __post_init__(self) -> None:
        if not (self.k > 0 and self.v > 0) or float("inf") in (self.k, self.v):
            raise ValueError(f"KV scales must be positive and finite; got k={self.k}, v={self.v}")


UNSCALED = KVScale()


def check_kv_cache_dtype(name: object) -> str:
    """ValueError unless `name` is one of KV_CACHE_DTYPES (naming vLLM's others as not built)."""
    if name in KV_CACHE_DTYPES:
        return name  # type: ignore[return-value]
    why = " (vLLM's Gaudi, MLA and int8 schemes are not built)" if name in _OTHER_VLLM_KV_DTYPES else ""
    raise ValueError(f"kv_cache_dtype {name!r} is not supported{why}; choose one of {', '.join(KV_CACHE_DTYPES)}")


# --kv-offload-dtype (kvtier's own): what the offload tiers store when it is not G1's KV dtype.
KV_OFFLOAD_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


def check_kv_offload_dtype(name: object) -> str:
    if name not in KV_OFFLOAD_DTYPES:
        raise ValueError(f"kv_offload_dtype {name!r} is not supported; choose one of {', '.join(KV_OFFLOAD_DTYPES)}")
    return name  # type: ignore[return-value]


def check_offload_dtype_use(name: str, has_tier: bool) -> None:
    """ValueError for a --kv-offload-dtype the engine's other settings cannot use."""
    if check_kv_offload_dtype(name) == "auto":
        return
    if not has_tier:
        raise ValueError(f"kv_offload_dtype {name} needs an offload tier "
                         "(--kv-offloading-size, --kv-offload-disk or --kv-offload-remote)")


def resolve_offload_dtype(name: str, g1_dtype: torch.dtype) -> torch.dtype | None:
    """The offload tiers' KV dtype when it is not G1's, else None (auto, or the same). ValueError
    for one that is not narrower than G1's: it would only round."""
    if check_kv_offload_dtype(name) == "auto" or KV_DTYPES[name] == g1_dtype:
        return None
    dt = KV_DTYPES[name]
    if dt.itemsize >= g1_dtype.itemsize:
        raise ValueError(f"kv_offload_dtype {name} is not narrower than G1's KV ({str(g1_dtype)[6:]}): "
                         "it would round the tiers' entries and save nothing")
    return dt


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """The KV cache's dtype when it differs from the weights', else None (auto, or the same)."""
    if check_kv_cache_dtype(name) == "auto" or KV_DTYPES[name] == model_dtype:
        return None
    return KV_DTYPES[name]


def resolve_dtype(name: str, checkpoint_dtype: Any, device: str = "cpu", native_bf16: bool | None = None) -> torch.dtype:
    """`auto` takes the checkpoint's dtype, except that float32 checkpoints run in bfloat16 on a GPU
    (vLLM's rule: float32 there halves throughput for no gain in serving), and that on a CPU
    half-precision checkpoints run in bfloat16 where the CPU multiplies bf16 natively (AMX or
    AVX512-BF16; `native_bf16`, from /proc/cpuinfo when None) and in float32 where it does not:
    there oneDNN emulates bf16 through float32 (slower than float32 itself), and the CPU kernels
    take no float16."""
    if name == "auto":
        found = torch.float32
        if isinstance(checkpoint_dtype, torch.dtype):
            found = checkpoint_dtype
        elif isinstance(checkpoint_dtype, str) and checkpoint_dtype in DTYPES:
            found = DTYPES[checkpoint_dtype]
        if device != "cpu":
            return torch.bfloat16 if found == torch.float32 else found
        if found in (torch.bfloat16, torch.float16):
            native = cpu_isa().native_bf16 if native_bf16 is None else native_bf16
            return torch.bfloat16 if native else torch.float32
        return found
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    if device == "cpu" and name == "bfloat16" and not (cpu_isa().native_bf16 if native_bf16 is None else native_bf16):
        # Asked for, so kept; but on an AVX2-only EPYC bf16 ran 2.7x (workload) and 3.9x (4k-token
        # prefill) slower than float32 (docs/CPU.md), and the user should know why.
        log.warning("dtype bfloat16 on a CPU without AMX or AVX512-BF16: oneDNN emulates it through float32, "
                    "which is slower than float32 itself (docs/CPU.md); --dtype auto picks float32 here")
    return DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the engine needs, independent of the HF config class."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    dtype: torch.dtype
    # Per layer: the sliding window it attends within (the last that many keys), 0 = all of them.
    sliding_windows: tuple[int, ...]
    hf_config: Any = field(repr=False, compare=False)
    # Per layer, where layers differ (Gemma 4's global layers have their own head size and KV
    # heads): its cache's (kv_heads, head_dim). Empty: every layer (num_kv_heads, head_dim).
    layer_kv_shapes: tuple[tuple[int, int], ...] = ()
    # Per layer, the layer whose KV it attends to: itself, or an earlier layer of its kind whose KV
    # it reuses (Gemma 4's num_kv_shared_layers; such a layer has no cache of its own). Empty: itself.
    kv_sources: tuple[int, ...] = ()
    # --kv-cache-dtype: what G1 (and every tier below it) stores K and V as when that differs from
    # `dtype`; None: the weights' dtype. Attention reads it back to `dtype` (engine/runner/attention.py).
    cache_dtype: torch.dtype | None = None
    # An fp8 cache's per-layer scales (engine/runner/kv_quant.py); empty otherwise.
    kv_scales: tuple[KVScale, ...] = ()
    # A model that takes images (engine/models/gemma3_mm.py): the checkpoint's whole config, whose
    # text part is `hf_config`. None for a text model.
    mm_config: Any = field(default=None, repr=False, compare=False)

    @property
    def multimodal(self) -> bool:
        return self.mm_config is not None

    @property
    def image_spec(self) -> ImageSpec:
        """What this model's images look like (engine/mm/spec.py); only for a multimodal model."""
        if self.mm_config is None:
            raise ValueError(f"{self.architecture} takes no images")
        return build_image_spec(self.mm_config)

    def __post_init__(self) -> None:
        for name in ("layer_kv_shapes", "kv_sources"):
            if getattr(self, name) and len(getattr(self, name)) != self.num_layers:
                raise ValueError(f"{name} needs one entry per layer ({self.num_layers})")
        if any(not 0 <= s <= i or self.kv_sources[s] != s for i, s in enumerate(self.kv_sources)):
            raise ValueError(f"kv_sources must name earlier layers that own their KV; got {self.kv_sources}")

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(kv_heads, head_dim) of the layer's K and V."""
        return self.layer_kv_shapes[layer] if self.layer_kv_shapes else (self.num_kv_heads, self.head_dim)

    def kv_source(self, layer: int) -> int:
        return self.kv_sources[layer] if self.kv_sources else layer

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the KV cache (G1's tensor, offload entries)."""
        return self.cache_dtype or self.dtype

    @property
    def kv_widths(self) -> tuple[int, ...]:
        """Per layer, the elements of one token's K (or V): kv_heads * head_dim."""
        return tuple(h * d for h, d in map(self.kv_shape, range(self.num_layers)))

    @property
    def uniform_kv(self) -> bool:
        """Every layer owns a cache of the same shape: the cache is `[..., kv_heads, head_dim]`."""
        return len({self.kv_shape(i) for i in range(self.num_layers)}) == 1 and \
            all(self.kv_source(i) == i for i in range(self.num_layers))

    def fingerprint(self) -> dict[str, Any]:
        """Stable description of what makes KV compatible (used by persistent tiers)."""
        return {
            "architecture": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope": json.dumps(getattr(self.hf_config, "rope_parameters", None), sort_keys=True, default=str),
            "dtype": str(self.dtype),
            # KV stored in another dtype is other bytes: its G3/G4 entries get a namespace of their
            # own. Absent when the KV has the weights' dtype, so existing namespaces are unchanged.
            **({"kv_dtype": str(self.cache_dtype)} if self.cache_dtype is not None else {}),
            # fp8 bytes mean K / scale: other scales, other values.
            **({"kv_scales": [[s.k, s.v] for s in self.kv_scales]} if self.kv_scales else {}),
            # A layer's KV depends on the windows of the layers below it: same weights with another
            # window must not share G3/G4 entries. Absent for full-attention models, so their
            # namespaces (and existing caches) are unchanged.
            **({"sliding_windows": list(self.sliding_windows)} if any(self.sliding_windows) else {}),
            **({"layer_kv_shapes": [list(x) for x in self.layer_kv_shapes]} if self.layer_kv_shapes else {}),
            **({"kv_sources": list(self.kv_sources)} if self.kv_sources else {}),
            # The encoder's geometry decides what an image's placeholders hold (its weights are in
            # the weights' identity). Absent for text models.
            **({"vision": self.mm_config.vision_config.to_json_string(use_diff=False),
                **self.image_spec.identity()} if self.multimodal else {}),
        }


def load_model_config(model_dir: Path, dtype: str, device: str = "cpu", kv_cache_dtype: str = "auto") -> ModelConfig:
    from transformers import AutoConfig

    from engine.models import SUPPORTED_ARCHITECTURES, _bias_flag

    if not (model_dir / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a Hugging Face checkpoint directory (no config.json)")
    raw = json.loads((model_dir / "config.json").read_text())
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or raw.get('model_type')!r} in {model_dir}; "
            f"supported architectures: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    hf = AutoConfig.from_pretrained(model_dir)
    mm_config = None
    if SUPPORTED_ARCHITECTURES[arch].multimodal:  # the language model's facts are its text config's
        mm_config, hf = hf, hf.get_text_config()
        build_image_spec(mm_config)  # an unsupported vision tower fails at load, naming itself
    num_heads = hf.num_attention_heads
    # Per-layer head sizes (Gemma 4): the model-wide fields are layer 0's, `layer_kv_shapes` each layer's.
    first = hf.per_layer_config[0] if getattr(hf, "is_heterogeneous", False) else hf
    head_dim = getattr(first, "head_dim", None) or hf.hidden_size // num_heads
    checkpoint_dtype = getattr(hf, "dtype", None) or getattr(mm_config, "dtype", None) or raw.get("torch_dtype")
    weights_dtype = resolve_dtype(dtype, checkpoint_dtype, device)
    if dtype == "auto" and device == "cpu" and str(checkpoint_dtype).removeprefix("torch.") != str(weights_dtype)[6:]:
        log.info("dtype auto: the checkpoint's %s runs in %s on this CPU (%s; --dtype overrides)", checkpoint_dtype,
                 str(weights_dtype)[6:], cpu_isa().name)
    return ModelConfig(
        architecture=arch,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(first, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=SUPPORTED_ARCHITECTURES[arch].attention_bias(hf),
        # Qwen2's biases are on q/k/v only; the others put attention_bias on o_proj too.
        o_proj_bias=_bias_flag(hf) and arch != "Qwen2ForCausalLM",
        qk_norm=SUPPORTED_ARCHITECTURES[arch].qk_norm,
        sliding_windows=_sliding_windows(hf),
        layer_kv_shapes=_layer_kv_shapes(hf),
        kv_sources=_kv_sources(hf),
        dtype=weights_dtype,
        cache_dtype=resolve_kv_dtype(kv_cache_dtype, weights_dtype),
        hf_config=hf,
        mm_config=mm_config,
    )


def _layer_kv_shapes(hf: Any) -> tuple[tuple[int, int], ...]:
    """Per-layer (kv_heads, head_dim) for configs whose layers override them (transformers'
    `per_layer_config`, Gemma 4); empty when every layer has the model's."""
    if not getattr(hf, "is_heterogeneous", False):
        return ()
    other = sorted(set(hf.per_layer_attributes) - {"head_dim", "num_key_value_heads"})
    if other:
        raise ValueError(f"per-layer {other} in per_layer_config are not supported (head_dim and "
                         "num_key_value_heads are)")
    shapes = tuple((int(c.num_key_value_heads), int(c.head_dim))
                   for c in (hf.per_layer_config[i] for i in range(hf.num_hidden_layers)))
    return shapes if len(set(shapes)) > 1 else ()


def _kv_sources(hf: Any) -> tuple[int, ...]:
    """Gemma 4's KV sharing: from `num_hidden_layers - num_kv_shared_layers` on, each layer reuses
    the KV of the last earlier layer of its type (transformers' `kv_sharing_modes`)."""
    shared = int(getattr(hf, "num_kv_shared_layers", 0) or 0)
    if not shared:
        return ()
    first = hf.num_hidden_layers - shared
    types = list(hf.layer_types)
    last_owner = {t: max(i for i in range(first) if types[i] == t) for t in set(types[:first])}
    return tuple(i if i < first else last_owner[types[i]] for i in range(hf.num_hidden_layers))


def _sliding_windows(hf: Any) -> tuple[int, ...]:
    """Each layer's window as transformers applies it: `layer_types` where the config has it
    (Qwen2/3 derive it from use_sliding_window and max_window_layers), else `sliding_window` on
    every layer (Mistral)."""
    window = getattr(hf, "sliding_window", None) or 0
    types = getattr(hf, "layer_types", None)
    if types is None:
        return (int(window),) * hf.num_hidden_layers
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (full_attention and sliding_attention are)")
    if "sliding_attention" in types and window <= 0:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    return tuple(int(window) if t == "sliding_attention" else 0 for t in types)
