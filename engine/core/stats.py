"""Engine statistics: cumulative counters plus gauges read at the time of the call."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineInfo:
    """What a client of the engine needs to know of it, fixed once it has started."""
    max_model_len: int
    vocab_size: int
    num_gpu_blocks: int
    eos_token_ids: tuple[int, ...]
    block_size: int  # tokens per KV block: prefix-affinity routing hashes whole blocks (server/dp_client.py)


@dataclass(frozen=True)
class EngineStats:
    prefix_cache_queries: int  # prompt tokens looked up in the G1 prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of G1 blocks in use (0..1)
    num_gpu_blocks: int
    num_evictions: int  # cached G1 blocks evicted to make room
    num_cached_blocks: int  # G1 blocks in the prefix cache now
    prompt_tokens: int
    generation_tokens: int
    tiers: dict[str, Any] = field(default_factory=dict)  # per offload tier: hits, bytes, evictions, ...
    # Wall time of steps that ran a forward (schedule to update), and of the forwards in them: the
    # rest is the "bubble" (scheduling, input preparation, sampling, the update; with async
    # scheduling, sampling and whatever of the bookkeeping outlasts the forward).
    busy_seconds: float = 0.0
    forward_seconds: float = 0.0
    # Speculative decoding (engine.spec.decode.SpecDecodeStats.as_dict), None when it is off.
    spec_decode: dict[str, Any] | None = None
    # G1 per KV group (KVCacheManager.group_usage): layers, window, blocks held by requests.
    kv_groups: list[dict[str, Any]] = field(default_factory=list)
    num_free_blocks: int = 0  # G1 blocks neither held by a request nor cached
    # A model that takes images: the encoder cache's hits, misses and bytes (engine/mm/encoder.py).
    encoder_cache: dict[str, int] | None = None
    # enable_lora: the adapters of running and waiting requests, max_loras, requests per adapter.
    lora: dict[str, Any] | None = None
    # CPU: times the thread governor changed the forward's thread count (engine/runner/cpu_threads.py).
    cpu_thread_changes: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def bubble_fraction(self) -> float:
        """Share of busy step time in which no forward ran."""
        return 1.0 - self.forward_seconds / self.busy_seconds if self.busy_seconds > 0 else 0.0
