"""G1 sizing on a GPU, vLLM's `--gpu-memory-utilization` rule.

The engine may use `utilization` of the device's memory. After the weights are loaded, one
forward at the largest step the scheduler can build (max_num_batched_tokens tokens, logits for
max_num_seqs rows) measures the activation peak; what is left of the budget becomes KV blocks.
Memory other processes hold counts against the budget, as in vLLM, so two engines on one GPU
split it by their utilizations.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.runner.attention import AttentionMetadata, PrefillSeq
from engine.model_config import ModelConfig
from engine.kv.kv_groups import KVLayout
from engine.runner.model_runner import layer_cache_views, new_kv_cache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryProfile:
    total: int  # the device's memory, bytes
    in_use: int  # held on the device after loading (weights, CUDA context, other processes)
    peak_activation: int  # the profiled forward's peak above what was allocated before it

    def __post_init__(self) -> None:
        if self.total <= 0 or self.in_use < 0 or self.peak_activation < 0:
            raise ValueError(f"bad memory profile: {self}")


def g1_budget_bytes(profile: MemoryProfile, utilization: float) -> int:
    """Bytes left for KV blocks; a ValueError naming the knobs when nothing is left."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {utilization}")
    budget = int(profile.total * utilization) - profile.in_use - profile.peak_activation
    if budget <= 0:
        gib = 2**30
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:.2f} x {profile.total / gib:.1f} GiB allowed, "
            f"{profile.in_use / gib:.2f} GiB in use after loading, {profile.peak_activation / gib:.2f} GiB peak "
            "activations; raise --gpu-memory-utilization, lower --max-num-batched-tokens / --max-num-seqs, or "
            "set --kv-cache-memory")
    return budget


@torch.inference_mode()
def profile_forward(model: torch.nn.Module, cfg: ModelConfig, device: str, num_tokens: int, num_seqs: int,
                    block_size: int, max_len: int) -> MemoryProfile:
    """Runs the largest step once (one prefill of `num_tokens` over a scratch cache just big
    enough, then logits for `num_seqs` rows) and reads the device's counters. CUDA only."""
    dev = torch.device(device)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    nb = -(-num_tokens // block_size)
    layout = KVLayout.single(cfg.num_layers, sources=cfg.kv_sources)
    scratch = new_kv_cache(cfg, layout, nb, block_size, dev)
    caches = layer_cache_views(scratch, cfg, layout)
    meta = AttentionMetadata(torch.arange(num_tokens, device=dev), [PrefillSeq(0, num_tokens, num_tokens,
                                                                               torch.arange(nb), 0)], [])
    ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
    positions = torch.arange(num_tokens, device=dev) % max_len
    hidden, _ = model(ids, positions, caches, meta)
    rows = torch.arange(min(num_seqs, num_tokens), device=dev) % num_tokens
    model.compute_logits(hidden[rows]).float()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before - scratch.numel() * scratch.element_size()
    del scratch, caches, hidden
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    return MemoryProfile(total=total, in_use=total - free, peak_activation=max(peak, 0))


def graph_pool_bytes(profile: MemoryProfile, num_tokens: int, graph_tokens: int) -> int:
    """What the CUDA graphs' shared pool is expected to hold: the activations of the largest captured
    decode step, estimated from the profiled step's in proportion to their tokens (activations grow
    with the token count; the pool outlives the step, so it is memory G1 cannot have). The capture
    logs what it really took."""
    return 0 if graph_tokens <= 0 else int(profile.peak_activation * min(1.0, graph_tokens / max(1, num_tokens)))


def profiled_num_blocks(model: torch.nn.Module, cfg: ModelConfig, device: str, utilization: float,
                        bytes_per_block: int, num_tokens: int, num_seqs: int, block_size: int, max_len: int,
                        graph_tokens: int = 0) -> int:
    """G1 blocks; `graph_tokens`: the largest CUDA-graph capture size (0: no graphs), whose pool is reserved."""
    profile = profile_forward(model, cfg, device, num_tokens, num_seqs, block_size, max_len)
    graphs = graph_pool_bytes(profile, num_tokens, graph_tokens)
    budget = g1_budget_bytes(profile, utilization) - graphs
    gib = 2**30
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache after {graphs / gib:.2f} GiB for CUDA graphs: lower "
                         "--max-cudagraph-capture-size or raise --gpu-memory-utilization")
    log.info("GPU memory: %.1f GiB total, %.2f in use after loading, %.2f GiB peak activations at %d tokens, "
             "%.2f GiB for CUDA graphs up to %d rows; G1 gets %.2f GiB (gpu_memory_utilization=%.2f)",
             profile.total / gib, profile.in_use / gib, profile.peak_activation / gib, num_tokens, graphs / gib,
             graph_tokens, budget / gib, utilization)
    return budget // bytes_per_block
