"""Engine set-up decisions that depend only on the config and the checkpoint: EOS ids, the
step's token budget and the attention backend."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from engine import cpu_kernels
from engine.attention import AttentionBackend, TorchPagedAttention
from engine.attention_cpu import CpuPagedAttention
from engine.config import OFFLINE_MAX_BATCHED_TOKENS, EngineConfig

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
    budget = config.max_num_batched_tokens or OFFLINE_MAX_BATCHED_TOKENS
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
            from engine.attention_triton import TritonPagedAttention

            return TritonPagedAttention()
        log.warning("Triton kernels unavailable (%s): attention falls back to the torch path",
                    kernels.unavailable_reason())
    return TorchPagedAttention()


def releasable_window(windows: tuple[int, ...], reads_whole_history: str | None) -> int:
    """The sliding window after which a request's G1 blocks can be released: the model's, when
    every layer has the same one, else 0. `reads_whole_history` names what else reads a
    request's blocks after attention is done with them (a draft's full-attention KV, exported
    hidden states), which keeps them. Models that mix windowed and full layers (Gemma) need
    one block table per KV group for this, which kvtier does not have yet."""
    if not windows or windows[0] <= 0 or any(w != windows[0] for w in windows):
        return 0
    if reads_whole_history:
        log.info("sliding window %d: G1 keeps every block anyway (%s may read them)", windows[0], reads_whole_history)
        return 0
    log.info("sliding window %d on every layer: G1 releases a request's blocks once they leave it", windows[0])
    return windows[0]
