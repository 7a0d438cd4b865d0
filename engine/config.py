"""The engine's settings: `EngineConfig`, a frozen dataclass validated with ValueError.

Each setting is declared once, as a field with its default and its help text (`setting`):
`LLM(**settings)` takes exactly these fields, and the CLI's engine flags are generated from them
(server/args.py), so a default or a help text lives in one place. The checkpoint's own facts are
`engine.model_config.ModelConfig`.
"""
from __future__ import annotations

import enum
import json
import logging
import os
from dataclasses import Field, dataclass, field, fields
from collections.abc import Callable
from typing import Any


from connectors.hidden_spec import HiddenStatesSpec
from engine.model_config import (DTYPES, KV_CACHE_DTYPES, KV_OFFLOAD_DTYPES, check_kv_cache_dtype,
                                 check_kv_offload_dtype, check_offload_dtype_use)
from engine.run_mode import (CPU_KV_CACHE_ENV, CPU_KV_CACHE_GIB, DISTRIBUTED_TIMEOUT_S, OPT_LEVEL_ENV,  # noqa: F401
                             GraphMode, _optimization_level, cpu_kv_cache_gib, default_capture_sizes,
                             parse_capture_sizes, resolve_device)
from engine.lora.adapter import TARGETS as LORA_TARGETS, allowed_targets, parse_lora_modules, parse_lora_targets
from engine.spec.config import SpeculativeConfig, parse_speculative_config
from engine.sample.thinking import ReasoningConfig
from policies import check_policy

log = logging.getLogger(__name__)

class LoadFailurePolicy(str, enum.Enum):
    RECOMPUTE = "recompute"
    FAIL = "fail"


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"
    # kvtier's: the prompt with the fewest tokens left to compute first (engine/core/scheduler.py)
    SHORTEST_PREFILL = "shortest_prefill"


class UsageContext(str, enum.Enum):
    """Who runs the engine, which picks some defaults (vLLM's UsageContext)."""
    OFFLINE = "offline"  # LLM, kvtier generate / extract: a batch, for throughput
    SERVER = "server"  # kvtier serve: short gaps between a running request's tokens

    @property
    def max_num_batched_tokens(self) -> int:
        """The step's token budget when max_num_batched_tokens is not given (vLLM's CPU defaults):
        on the prefill-heavy workload of benchmarks/throughput.py 4096 gave 858 total tok/s against
        802 at 2048 (fewer prompts split into chunks after cached context)."""
        return 2048 if self is UsageContext.SERVER else 4096

class Group(str, enum.Enum):
    """Where a setting's flag is listed in `--help`."""
    ENGINE = "engine"
    OFFLOAD = "KV offload (G2 host memory, G3 disk, G4 Redis/Valkey)"
    SPECULATIVE = "speculative decoding and hidden-state export"
    LORA = "LoRA adapters"


def setting(default: Any, help: str, *, group: enum.Enum = Group.ENGINE, flag: str | None = None,
            aliases: tuple[str, ...] = (), metavar: str | None = None, choices: tuple[Any, ...] | None = None,
            check: Callable[[str], Any] | None = None, env: str | None = None, nargs: str | None = None) -> Any:
    """A settings field (EngineConfig's, or a command's own) declared once: its default, and the help text and CLI flag that
    server/args.py generates from it. `flag` defaults to the field's name in kebab case (vLLM's
    flag names); `%(default)s` in the help is the default; `check` turns the flag's string into
    the value (a ValueError is a usage error); `env`: an environment variable whose value, when
    set, is the flag's default instead. `group` titles the flag's section of `--help`."""
    return field(default=default, metadata={"help": help, "group": group, "flag": flag, "aliases": aliases,
                                            "metavar": metavar, "choices": choices, "check": check, "env": env,
                                            "nargs": nargs})


@dataclass(frozen=True)
class EngineConfig:
    model: str  # the checkpoint directory (the CLI's positional MODEL or --model; LLM's first argument)
    dtype: str = setting("auto", "weight and KV dtype; auto takes the checkpoint's, except that on a CPU without "
                         "native bf16 a bf16/fp16 checkpoint runs in float32 (default: %(default)s)",
                         choices=("auto", *DTYPES))
    block_size: int = setting(16, "tokens per KV block, a power of two (default: %(default)s)")
    num_gpu_blocks: int | None = setting(None, "G1 size in blocks; overrides --kv-cache-memory (default: derived "
                                         "from it)")
    kv_cache_memory_gib: float | None = setting(
        None, f"G1 size in GiB when --num-gpu-blocks is not given (default on CPU: ${CPU_KV_CACHE_ENV} if set, else "
        f"{CPU_KV_CACHE_GIB:g}; on a GPU, "
        "what --gpu-memory-utilization leaves after the weights and a profiled forward)",
        flag="--kv-cache-memory", metavar="GIB")
    gpu_memory_utilization: float = setting(
        0.9, "share of the GPU's memory this engine may use: weights, activations and G1 (default: %(default)s; "
        "it does not apply on CPU or with --kv-cache-memory / --num-gpu-blocks, and a warning says so)",
        metavar="FRACTION")
    max_model_len: int | None = setting(None, "longest prompt + output in tokens (default: the model's "
                                        "max_position_embeddings, lowered to what G1 holds)")
    max_num_seqs: int = setting(256, "most requests running at once (default: %(default)s)")
    max_num_batched_tokens: int | None = setting(
        None, f"token budget of one step; long prompts are chunked to fit (default: "
        f"{UsageContext.SERVER.max_num_batched_tokens} for serve, {UsageContext.OFFLINE.max_num_batched_tokens} "
        "for offline use, vLLM's CPU defaults)")
    long_prefill_token_threshold: int = setting(
        0, "most prompt tokens one request computes in one step (0: no cap, the default); a long prompt then "
        "leaves room in each step for other requests' prompts, which lowers their time to first token",
        metavar="TOKENS")
    optimization_level: int | None = setting(
        None, "vLLM's levels: 0 runs the model eagerly, without CUDA graphs; 1-3 compile it with torch.compile "
        "(inductor) at start-up; on CUDA, 1 captures decode steps in CUDA graphs and 2 and 3 also the other steps "
        "between their attention calls (cudagraph_mode full_decode_only / full_and_piecewise): ~25 s for "
        "the demo model the first time, ~6 s once inductor's code is cached under $KVTIER_CACHE_DIR/inductor. "
        "Default: $KVTIER_OPTIMIZATION_LEVEL if set, else 1",
        aliases=("-O",), choices=(0, 1, 2, 3), metavar="{0,1,2,3}")
    enforce_eager: bool = setting(False, "vLLM's switch off torch.compile and CUDA graphs: overrides -O with a "
                                  "warning")
    cudagraph_mode: GraphMode | None = setting(
        None, "CUDA graphs (vLLM's cudagraph_mode): full_decode_only captures steps that only decode, at each "
        "capture size, and pads a batch up to the next size; full_and_piecewise also captures every other step "
        "of up to the largest size in tokens, as graphs between its attention calls (attention runs eagerly on "
        "the real tokens); none runs every step eagerly; eager_replay runs both through the graphs' padded "
        "static buffers without capturing (any device: for tests). Default on CUDA: full_decode_only at -O1, "
        "full_and_piecewise at -O2 and -O3; else none",
        choices=tuple(m.value for m in GraphMode))
    max_cudagraph_capture_size: int | None = setting(
        None, "largest decode batch (and, piecewise, step in tokens) captured in a CUDA graph; bigger ones run "
        "eagerly (default: max_num_seqs, twice that with full_and_piecewise, at most 512)", metavar="N")
    cudagraph_capture_sizes: tuple[int, ...] | None = setting(
        None, "decode batch sizes captured, comma-separated, e.g. 1,2,4,8 (default: 1, 2, 4 and every multiple "
        "of 8 up to max_cudagraph_capture_size)", metavar="N,N,...", check=parse_capture_sizes)
    enable_prefix_caching: bool = setting(
        True, "reuse the KV of earlier requests' identical prompt prefixes in G1 (default: on; "
        "--no-enable-prefix-caching turns it off, and with it KV offload)")
    enable_chunked_prefill: bool = setting(
        True, "split prompts longer than a step's token budget over several steps (default: on; without it a "
        "prompt that does not fit one step waits)")
    scheduling_policy: SchedulingPolicy = setting(
        SchedulingPolicy.FCFS, "admission order: first come first served, by request priority (lower first), or "
        "shortest_prefill (kvtier's): the prompt with the fewest tokens left to compute after its cached prefix "
        "goes first, and a step that finishes a prompt carries no chunk of a longer one (default: %(default)s)",
        choices=tuple(p.value for p in SchedulingPolicy))
    kv_eviction_policy: str | dict[str, Any] = setting(
        "lru", "G1 eviction policy: a built-in, a kvtier.policies entry point or module:Class, or JSON with "
        'options: \'{"name": NAME, "options": {...}}\'. G2 and G3 use it too unless kv_connector_extra_config '
        "sets g2_eviction_policy / g3_eviction_policy (or a tier's eviction_policy) (default: %(default)s)",
        metavar="NAME|JSON")
    kv_cache_dtype: str = setting(
        "auto", "what G1 and the tiers store K and V as (vLLM's flag): auto is the weights' dtype; bfloat16 or "
        "float16 halve float32's; fp8 (= fp8_e4m3) or fp8_e5m2, one byte scaled per layer (the checkpoint's "
        "k_scale/v_scale, else calibrated), read back in the weights' dtype (default: %(default)s)", metavar="{" + ",".join(KV_CACHE_DTYPES) + "}", check=check_kv_cache_dtype)
    seed: int = setting(0, "seed for unseeded sampling (default: %(default)s)")
    device: str = setting("auto", "where the model runs: auto takes CUDA when torch sees a GPU (default: "
                          "%(default)s)", choices=("auto", "cpu", "cuda"))
    kv_offloading_size: float | None = setting(None, "G2 host-memory tier size in GiB (vLLM's flag); off when not "
                                               "given", group=Group.OFFLOAD, metavar="GIB")
    kv_offload_disk: str | None = setting(None, "G3 disk tier directory; entries survive restarts and are "
                                          "namespaced by model fingerprint", group=Group.OFFLOAD, metavar="PATH")
    kv_offload_disk_size: float = setting(10.0, "G3 capacity in GiB (default: %(default)s)", group=Group.OFFLOAD,
                                          metavar="GIB")
    kv_offload_remote: str | None = setting(
        None, "G4, a Redis/Valkey shared by many engines: redis://[user:pass@]host:port[/db], rediss:// (TLS), or "
        "redis+cluster://host:port,host:port; credentials may also come from $KVTIER_REDIS_USERNAME / "
        "$KVTIER_REDIS_PASSWORD. Set the server's maxmemory-policy to allkeys-lru; tuning keys (g4_prefix, "
        "g4_ttl_s, g4_timeout_s, g4_min_uses) go in --kv-transfer-config's kv_connector_extra_config",
        group=Group.OFFLOAD, metavar="URL")
    # Measured with benchmarks/offload.py on the demo model: a hit recomputes the prompt's tail that
    # does not fill an offload block, and that tail dominates TTFT (8k-token G2 hit: 0.42 s at 16
    # tokens, 0.83 s at 256), while load bandwidth barely moves (3.3 vs 3.5 GB/s at 16 vs 64 tokens).
    kv_offload_block_size: int | None = setting(
        None, "tokens per offload block, a multiple of --block-size (default: --block-size; a hit recomputes the "
        "prompt tail that does not fill a block)", group=Group.OFFLOAD, metavar="TOKENS")
    kv_offload_dtype: str = setting(
        "auto", "what the offload tiers store K and V as (kvtier's own): auto is G1's; a narrower one keeps G1 "
        "exact and rounds blocks on their way down: the tiers hold more, and their hits change the numerics "
        "(default: %(default)s: every tier bit-exact)", group=Group.OFFLOAD, metavar="{" + ",".join(KV_OFFLOAD_DTYPES) + "}",
        check=check_kv_offload_dtype)
    kv_transfer_config: dict[str, Any] | None = setting(
        None, "vLLM-style JSON: kv_connector, kv_role, kv_connector_extra_config, kv_connector_module_path, "
        "kv_load_failure_policy", group=Group.OFFLOAD, metavar="JSON")
    kv_load_failure_policy: LoadFailurePolicy = setting(
        LoadFailurePolicy.RECOMPUTE, "when a lower-tier load fails: recompute the tokens, or fail the request "
        "(default: %(default)s)", group=Group.OFFLOAD, choices=tuple(p.value for p in LoadFailurePolicy))
    kv_events_config: dict[str, Any] | None = setting(
        None, 'publish KV block stored/removed events, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://127.0.0.1:5557"}\'', group=Group.OFFLOAD, metavar="JSON")
    speculative_config: dict[str, Any] | None = setting(
        None, 'vLLM-style JSON. Speculation: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": '
        'N, "prompt_lookup_max": M}, or "draft_model" / "eagle3" with "model". Hidden-state export: {"method": '
        '"extract_hidden_states", "num_speculative_tokens": 1, "draft_model_config": {"hf_config": '
        '{"eagle_aux_hidden_state_layer_ids": [...]}}} with --kv-transfer-config naming HiddenStatesConnector',
        group=Group.SPECULATIVE, aliases=("-sc",), metavar="JSON")
    reasoning_config: dict[str, Any] | None = setting(
        None, 'vLLM\'s reasoning config: {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>", '
        '"thinking_token_budget": N}. Once a request has spent N tokens thinking, the engine forces the end marker '
        "and the answer follows; a request's thinking_token_budget wins. kvtier serve's --reasoning-parser "
        "supplies the markers when this is not given", group=Group.SPECULATIVE, metavar="JSON")
    async_scheduling: bool = setting(
        False, "plan step N+1 and prepare its inputs on a helper thread while step N's forward runs; the step-time "
        "share with no forward running is in /v1/kv/stats as bubble_fraction. Composes with --speculative-config")
    tensor_parallel_size: int = setting(
        1, "ranks the model is sharded over, Megatron-style (attention heads and MLP columns split, an all-reduce "
        "after each attention and MLP block; engine/parallel/): rank 0 runs in the engine's process, every other "
        "rank in a worker process of its own, on CPU bound to cores of its own (--cpu-threads: each rank's "
        "threads). Llama-family (Qwen3-MoE too) and Gemma 3 "
        "models; not yet with KV offload or a KV connector other than HiddenStatesConnector, and it runs eagerly "
        "(default: %(default)s)", aliases=("-tp",), metavar="N")
    distributed_timeout_seconds: float = setting(
        DISTRIBUTED_TIMEOUT_S, "how long an all-reduce across tensor-parallel ranks may wait before a rank counts as hung and the "
        "engine fails (kvtier serve: 503, /health says which rank); a rank that exits is seen at once. Applies "
        "with --tensor-parallel-size 2 and up (default: %(default)s)", metavar="SECONDS")
    disable_hybrid_kv_cache_manager: bool = setting(
        False, "lay G1 out as one KV group of every layer, each keeping its whole history (vLLM's flag), instead "
        "of a block table per kind of layer where sliding-window layers keep only their window")
    kv_namespace: str | None = setting(
        None, "name this model's KV in G3/G4 instead of the digest of every weight byte (which is computed once "
        "and cached beside the model). It replaces only the weights' identity: the architecture, dtype, block "
        "size and layout still go into the namespace, so changing them cannot alias. Give each distinct set of "
        "weights its own name; engines sharing a name share KV. Printable, at most 256 characters",
        group=Group.OFFLOAD, metavar="NAME")
    kv_offload_secret_file: str | None = setting(
        None, "file holding a secret (mode 0600) that MACs every G3 file and G4 value (HMAC-SHA256): an entry that "
        "fails it, or has no MAC, is a miss and is deleted, so whoever can write to the G3 directory or the Redis "
        "cannot plant KV. All engines sharing a tier need the same secret. Default: $KVTIER_KV_SECRET (the secret "
        "itself) if set; this flag wins over it", group=Group.OFFLOAD, metavar="PATH")
    kv_offload_remote_trusted: bool = setting(
        False, "use a shared tier (G4, or a plugin backend marked shared) without a KV secret: its entries then "
        "carry an unkeyed checksum that catches damage but not forgery, so whoever can write to the store can "
        "plant KV this engine serves. Without this flag such a tier needs --kv-offload-secret-file (or "
        "$KVTIER_KV_SECRET), and the engine refuses to start", group=Group.OFFLOAD)
    cpu_threads: int | None = setting(
        None, "CPU: threads the forward runs (default: $OMP_NUM_THREADS if set, else the CPUs this process may "
        "use: its affinity mask, lowered to its cgroup's CPU quota)", metavar="N")
    adaptive_cpu_threads: bool = setting(
        True, "CPU: run fewer forward threads while other processes load the same CPUs, and go back when they "
        "stop (an OpenMP team sharing a core with a busy process waits for it at every barrier: 3-12x slower "
        "steps); each change is logged (default: on; off under --tensor-parallel-size, whose ranks keep their "
        "cores)")
    enable_lora: bool = setting(
        False, "serve LoRA adapters (PEFT's format) on the base model: requests name one (offline: "
        "LLM.generate(lora_request=...); kvtier serve: the request's model field, --lora-modules), and steps mix "
        "adapters and the base model. Runs eagerly for now (no torch.compile or CUDA graphs)", group=Group.LORA)
    max_loras: int = setting(
        1, "adapters loaded at once, and so the most one step mixes; an adapter added beyond that replaces one "
        "no unfinished request uses (default: %(default)s)", group=Group.LORA, metavar="N")
    max_lora_rank: int = setting(
        16, "largest adapter rank taken; a bigger one is refused when it is loaded (default: %(default)s)",
        group=Group.LORA, metavar="R")
    lora_target_modules: tuple[str, ...] | None = setting(
        None, "the projections adapters may touch, comma-separated PEFT names (default: all of "
        + ",".join(LORA_TARGETS) + "); an adapter with another is refused when it is loaded", group=Group.LORA,
        metavar="NAME,...", check=parse_lora_targets)
    lora_modules: tuple[tuple[str, str], ...] = setting(
        (), "adapters loaded at start-up, as name=path (or vLLM's JSON: '{\"name\": ..., \"path\": ...}'); "
        "kvtier serve serves each under its name in the model field and lists it in /v1/models",
        group=Group.LORA, metavar="NAME=PATH", check=parse_lora_modules, nargs="+")
    # Who runs the engine (not a flag: the command says it), for the defaults that depend on it.
    usage_context: UsageContext = UsageContext.OFFLINE
    # The secret itself, read in __post_init__: never in repr, never compared.
    kv_offload_secret: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in JSON_SETTINGS:  # vLLM takes these as JSON strings too
            object.__setattr__(self, name, parse_json_setting(getattr(self, name), name))
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two; got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1; got {self.num_gpu_blocks}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0; got {self.kv_cache_memory_gib}")
        cpu_kv_cache_gib()  # a bad $KVTIER_CPU_KVCACHE_SPACE fails here, before any process starts
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1; got {self.tensor_parallel_size}")
        if not self.distributed_timeout_seconds > 0:
            raise ValueError(f"distributed_timeout_seconds must be > 0; got {self.distributed_timeout_seconds}")
        if self.tensor_parallel_size == 1 and self.distributed_timeout_seconds != DISTRIBUTED_TIMEOUT_S:
            log.warning("distributed_timeout_seconds=%s does not apply: tensor_parallel_size is 1",
                        self.distributed_timeout_seconds)
        if self.tensor_parallel_size > 1 and self.optimization_level:  # given here: refused, not ignored
            raise ValueError(f"optimization_level={self.optimization_level} does not work with tensor_parallel_size="
                             f"{self.tensor_parallel_size} yet (it runs eagerly): leave it out or give 0")
        if self.tensor_parallel_size > 1 and os.environ.get(OPT_LEVEL_ENV, "0") != "0":
            log.warning("$%s not applied: tensor_parallel_size=%d runs eagerly for now", OPT_LEVEL_ENV,
                        self.tensor_parallel_size)
        object.__setattr__(self, "optimization_level", _optimization_level(
            self.optimization_level if self.tensor_parallel_size == 1 else 0, self.device, self.enforce_eager))
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1; got {self.max_model_len}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1; got {self.cpu_threads}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        object.__setattr__(self, "usage_context", UsageContext(self.usage_context))
        self._check_lora()
        self._resolve_graphs()
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0; got {self.long_prefill_token_threshold}")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold chunks prompts: it needs enable_chunked_prefill")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        object.__setattr__(self, "scheduling_policy", SchedulingPolicy(self.scheduling_policy))
        check_kv_cache_dtype(self.kv_cache_dtype)
        tiers = offload_flags_on(self.kv_offloading_size, self.kv_offload_disk, self.kv_offload_remote)
        check_offload_dtype_use(self.kv_offload_dtype, tiers or bool(self.kv_transfer_config))
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
        if self.tensor_parallel_size > 1:
            self._check_tp_connector(tc)

    def _check_tp_connector(self, tc: dict[str, Any]) -> None:
        """What a tensor-parallel engine's connector may be: the tiered offload connector (each rank
        moves its shard: connectors/sharded.py) or hidden-state export (rank 0's residual stream,
        whole after the all-reduces)."""
        from connectors.factory import builds_tiered, connector_kind, HIDDEN_STATES

        tiered = builds_tiered(tc, self.offload_enabled)
        hidden = bool(tc) and connector_kind(tc) is HIDDEN_STATES and not self.offload_enabled
        refused = [name for name, on in (
            ("kv_transfer_config other than the tiered offload connector or HiddenStatesConnector",
             tc and not (tiered or hidden)),
            ("write_policy=write_back (use write_through)",
             tiered and (tc.get("kv_connector_extra_config") or {}).get("write_policy") == "write_back"),
            ("KV offload together with hidden-state extraction", tiered and self.hidden_states is not None)) if on]
        if refused:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} does not work with "
                             f"{'; '.join(refused)} yet")

    def _check_lora(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1; got {self.max_loras}, {self.max_lora_rank}")
        if self.lora_target_modules is not None:
            object.__setattr__(self, "lora_target_modules", parse_lora_targets(self.lora_target_modules))
        object.__setattr__(self, "lora_modules", parse_lora_modules(self.lora_modules or ()))
        defaults = {f.name: f.default for f in fields(self)}
        given = [n for n in ("max_loras", "max_lora_rank", "lora_target_modules", "lora_modules")
                 if getattr(self, n) != defaults[n]]
        if given and not self.enable_lora:
            raise ValueError(f"{', '.join(given)} applies to LoRA adapters: it needs enable_lora")
        if self.enable_lora and self.optimization_level:
            log.info("enable_lora: the model runs eagerly (optimization_level %d not applied)", self.optimization_level)
            object.__setattr__(self, "optimization_level", 0)

    @property
    def lora_targets(self) -> frozenset[str]:
        """The PEFT modules adapters may touch (lora_target_modules, default all)."""
        return allowed_targets(self.lora_target_modules)

    def _resolve_graphs(self) -> None:
        """cudagraph_mode and the capture sizes, resolved; a given value that cannot apply is refused."""
        mode = None if self.cudagraph_mode is None else GraphMode(self.cudagraph_mode)
        sizes_given = self.cudagraph_capture_sizes is not None or self.max_cudagraph_capture_size is not None
        if mode is None:
            mode = (GraphMode.NONE if self.device == "cpu" or self.optimization_level == 0  # (LoRA: 0, above)
                    else GraphMode.FULL_DECODE_ONLY if self.optimization_level == 1 else GraphMode.FULL_AND_PIECEWISE)
        elif mode is not GraphMode.NONE and self.enforce_eager:
            raise ValueError(f"cudagraph_mode={mode.value} and enforce_eager contradict: enforce_eager turns "
                             "CUDA graphs off")
        if mode.captures and self.device == "cpu":
            raise ValueError(f"cudagraph_mode={mode.value} needs a CUDA device (eager_replay runs the same "
                             "buffers on CPU)")
        if mode is not GraphMode.NONE and self.enable_lora:
            # A graph would replay the step its capture saw: no adapter rows.
            raise ValueError(f"cudagraph_mode={mode.value} does not work with enable_lora yet")
        if mode is not GraphMode.NONE and self.tensor_parallel_size > 1:
            raise ValueError(f"cudagraph_mode={mode.value} does not work with tensor_parallel_size="
                             f"{self.tensor_parallel_size} yet")
        if mode is GraphMode.NONE:
            if sizes_given:
                why = "on CPU" if self.device == "cpu" else "with cudagraph_mode=none, -O0 or enforce_eager"
                raise ValueError(f"cudagraph_capture_sizes / max_cudagraph_capture_size given, but no CUDA graphs "
                                 f"are captured {why}")
            object.__setattr__(self, "cudagraph_mode", mode)
            return
        if self.cudagraph_capture_sizes is not None:
            sizes = parse_capture_sizes(self.cudagraph_capture_sizes)
            if self.max_cudagraph_capture_size is not None and sizes[-1] != self.max_cudagraph_capture_size:
                raise ValueError(f"max_cudagraph_capture_size={self.max_cudagraph_capture_size} differs from the "
                                 f"largest of cudagraph_capture_sizes ({sizes[-1]}): give one of them")
        else:
            seqs = self.max_num_seqs * (2 if mode is GraphMode.FULL_AND_PIECEWISE else 1)  # vLLM's default
            sizes = default_capture_sizes(self.max_cudagraph_capture_size or min(seqs, 512))
        object.__setattr__(self, "cudagraph_mode", mode)
        object.__setattr__(self, "cudagraph_capture_sizes", sizes)
        object.__setattr__(self, "max_cudagraph_capture_size", sizes[-1])

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
        return offload_flags_on(self.kv_offloading_size, self.kv_offload_disk, self.kv_offload_remote)


def offload_flags_on(offloading_size: float | None, disk: str | None, remote: str | None) -> bool:
    """Whether the offload flags set up any tier below G1."""
    return bool(offloading_size) or disk is not None or bool(remote)


# The settings that are JSON objects (a dict, or a JSON string of one).
JSON_SETTINGS = tuple(f.name for f in fields(EngineConfig) if f.type == "dict[str, Any] | None")


def engine_settings() -> tuple[Field[Any], ...]:
    """EngineConfig's settings (`model` first): what LLM(...) takes. All but `usage_context` are
    flags (`is_flag`); that one the command says (serve: UsageContext.SERVER)."""
    return tuple(f for f in fields(EngineConfig) if f.init)


def is_flag(f: Field[Any]) -> bool:
    return "help" in f.metadata


def parse_json_setting(value: dict[str, Any] | str | None, name: str) -> dict[str, Any] | None:
    """A JSON-object setting given as a dict or a JSON string; ValueError naming `name` otherwise."""
    if value is None or isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a JSON object or a dict; got {type(value).__name__}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{name} must be a JSON object")
    return parsed


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


