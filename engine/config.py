"""Engine configuration: frozen dataclasses validated with ValueError.

`ModelConfig` is read from a checkpoint's config.json (through transformers.AutoConfig);
`EngineConfig` holds the user's knobs. Both are immutable once built so every stage of the
engine sees the same values.
"""
from __future__ import annotations

import enum
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from connectors.hidden_spec import HiddenStatesSpec
from engine.runner.cpu_runtime import cpu_isa
from engine.spec.config import SpeculativeConfig, parse_speculative_config
from engine.sample.thinking import ReasoningConfig
from policies import check_policy

log = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class LoadFailurePolicy(str, enum.Enum):
    RECOMPUTE = "recompute"
    FAIL = "fail"


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"
    # kvtier's: the prompt with the fewest tokens left to compute first (engine/core/scheduler.py)
    SHORTEST_PREFILL = "shortest_prefill"


# Token budget of one step when max_num_batched_tokens is not given: vLLM's CPU defaults. An
# offline batch (LLM, generate, extract) favours throughput: on the prefill-heavy workload of
# benchmarks/throughput.py 4096 gave 858 total tok/s against 802 at 2048 (fewer prompts split into
# chunks after cached context). A server (`kvtier serve` passes its own) favours short gaps between
# a running request's tokens.
OFFLINE_MAX_BATCHED_TOKENS = 4096
SERVER_MAX_BATCHED_TOKENS = 2048

# G1 size on CPU when neither kv_cache_memory_gib nor num_gpu_blocks is given (on CUDA the
# budget comes from gpu_memory_utilization instead).
CPU_KV_CACHE_GIB = 2.0


def resolve_device(name: str) -> str:
    """`auto` is CUDA when torch sees a GPU, else the CPU; an explicit CUDA device must exist."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if name == "cuda" or re.fullmatch(r"cuda:\d+", name):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: torch sees no CUDA device here (use 'cpu' or 'auto')")
        index = int(name.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) here")
        return name
    raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {name!r}")


# vLLM's --kv-cache-dtype values kvtier stores (besides auto: the weights' dtype). The others vLLM
# takes (fp8*, int8) need scaled quantization kernels, and are refused by name rather than ignored.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
_SCALED_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "int8")


def check_kv_cache_dtype(name: object) -> str:
    """ValueError unless `name` is one of KV_CACHE_DTYPES (the message says why fp8 is not)."""
    if name in KV_CACHE_DTYPES:
        return name  # type: ignore[return-value]
    why = " (a quantized KV cache needs scaling kernels kvtier does not have)" if name in _SCALED_KV_DTYPES else ""
    raise ValueError(f"kv_cache_dtype {name!r} is not supported{why}; choose one of {', '.join(KV_CACHE_DTYPES)}")


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """The KV cache's dtype when it differs from the weights', else None (auto, or the same)."""
    if check_kv_cache_dtype(name) == "auto" or _DTYPES[name] == model_dtype:
        return None
    return _DTYPES[name]


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
        elif isinstance(checkpoint_dtype, str) and checkpoint_dtype in _DTYPES:
            found = _DTYPES[checkpoint_dtype]
        if device != "cpu":
            return torch.bfloat16 if found == torch.float32 else found
        if found in (torch.bfloat16, torch.float16):
            native = cpu_isa().native_bf16 if native_bf16 is None else native_bf16
            return torch.bfloat16 if native else torch.float32
        return found
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


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
            # A layer's KV depends on the windows of the layers below it: same weights with another
            # window must not share G3/G4 entries. Absent for full-attention models, so their
            # namespaces (and existing caches) are unchanged.
            **({"sliding_windows": list(self.sliding_windows)} if any(self.sliding_windows) else {}),
            **({"layer_kv_shapes": [list(x) for x in self.layer_kv_shapes]} if self.layer_kv_shapes else {}),
            **({"kv_sources": list(self.kv_sources)} if self.kv_sources else {}),
        }


OPT_LEVEL_ENV = "KVTIER_OPTIMIZATION_LEVEL"


def _optimization_level(level: int | None, device: str, enforce_eager: bool) -> int:
    where = "optimization_level"
    if level is None and os.environ.get(OPT_LEVEL_ENV):
        where, level = f"${OPT_LEVEL_ENV}", os.environ[OPT_LEVEL_ENV]
        level = int(level) if level.isdigit() else level
    if level is not None and (type(level) is not int or level not in (0, 1, 2, 3)):
        raise ValueError(f"{where} must be 0, 1, 2 or 3; got {level!r}")
    if enforce_eager:
        if level:
            log.warning("%s=%d not applied: enforce_eager runs the model eagerly", where, level)
        return 0
    if level is None:
        return 1 if device == "cpu" else 0
    return level


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    block_size: int = 16
    num_gpu_blocks: int | None = None
    # G1 in GiB (like VLLM_CPU_KVCACHE_SPACE); None: CPU_KV_CACHE_GIB on CPU, and on CUDA what
    # gpu_memory_utilization leaves after the weights and a profiled forward's peak.
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # vLLM's flag: a prompt chunk of one request in one step is at most this many tokens (0: no
    # cap), so a long prefill leaves room in every step's budget for other requests' prompts.
    long_prefill_token_threshold: int = 0
    # vLLM's -O / --optimization-level: 0 runs the model eagerly; 1-3 compile it with torch.compile
    # (engine/runner/compiled.py; kvtier has no CUDA graphs yet, so 2 and 3 are 1). None: $OPT_LEVEL_ENV
    # when set (the test suite sets 0), else 1 on CPU (vLLM's behaviour; as fast as eager here,
    # README) and 0 on CUDA, where the compiled model has not run yet (scripts/gpu-check.sh tests it).
    optimization_level: int | None = None
    # vLLM's flag: never compile (it overrides optimization_level, with a warning).
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # G1's eviction policy: a name, an entry point, module:Class, or {"name": ..., "options": {...}}
    # (also as a JSON string); G2 and G3 take it too unless their own keys say otherwise.
    kv_eviction_policy: str | dict[str, Any] = "lru"
    # vLLM's --kv-cache-dtype: auto (the weights' dtype), bfloat16 or float16 (KV_CACHE_DTYPES).
    kv_cache_dtype: str = "auto"
    seed: int = 0
    device: str = "auto"  # resolved in __post_init__: auto, cpu, cuda or cuda:N
    # Offload tiers (vLLM's flag names): G2 host memory and G3 disk, sizes in GiB.
    kv_offloading_size: float | None = None
    kv_offload_disk: str | None = None
    kv_offload_disk_size: float = 10.0
    # G4: a shared Redis/Valkey (redis://, rediss://, redis+cluster://host:port,...), below G3.
    kv_offload_remote: str | None = None
    # Tokens per offload block, a multiple of block_size; None = block_size. Measured with
    # benchmarks/offload.py on the demo model: a hit recomputes the prompt's tail that does not
    # fill an offload block, and that tail dominates TTFT (8k-token G2 hit: 0.42 s at 16 tokens,
    # 0.83 s at 256), while load bandwidth barely moves (3.3 vs 3.5 GB/s at 16 vs 64 tokens).
    kv_offload_block_size: int | None = None
    kv_transfer_config: dict[str, Any] | None = None
    kv_load_failure_policy: LoadFailurePolicy = field(default="recompute")  # type: ignore[assignment]
    kv_events_config: dict[str, Any] | None = None
    # vLLM's speculative_config: ngram, draft_model or eagle3 speculation (engine/spec/config.py), or
    # method "extract_hidden_states" (hidden-state export); not both.
    speculative_config: dict[str, Any] | None = None
    # vLLM's reasoning_config: the thinking markers and a default thinking_token_budget
    # (engine/sample/thinking.py); None: no thinking section is tracked, and a budget is an error.
    reasoning_config: dict[str, Any] | None = None
    # vLLM's --async-scheduling: plan step N+1 while step N runs (engine/core/async_pipeline.py).
    async_scheduling: bool = False
    # vLLM's --disable-hybrid-kv-cache-manager: one KV group of every layer, each keeping its whole
    # history, instead of a block table per kind of layer (engine/kv/kv_groups.py).
    disable_hybrid_kv_cache_manager: bool = False
    # Operator-chosen name for this model's KV in G3/G4, instead of the whole-file weights digest
    # (engine.kv.fingerprint); dtype, layout and block size still go into the namespace.
    kv_namespace: str | None = None
    # File holding the secret that MACs G3/G4 entries; None: $KVTIER_KV_SECRET if set, else none.
    kv_offload_secret_file: str | None = None
    # A shared tier (G4, a plugin backend marked `shared`) without a KV secret is refused unless
    # this says its store is trusted (nobody else can write to it): then entries carry only the
    # unkeyed checksum, which catches damage, not forgery.
    kv_offload_remote_trusted: bool = False
    # CPU: threads the forward runs (None: OMP_NUM_THREADS if set, else the CPUs this process may
    # use, its affinity and cgroup quota), and whether it runs fewer while other processes load
    # those CPUs (engine/runner/cpu_threads.py).
    cpu_threads: int | None = None
    adaptive_cpu_threads: bool = True
    # The secret itself, read in __post_init__: never in repr, never compared.
    kv_offload_secret: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two; got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1; got {self.num_gpu_blocks}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0; got {self.kv_cache_memory_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        object.__setattr__(self, "device", resolve_device(self.device))
        object.__setattr__(self, "optimization_level", _optimization_level(self.optimization_level, self.device,
                                                                                 self.enforce_eager))
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1; got {self.max_model_len}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1; got {self.cpu_threads}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0; got {self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold chunks prompts: it needs enable_chunked_prefill")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {self.dtype!r}")
        object.__setattr__(self, "scheduling_policy", SchedulingPolicy(self.scheduling_policy))
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_offloading_size is not None and self.kv_offloading_size < 0:
            raise ValueError(f"kv_offloading_size must be >= 0 GiB; got {self.kv_offloading_size}")
        if self.kv_offload_disk_size <= 0:
            raise ValueError(f"kv_offload_disk_size must be > 0 GiB; got {self.kv_offload_disk_size}")
        if self.kv_offload_block_size is None:
            object.__setattr__(self, "kv_offload_block_size", self.block_size)
        if self.kv_offload_block_size <= 0 or self.kv_offload_block_size % self.block_size:
            raise ValueError(f"kv_offload_block_size ({self.kv_offload_block_size}) must be a positive multiple "
                             f"of block_size ({self.block_size})")
        if self.kv_offload_remote is not None:
            from kvstore.remote import check_url

            check_url(self.kv_offload_remote)  # before any weights load
        check_policy(self.kv_eviction_policy, "kv_eviction_policy")  # before any weights load
        parse_speculative_config(self.speculative_config)  # validates
        ReasoningConfig.from_dict(self.reasoning_config)  # validates
        if self.kv_namespace is not None:
            check_kv_namespace(self.kv_namespace)
        from kvstore.entry import load_secret

        object.__setattr__(self, "kv_offload_secret", load_secret(self.kv_offload_secret_file))
        from connectors.factory import check_shared_tiers

        check_shared_tiers(self.kv_transfer_config if isinstance(self.kv_transfer_config, dict) else None,
                           self.kv_offload_remote, self.kv_offload_secret is not None, self.kv_offload_remote_trusted)
        # vLLM puts it in kv_transfer_config; there it wins over the flag (normalized here, once).
        tc = self.kv_transfer_config if isinstance(self.kv_transfer_config, dict) else {}
        policy = tc.get("kv_load_failure_policy", self.kv_load_failure_policy)
        try:
            object.__setattr__(self, "kv_load_failure_policy", LoadFailurePolicy(policy))
        except ValueError:
            raise ValueError(f"kv_load_failure_policy must be 'recompute' or 'fail'; got {policy!r}") from None

    @property
    def hidden_states(self) -> HiddenStatesSpec | None:
        return parse_speculative_config(self.speculative_config)[0]

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return parse_speculative_config(self.speculative_config)[1]

    @property
    def reasoning(self) -> ReasoningConfig | None:
        return ReasoningConfig.from_dict(self.reasoning_config)

    @property
    def offload_enabled(self) -> bool:
        return bool(self.kv_offloading_size) or self.kv_offload_disk is not None or bool(self.kv_offload_remote)


MAX_KV_NAMESPACE = 256


def check_kv_namespace(name: object) -> None:
    """ValueError unless `name` is a non-empty, printable string of at most MAX_KV_NAMESPACE
    characters (it appears in logs, and must not smuggle control characters into them)."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"kv_namespace must be a non-empty string; got {name!r}")
    if len(name) > MAX_KV_NAMESPACE:
        raise ValueError(f"kv_namespace must be at most {MAX_KV_NAMESPACE} characters; got {len(name)}")
    if not name.isprintable():
        raise ValueError(f"kv_namespace must be printable (no control characters); got {name!r}")


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
    num_heads = hf.num_attention_heads
    # Per-layer head sizes (Gemma 4): the model-wide fields are layer 0's, `layer_kv_shapes` each layer's.
    first = hf.per_layer_config[0] if getattr(hf, "is_heterogeneous", False) else hf
    head_dim = getattr(first, "head_dim", None) or hf.hidden_size // num_heads
    checkpoint_dtype = getattr(hf, "dtype", None) or raw.get("torch_dtype")
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
