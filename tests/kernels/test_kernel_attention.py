"""Paged decode and prefill kernels vs their torch references, and the references vs a naive
dense softmax attention over the unpaged K/V. Small shapes: on CPU they run interpreted."""
from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test])")

from engine.kernels import paged_decode, paged_prefill, reference  # noqa: E402

KV_HEADS = 2
WINDOW = 24
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
LEVELS = ([1, 4], [64, 128], [16, 32], [0, WINDOW], [torch.float32, torch.bfloat16])  # group, dim, bs, window, dtype
if os.environ.get("KVTIER_KERNEL_TESTS") == "full":
    CASES = list(itertools.product(*LEVELS))  # all 32 combinations
else:
    # Each case costs seconds (interpreted on CPU; compiling its kernel variants on a GPU):
    # 8 cases in which every pair of values of any two factors occurs (a strength-2
    # orthogonal array: factors a, b, c, a^b, a^c of three bits).
    CASES = [tuple(lv[x] for lv, x in zip(LEVELS, (a, b, c, a ^ b, a ^ c)))
             for a, b, c in itertools.product((0, 1), repeat=3)]


def _id(case) -> str:
    g, d, bs, w, dt = case
    return f"g{g}-d{d}-bs{bs}-w{w}-{str(dt).removeprefix('torch.')}"


def make_paged(ctx_lens: list[int], kv_heads: int, dim: int, bs: int, dtype: torch.dtype, device, seed: int):
    """Random dense K/V per sequence, stored at random non-contiguous blocks of a paged cache.

    Block 0 (the table padding) and the slots past each context are NaN: a kernel that reads
    past a sequence's context returns NaN."""
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(c / bs) for c in ctx_lens]
    num_blocks = sum(need) + 4
    k_cache = torch.full((num_blocks, bs, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    tables = torch.zeros(len(ctx_lens), max(need) + 2, dtype=torch.int32)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    dense = []
    used = 0
    for b, (ctx, n) in enumerate(zip(ctx_lens, need)):
        ids = perm[used : used + n]
        used += n
        tables[b, :n] = ids.int()
        k = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype)
        v = torch.randn(ctx, kv_heads, dim, generator=gen).to(dtype)
        for j, blk in enumerate(ids.tolist()):
            rows = slice(j * bs, min((j + 1) * bs, ctx))
            k_cache[blk, : rows.stop - rows.start] = k[rows]
            v_cache[blk, : rows.stop - rows.start] = v[rows]
        dense.append((k.to(device), v.to(device)))
    return k_cache.to(device), v_cache.to(device), tables.to(device), dense


def naive(q, k, v, q_pos: list[int], scale: float, window: int, causal: bool = True) -> torch.Tensor:
    """Softmax attention written out per head and row, in fp32, from the unpaged K/V."""
    q, k, v = q.float().cpu(), k.float().cpu(), v.float().cpu()  # many tiny ops: cheaper on the host
    n, hq, dim = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(n, hq, dim)
    for h, i in itertools.product(range(hq), range(n)):
        keys = [j for j in range(k.shape[0])
                if (not causal or j <= q_pos[i]) and (window <= 0 or j > q_pos[i] - window)]
        w = torch.softmax(k[keys, h // group] @ q[i, h] * scale, dim=0)
        out[i, h] = w @ v[keys, h // group]
    return out


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **TOL[dtype])


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_decode(case, device):
    group, dim, bs, window, dtype = case
    ctx_lens = [1, 37, 70, 95]
    k_cache, v_cache, tables, dense = make_paged(ctx_lens, KV_HEADS, dim, bs, dtype, device, seed=dim + bs)
    q = torch.randn(len(ctx_lens), KV_HEADS * group, dim).to(dtype).to(device)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    scale = dim ** -0.5
    want = reference.paged_decode_ref(q, k_cache, v_cache, tables, lens, scale, window)
    for b, ctx in enumerate(ctx_lens):  # the reference itself, against the dense definition
        _close(want[b : b + 1], naive(q[b : b + 1], *dense[b], [ctx - 1], scale, window), dtype)
    # One split per sequence, then several (the reduce step); 3 splits of <= 95 keys also
    # leave splits empty for the short sequences.
    for splits in (1, 3):
        got = paged_decode(q, k_cache, v_cache, tables, lens, scale, window=window, num_splits=splits)
        _close(got, want, dtype)


def test_decode_padding_rows_and_auto_splits(device):
    """A zero-length row (CUDA-graph padding) outputs zeros; the automatic split count is exact."""
    ctx_lens = [0, 300, 5]
    k_cache, v_cache, tables, _ = make_paged(ctx_lens, KV_HEADS, 64, 16, torch.float32, device, seed=1)
    q = torch.randn(3, KV_HEADS * 4, 64, device=device)
    lens = torch.tensor(ctx_lens, dtype=torch.int64, device=device)
    got = paged_decode(q, k_cache, v_cache, tables.long(), lens, 0.125)
    assert torch.count_nonzero(got[0]) == 0
    _close(got, reference.paged_decode_ref(q, k_cache, v_cache, tables, lens, 0.125), torch.float32)


PREFILL_SEQS = [(23, 23), (9, 50), (1, 31), (40, 77)]  # (query_len, context_len): fresh, chunk, token, long


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_prefill(case, device):
    group, dim, bs, window, dtype = case
    q_lens, ctx_lens = zip(*PREFILL_SEQS)
    k_cache, v_cache, tables, dense = make_paged(list(ctx_lens), KV_HEADS, dim, bs, dtype, device, seed=dim * bs)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), KV_HEADS * group, dim).to(dtype).to(device)
    scale = dim ** -0.5
    want = reference.paged_prefill_ref(q, k_cache, v_cache, tables, cu, lens, scale, window)
    for b, (n, ctx) in enumerate(PREFILL_SEQS):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        _close(want[rows], naive(q[rows], *dense[b], list(range(ctx - n, ctx)), scale, window), dtype)
    got = paged_prefill(q, k_cache, v_cache, tables, cu, lens, scale, max_query_len=max(q_lens), window=window)
    _close(got, want, dtype)


def test_prefill_not_causal_odd_head_dim(device):
    """causal=False, and a head_dim that is not a power of two (padded inside the kernel)."""
    seqs = [(7, 20), (18, 18)]
    q_lens, ctx_lens = zip(*seqs)
    k_cache, v_cache, tables, dense = make_paged(list(ctx_lens), 1, 80, 16, torch.float32, device, seed=3)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], device=device)
    lens = torch.tensor(ctx_lens, device=device)
    q = torch.randn(sum(q_lens), 3, 80, device=device)
    for causal, window in ((False, 0), (True, 5)):
        want = reference.paged_prefill_ref(q, k_cache, v_cache, tables, cu, lens, 0.1, window, causal)
        got = paged_prefill(q, k_cache, v_cache, tables, cu, lens, 0.1, max_query_len=18, window=window, causal=causal)
        _close(got, want, torch.float32)
    lens1 = torch.tensor([20], device=device)
    want = reference.paged_decode_ref(q[:1], k_cache, v_cache, tables[:1], lens1, 0.1, 6)
    _close(paged_decode(q[:1], k_cache, v_cache, tables[:1], lens1, 0.1, window=6, num_splits=2), want, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="long contexts only on the GPU (slow interpreted)")
@pytest.mark.parametrize("window", [0, 1000])
def test_long_contexts_gpu(window, device):
    """Sizes where the GPU tile shapes, many splits and the unmasked middle tiles all matter."""
    seqs = [(700, 3001), (1, 4097), (129, 129), (2048, 2600)]
    q_lens, ctx_lens = zip(*seqs)
    k_cache, v_cache, tables, _ = make_paged(list(ctx_lens), 8, 128, 16, torch.bfloat16, device, seed=4)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), 32, 128, device=device, dtype=torch.bfloat16)
    want = reference.paged_prefill_ref(q, k_cache, v_cache, tables, cu, lens, 128 ** -0.5, window)
    got = paged_prefill(q, k_cache, v_cache, tables, cu, lens, 128 ** -0.5, max_query_len=2048, window=window)
    _close(got, want, torch.bfloat16)
    qd = torch.randn(len(seqs), 32, 128, device=device, dtype=torch.bfloat16)
    want = reference.paged_decode_ref(qd, k_cache, v_cache, tables, lens, 128 ** -0.5, window)
    got = paged_decode(qd, k_cache, v_cache, tables, lens, 128 ** -0.5, window=window)
    _close(got, want, torch.bfloat16)
