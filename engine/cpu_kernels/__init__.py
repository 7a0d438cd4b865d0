"""C++ kernels for the CPU path, built at first use with the system compiler (`build.py`).

`paged_attention` (decodes, `paged_attention.cpp`) and `prefill_attention` (prompt chunks,
`prefill_attention.cpp`) read K/V through the block table in place;
`add_rms_norm` and `rope_` fuse a decoder layer's norms and rotary embedding (`elementwise.cpp`);
`linear` (its own module) runs bfloat16 linears on AMX tiles (`linear_amx.cpp`).
Without a compiler the engine falls back to the torch ops and logs why (`get()` returns None then).
"""
from __future__ import annotations

import contextlib
import ctypes
import enum
import logging
import os
import threading

import torch

from engine.cpu_kernels.build import BuildError, load

log = logging.getLogger(__name__)

DISABLE_ENV = "KVTIER_CPU_KERNELS"  # "0": use the torch path (for comparisons and bisecting)

_lock = threading.Lock()
_state: dict[str, object] = {}


def get() -> ctypes.CDLL | None:
    """The loaded library, or None (with one warning per process saying why)."""
    if "lib" in _state:  # every layer calls this: no lock once loaded
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if "lib" not in _state:
            lib, why = None, None
            choice = os.environ.get(DISABLE_ENV, "1")
            if choice not in ("0", "1"):
                raise ValueError(f"{DISABLE_ENV} must be 0 (torch path) or 1 (the default), got {choice!r}")
            if choice == "0":
                why = f"{DISABLE_ENV}=0"
            else:
                try:
                    lib = load()
                except BuildError as e:
                    why = str(e)
            _state["lib"] = lib
            if lib is None:
                log.warning("CPU kernels not used (%s): attention, norms and rotary embedding run as torch ops", why)
            else:
                log.info("CPU kernels loaded: attention reads the paged KV cache in place; bfloat16 prefill "
                         "attention on %s", PrefillBf16(lib.kvt_prefill_bf16_kind()).describe())
        return _state["lib"]  # type: ignore[return-value]


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _traced(name: str):
    """A profiler range around a ctypes call (invisible to the profiler otherwise), only while a
    profiler runs: `record_function` costs ~10 us, 0.6 ms of a small decode step's 30 calls."""
    return torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    rows: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int = 0) -> None:
    """`out[rows[i]]` = attention of `q[rows[i]]` (`[heads, head_dim]`) over the first `lens[i]`
    tokens (the last `window` of them when `window` > 0) reached through `tables[i]` (block ids into `k_cache`/`v_cache`, each `[num_blocks,
    block_size, kv_heads, head_dim]` with contiguous heads; tokens `stride(1)` apart). `q`/`out`: `[tokens, heads, head_dim]`
    with contiguous rows; `rows`, `tables`, `lens`: contiguous int64. float32 or bfloat16, the cache
    in q's dtype or bfloat16 under float32 q (`cache_supported`)."""
    lib = get()
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available")
    nb, bs, kv_heads, head_dim = k_cache.shape
    heads = q.shape[1]
    _check_cache(q, k_cache, v_cache, out)
    for name, t in (("rows", rows), ("tables", tables), ("lens", lens)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int64")
    n = rows.numel()
    with _traced("kvtier::cpu_paged_attention"):
        rc = lib.kvt_paged_attention(
            _dtypes(q, k_cache), _ptr(q), q.stride(0), _ptr(k_cache), _ptr(v_cache), k_cache.stride(0),
            k_cache.stride(1), _ptr(out), out.stride(0), _ptr(rows), _ptr(tables), tables.stride(0) if n else 0,
            _ptr(lens), n, heads, kv_heads, head_dim, bs, float(scale), int(window), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"unsupported shape for the CPU kernel: heads {heads}, kv_heads {kv_heads}, "
                         f"head_dim {head_dim}, block_size {bs}")


# The kernels' code for a cache dtype (bits 1-3 of their dtype code); float32 is 0.
_CACHE_CODES = {torch.float32: 0, torch.bfloat16: 2, torch.float8_e4m3fn: 4, torch.float8_e5m2: 8}


def cache_supported(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the attention kernels take q (and out) of `q_dtype` over a cache of `cache_dtype`:
    float32 or bfloat16 alike, a bfloat16 cache under float32 q (--kv-cache-dtype bfloat16), or an
    fp8 cache under either."""
    if q_dtype not in (torch.float32, torch.bfloat16) or cache_dtype not in _CACHE_CODES:
        return False
    return not (q_dtype == torch.bfloat16 and cache_dtype == torch.float32)


def _dtypes(q: torch.Tensor, cache: torch.Tensor) -> int:
    """The kernels' dtype code: bit 0 q/out bfloat16, bits 1-3 the cache's (`_CACHE_CODES`)."""
    return int(q.dtype == torch.bfloat16) | _CACHE_CODES[cache.dtype]


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    head_dim, kv_heads = k_cache.shape[3], k_cache.shape[2]
    if not cache_supported(q.dtype, k_cache.dtype) or k_cache.dtype != v_cache.dtype or out.dtype != q.dtype:
        raise ValueError(f"unsupported dtypes: q {q.dtype}, out {out.dtype}, cache {k_cache.dtype}/{v_cache.dtype} "
                         "(float32 or bfloat16 alike, or a bfloat16 cache under float32 q)")
    # Tokens may be further apart than kv_heads * head_dim (a layer's part of a wider row).
    if k_cache.stride() != v_cache.stride() or k_cache.stride()[2:] != (head_dim, 1) \
            or k_cache.stride(1) < kv_heads * head_dim or k_cache.stride(0) < k_cache.shape[1] * k_cache.stride(1):
        raise ValueError(f"cache tokens need contiguous heads and equal strides: {k_cache.stride()}, {v_cache.stride()}")
    if q.stride()[1:] != (head_dim, 1) or out.stride()[1:] != (head_dim, 1):
        raise ValueError("q and out need contiguous rows")


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      seqs: torch.Tensor, tables: torch.Tensor, scale: float, window: int = 0,
                      bf16_pairs: bool = True) -> None:
    """Causal attention of prompt chunks over the paged cache, in place. `seqs` `[n, 4]` int64 rows
    `(q0, qlen, ctx, table_offset)`: rows `q0 .. q0+qlen-1` of `q` sit at positions `ctx-qlen ..
    ctx-1` and attend to keys `0 .. their position` (with `window` > 0, only those after position -
    window), reached through the block ids
    `tables[table_offset:]`. Each row's result depends only on that row and its keys (see
    `prefill_attention.cpp`): a chunk after a prefix hit gives the bits of a fresh prefill.

    bfloat16 q and cache (head size a multiple of 32, blocks of 16 tokens) multiply in bf16 pairs
    where `prefill_bf16_kind()` says so: on AMX tiles (`prefill_amx.h`) or in `vdpbf16ps`
    (`prefill_bf16.h`), with P rounded to bf16: other bits than the float32 lanes', the same
    invariance. `bf16_pairs=False` keeps the float32 lanes, to compare."""
    lib = get()
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available")
    _check_cache(q, k_cache, v_cache, out)
    for name, t in (("seqs", seqs), ("tables", tables)):
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int64")
    if seqs.dim() != 2 or seqs.shape[1] != 4:
        raise ValueError(f"seqs must be [n, 4], got {tuple(seqs.shape)}")
    nb, bs, kv_heads, head_dim = k_cache.shape
    heads = q.shape[1]
    with _traced("kvtier::cpu_prefill_attention"):
        rc = lib.kvt_prefill_attention(
            _dtypes(q, k_cache), _ptr(q), q.stride(0), _ptr(k_cache), _ptr(v_cache), k_cache.stride(0),
            k_cache.stride(1), _ptr(out), out.stride(0), _ptr(seqs), seqs.shape[0], _ptr(tables), tables.numel(),
            heads, kv_heads,
            head_dim, bs, float(scale), int(window), torch.get_num_threads(), int(bf16_pairs))
    if rc != 0:
        raise ValueError(f"unsupported input for the CPU prefill kernel: heads {heads}, kv_heads {kv_heads}, "
                         f"head_dim {head_dim}, block_size {bs}, or a chunk with qlen < 1, ctx < qlen or a "
                         f"block table shorter than its context")


class PrefillBf16(enum.IntEnum):
    """Where `prefill_attention` multiplies bfloat16 q and cache (kvt_prefill_bf16_kind)."""
    WIDENED = 0  # float32 FMAs on K/V widened as they load
    DPBF16 = 1  # vdpbf16ps (AVX512-BF16)
    AMX = 2  # AMX tiles

    def describe(self) -> str:
        return {PrefillBf16.WIDENED: "float32 lanes (no AVX512-BF16 here)", PrefillBf16.DPBF16: "vdpbf16ps (AVX512-BF16)",
                PrefillBf16.AMX: "AMX tiles"}[self]


def prefill_bf16_kind() -> PrefillBf16:
    """How `prefill_attention` runs bfloat16 here: AMX tiles (a CPU with AMX-BF16, the kernels built
    for it, Linux granting the tile state), vdpbf16ps (built for AVX512-BF16), or widened."""
    lib = get()
    return PrefillBf16(lib.kvt_prefill_bf16_kind()) if lib is not None else PrefillBf16.WIDENED


def prefill_supported(heads: int, kv_heads: int, block_size: int) -> bool:
    """Shapes `prefill_attention` takes (the C++ side checks the same)."""
    return (kv_heads > 0 and heads % kv_heads == 0 and heads // kv_heads <= 16
            and (block_size % 16 == 0 or 16 % block_size == 0))


def _bf16(t: torch.Tensor) -> int:
    if t.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"float32 or bfloat16 only, got {t.dtype}")
    return int(t.dtype == torch.bfloat16)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`h += delta` in place (when given), then returns RMSNorm(h) * weight for a contiguous
    `[rows, n]`, bit-identical to transformers' RMSNorm: torch computes the mean of squares (its
    reduction order), the kernel the remaining four ops in one pass."""
    lib = get()
    assert lib is not None and h.is_contiguous()
    if delta is not None:
        h.add_(delta)
    var = h.float().pow(2).mean(-1)
    out = torch.empty_like(h)
    lib.kvt_rms_norm_apply(_bf16(h), h.data_ptr(), var.data_ptr(), weight.data_ptr(), out.data_ptr(), h.shape[0],
                           h.shape[1], float(eps), torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place on `x [tokens, heads, dim]` (rows may be strided, heads and dims
    contiguous) with `cos`/`sin` `[tokens, dim]` contiguous."""
    lib = get()
    tokens, heads, dim = x.shape
    assert lib is not None and x.stride()[1:] == (dim, 1) and cos.is_contiguous() and sin.is_contiguous()
    assert dim <= 512 and cos.dtype == x.dtype == sin.dtype
    lib.kvt_rope(_bf16(x), x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), tokens, heads, dim,
                 torch.get_num_threads())
