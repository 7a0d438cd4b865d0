"""Where and how the model runs: the device (`resolve_device`), the optimization level
(`-O`, `$KVTIER_OPTIMIZATION_LEVEL`, enforce_eager), the CUDA-graph modes and capture sizes, and G1's
default size on CPU (`$KVTIER_CPU_KVCACHE_SPACE`).
EngineConfig (engine/config.py) declares the settings; these resolve and check them."""
from __future__ import annotations

import enum
import logging
import os
import re
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)


class GraphMode(str, enum.Enum):
    """`--cudagraph-mode`: NONE runs every step eagerly; FULL_DECODE_ONLY (vLLM's name) captures
    steps that only decode in CUDA graphs (engine/runner/graphs.py); FULL_AND_PIECEWISE (vLLM's)
    also captures every other step of up to the largest capture size in tokens as graphs between
    its attention calls (engine/runner/piecewise.py); EAGER_REPLAY runs both through the same
    static, padded buffers without capturing, on any device (for tests)."""
    NONE = "none"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"
    EAGER_REPLAY = "eager_replay"

    @property
    def captures(self) -> bool:
        """CUDA graphs are captured (a CUDA device, memory for their pool)."""
        return self in (GraphMode.FULL_DECODE_ONLY, GraphMode.FULL_AND_PIECEWISE)

    @property
    def piecewise(self) -> bool:
        """Steps that do not only decode run through engine/runner/piecewise.py."""
        return self in (GraphMode.FULL_AND_PIECEWISE, GraphMode.EAGER_REPLAY)


def default_capture_sizes(max_size: int) -> tuple[int, ...]:
    """vLLM's ladder of decode batch sizes: 1, 2, 4, then every multiple of 8, up to `max_size` (included)."""
    if max_size < 1:
        raise ValueError(f"max_cudagraph_capture_size must be >= 1; got {max_size}")
    sizes = {s for s in (1, 2, 4) if s <= max_size} | set(range(8, max_size + 1, 8)) | {max_size}
    return tuple(sorted(sizes))


def parse_capture_sizes(value: str | Sequence[int]) -> tuple[int, ...]:
    """`--cudagraph-capture-sizes 1,2,4,8` (or a list): sorted, distinct, positive."""
    try:
        sizes = [int(x) for x in value.split(",")] if isinstance(value, str) else [int(x) for x in value]
    except (TypeError, ValueError):
        raise ValueError(f"cudagraph_capture_sizes must be batch sizes like 1,2,4,8; got {value!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"cudagraph_capture_sizes must be positive batch sizes; got {value!r}")
    return tuple(sorted(set(sizes)))


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


OPT_LEVEL_ENV = "KVTIER_OPTIMIZATION_LEVEL"
# An all-reduce across tensor-parallel ranks that waits longer means a rank hangs (a layer takes far less).
DISTRIBUTED_TIMEOUT_S = 30.0


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
        return 1  # CPU and CUDA: compiled was faster than eager on both (docs/CPU.md, docs/gpu.md)
    return level


# G1 size on CPU when neither kv_cache_memory_gib nor num_gpu_blocks is given (on CUDA the
# budget comes from gpu_memory_utilization instead); $KVTIER_CPU_KVCACHE_SPACE (GiB) overrides it,
# as VLLM_CPU_KVCACHE_SPACE does vLLM's.
CPU_KV_CACHE_GIB = 2.0
CPU_KV_CACHE_ENV = "KVTIER_CPU_KVCACHE_SPACE"


def cpu_kv_cache_gib() -> float:
    """G1's default size on CPU: $KVTIER_CPU_KVCACHE_SPACE if set, else CPU_KV_CACHE_GIB."""
    raw = os.environ.get(CPU_KV_CACHE_ENV, "")
    if not raw:
        return CPU_KV_CACHE_GIB
    try:
        gib = float(raw)
    except ValueError:
        gib = 0.0
    if not gib > 0 or gib == float("inf"):
        raise ValueError(f"${CPU_KV_CACHE_ENV} must be a size in GiB > 0; got {raw!r}")
    return gib
