"""Engine set-up decisions that depend only on the config and the checkpoint: EOS ids, the
step's token budget and the attention backend."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from engine import cpu_kernels
from engine.runner.attention import AttentionBackend, TorchPagedAttention
from engine.runner.attention_cpu import CpuPagedAttention
from engine.config import EngineConfig
from engine.model_config import ModelConfig
from engine.kv.kv_groups import KVLayout, plan_kv_layout

log = logging.getLogger(__name__)


def eos_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (which may list several, e.g. chat end tokens),
    else the tokenizer's."""
    ids: set[int] = set()
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def step_token_budget(config: EngineConfig, max_len: int) -> int:
    budget = config.max_num_batched_tokens or config.usage_context.max_num_batched_tokens
    # Without chunking a whole prompt must fit in one step.
    return budget if config.enable_chunked_prefill else max(budget, max_len)


def attention_backend(device: str) -> AttentionBackend:
    """The C++ kernel on CPU when it builds here (it logs why not), the Triton kernels on CUDA
    when triton is importable, else the torch path."""
    if device == "cpu" and cpu_kernels.get() is not None:
        return CpuPagedAttention()
    if torch.device(device).type == "cuda":
        from engine import kernels

        if kernels.available():
            from engine.runner.attention_triton import TritonPagedAttention

            return TritonPagedAttention()
        log.warning("Triton kernels unavailable (%s): attention falls back to the torch path",
                    kernels.unavailable_reason())
    return TorchPagedAttention()



def kv_layout(mc: ModelConfig, one_group: str | None) -> KVLayout:
    """The KV groups G1 is laid out in (engine/kv/kv_groups.py): one group a kind of layer, so
    sliding layers keep only their window; or, where `one_group` says why (something reads a
    request's blocks of every layer after attention is done with them, or the operator asked),
    one group of every layer keeping its whole history, as before KV groups."""
    windows = mc.sliding_windows
    if one_group or not any(windows):
        if one_group and any(windows):
            log.info("sliding windows: G1 keeps every layer's history in one KV group (%s)", one_group)
        return KVLayout.single(len(windows), sources=mc.kv_sources)
    layout = plan_kv_layout(windows, mc.kv_widths, mc.kv_sources)
    log.info("KV groups: %s%s", ", ".join(f"{len(g.layer_ids)} layers {'window ' + str(g.window) if g.window else 'full'}"
                                          for g in layout.groups),
             f"; {len(layout.aliases)} layers reuse an earlier layer's KV" if layout.aliases else "")
    return layout


def warn_unused_gpu_memory_utilization(config: EngineConfig) -> None:
    """gpu_memory_utilization is accepted where it does not apply (vLLM command lines; vLLM's CPU
    build does too), but said aloud."""
    if config.gpu_memory_utilization != EngineConfig.gpu_memory_utilization:
        why = "on CPU" if config.device == "cpu" else "with kv_cache_memory_gib / num_gpu_blocks set"
        log.warning("gpu_memory_utilization=%s does not apply %s: G1 comes from kv_cache_memory_gib "
                    "(or num_gpu_blocks)", config.gpu_memory_utilization, why)
