"""The C++ prefill kernel (engine/cpu_kernels/prefill_attention.cpp): against dense fp32
attention (engine/kernels/reference.py), and bit for bit against itself however a prompt is cut
into chunks: the property that lets a prefix hit never change an output."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import cpu_kernels
from engine.kernels.reference import attend_ref

if cpu_kernels.get() is None:
    pytest.skip("the CPU kernels did not build here (no C++ compiler?)", allow_module_level=True)

TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}  # max |kernel - ref| / max |ref|


def _setup(num_blocks, bs, kv_heads, heads, head_dim, tokens, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    return kv[0], kv[1], q, g


def _run(q, k, v, chunks, tables, scale, out=None):
    """chunks: (q0, qlen, ctx, table) per sequence; one kernel call for all of them."""
    out = torch.full_like(q, float("nan")) if out is None else out
    rows, flat, off = [], [], 0
    for q0, qlen, ctx, table in chunks:
        rows.append((q0, qlen, ctx, off))
        flat.append(table)
        off += table.numel()
    cpu_kernels.prefill_attention(q, k, v, out, torch.tensor(rows, dtype=torch.long), torch.cat(flat), scale)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,bs", [(9, 3, 64, 16), (4, 4, 128, 16), (8, 2, 80, 8),
                                                        (6, 1, 32, 32), (2, 2, 64, 1)])
def test_chunks_match_dense_attention(dtype, heads, kv_heads, head_dim, bs):
    """A fresh prompt, chunks after cached context (long and 1-token, ending mid-block) and a
    prompt shorter than a tile, with scattered block tables, in one call; rows no chunk owns stay
    untouched."""
    nb = 96 if bs > 1 else 400
    k, v, q, g = _setup(nb, bs, kv_heads, heads, head_dim, 140, dtype, seed=heads * bs)
    specs = [(0, 45, 45), (50, 37, 101), (90, 1, 70), (100, 3, 3)]  # (q0, qlen, ctx)
    chunks = []
    for q0, qlen, ctx in specs:
        chunks.append((q0, qlen, ctx, torch.randperm(nb, generator=g)[: -(-ctx // bs)]))
    out = _run(q, k, v, chunks, None, 0.3)
    owned = set()
    for q0, qlen, ctx, table in chunks:
        kk, vv = (c[table].flatten(0, 1)[:ctx] for c in (k, v))
        want = attend_ref(q[q0 : q0 + qlen], kk, vv, torch.arange(ctx - qlen, ctx), 0.3)
        got = out[q0 : q0 + qlen]
        err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
        assert err <= TOL[dtype], (q0, err)
        owned.update(range(q0, q0 + qlen))
    assert torch.isnan(out[[i for i in range(140) if i not in owned]]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 8, 32])
def test_any_chunking_gives_the_bits_of_a_fresh_prefill(dtype, bs):
    """One prompt computed whole, then cut at random points (each chunk attending to the cache the
    earlier ones filled; slots past the sequence's end hold NaN, as never-written memory may): every
    row is identical, bit for bit."""
    heads, kv_heads, d, n = 9, 3, 64, 300
    nb = -(-n // bs)
    k, v, q, g = _setup(nb + 1, bs, kv_heads, heads, d, n, dtype, seed=bs)
    k[nb:], v[nb:] = float("nan"), float("nan")
    table = torch.randperm(nb, generator=g)
    whole = _run(q, k, v, [(0, n, n, table)], None, 0.125)
    for trial in range(4):
        cuts = sorted(torch.randperm(n - 1, generator=g)[: 1 + trial * 3].add(1).tolist())
        out = torch.full_like(q, float("nan"))
        for a, b in zip([0, *cuts], [*cuts, n]):
            kc, vc = k.clone(), v.clone()  # keys past this chunk's end are garbage
            flat_k, flat_v = kc[table].flatten(0, 1), vc[table].flatten(0, 1)
            flat_k[b:], flat_v[b:] = float("nan"), float("nan")
            kc[table], vc[table] = flat_k.view(nb, bs, kv_heads, d), flat_v.view(nb, bs, kv_heads, d)
            _run(q, kc, vc, [(a, b - a, b, table[: -(-b // bs)])], None, 0.125, out=out)
        assert torch.equal(out, whole), (cuts, (out.float() - whole.float()).abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("heads,kv_heads,head_dim,bs,window", [(9, 3, 64, 16, 0), (8, 2, 80, 8, 0), (4, 4, 24, 32, 0),
                                                               (6, 2, 64, 16, 5), (6, 2, 64, 16, 48)])
def test_chunks_of_a_few_rows_give_the_bits_of_a_fresh_prefill(dtype, heads, kv_heads, head_dim, bs, window):
    """Chunks of 1-9 rows (a one-token chunk after a prefix or tier hit; 8 rows or fewer take the
    keys-in-lanes path, 9 the tile) ending at every position of a prompt: each equals, bit for bit,
    the same rows of the prompt computed whole, with and without a sliding window, for head sizes
    that are and are not a multiple of 16."""
    n = 120
    nb = -(-n // bs)
    k, v, q, g = _setup(nb, bs, kv_heads, heads, head_dim, n, dtype, seed=head_dim + bs + window)
    q = q.float() if dtype == torch.float8_e4m3fn else q  # an fp8 cache under float32 q (--kv-cache-dtype)
    table = torch.randperm(nb, generator=g)
    whole = torch.full_like(q, float("nan"))
    cpu_kernels.prefill_attention(q, k, v, whole, torch.tensor([[0, n, n, 0]]), table, 0.2, window)
    for rows in range(1, 10):
        for end in range(rows, n + 1):
            out = torch.full_like(q, float("nan"))
            cpu_kernels.prefill_attention(q, k, v, out, torch.tensor([[end - rows, rows, end, 0]]),
                                          table[: -(-end // bs)], 0.2, window)
            assert torch.equal(out[end - rows:end], whole[end - rows:end]), (rows, end)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_last_block_after_a_long_prefix_splits_by_head_and_keeps_the_bits(threads, monkeypatch):
    """The step after a prefix hit recomputes one tile (16 rows) over the whole context: the kernel
    then makes each query head a work item of its own, so every core has work. The rows still
    equal, bit for bit, those of a fresh prefill (tiles with all their heads), at any thread count."""
    heads, kv_heads, d, n, bs = 12, 2, 64, 700, 16
    nb = -(-n // bs)
    k, v, q, g = _setup(nb, bs, kv_heads, heads, d, n, torch.float32, seed=7)
    table = torch.randperm(nb, generator=g)
    whole = _run(q, k, v, [(0, n, n, table)], None, 0.125)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the kernel's thread count
    last = _run(q, k, v, [(n - 16, 16, n, table)], None, 0.125)
    assert torch.equal(last[n - 16:], whole[n - 16:])
    assert torch.isnan(last[:n - 16]).all()


def test_rows_of_different_sequences_do_not_mix_tiles():
    """Two sequences in one call give the same bits as each alone."""
    k, v, q, g = _setup(64, 16, 2, 4, 64, 60, torch.float32, seed=3)
    a = (0, 21, 21, torch.tensor([3, 9]))
    b = (21, 39, 50, torch.tensor([10, 11, 40, 41]))
    both = _run(q, k, v, [a, b], None, 0.2)
    alone = _run(q, k, v, [a], None, 0.2)
    alone = _run(q, k, v, [b], None, 0.2, out=alone)
    assert torch.equal(both, alone)


def test_unsupported_shapes_and_bad_chunks_are_refused():
    k, v, q, _ = _setup(8, 12, 2, 4, 64, 8, torch.float32, seed=0)
    assert not cpu_kernels.prefill_supported(4, 2, 12)  # 12 neither divides nor is a multiple of 16
    with pytest.raises(ValueError, match="unsupported input"):
        _run(q, k, v, [(0, 4, 4, torch.tensor([0]))], None, 1.0)
    k, v, q, _ = _setup(8, 16, 2, 4, 64, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="unsupported input"):  # context shorter than the chunk
        _run(q, k, v, [(0, 4, 3, torch.tensor([0]))], None, 1.0)
    with pytest.raises(ValueError, match="block table shorter"):  # 40 tokens need 3 blocks, the table has 2
        _run(q, k, v, [(0, 4, 40, torch.tensor([0, 1]))], None, 1.0)
    with pytest.raises(ValueError, match=r"seqs must be \[n, 4\]"):
        cpu_kernels.prefill_attention(q, k, v, torch.empty_like(q), torch.zeros(3, dtype=torch.long),
                                      torch.zeros(1, dtype=torch.long), 1.0)
    assert cpu_kernels.prefill_supported(9, 3, 16) and cpu_kernels.prefill_supported(4, 4, 64)
    assert not cpu_kernels.prefill_supported(34, 2, 16)  # 17 query heads per kv head


# vec16.h's three paths: AVX-512, AVX2 (two 8-lane halves) and plain lane loops. The native build
# runs one of the first two everywhere else in the tests; these builds run the others.
PORTABLE = {
    # every x86-64: the lane loops, at -O1 (the same results as -O3, which takes ~100 s over them)
    "x86-64": ((), "-O1"),
    # AVX2 where the native build is AVX-512 (elsewhere the native build already is the AVX2 path)
    "haswell": (("avx2", "fma", "f16c", "avx512f"), "-O3"),
}


@pytest.mark.parametrize("march", PORTABLE)
def test_the_portable_builds_give_the_same_results(monkeypatch, tmp_path, march):
    """The kernels built without AVX-512: decode and prefill against the references (fp8 caches'
    every byte value included), chunking still bit-identical, and the float32 linear's bits those of
    the native build."""
    import platform

    from engine.cpu_kernels import build
    from engine.cpu_kernels import linear as f32_linear
    from engine.kernels.reference import paged_decode_ref
    from test_cpu_kernels import test_decode_with_a_sliding_window_matches_reference
    from test_cpu_linear_f32 import portable_build_check
    from test_kv_quant import FORMATS, test_cpu_kernels_read_every_byte_value_as_torch_does

    if platform.machine() != "x86_64":
        pytest.skip("these builds are for x86-64")
    needs, opt = PORTABLE[march]
    flags = set(next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "").split())
    if not set(needs) <= flags:
        pytest.skip(f"this CPU lacks {', '.join(sorted(set(needs) - flags))}")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    w, x, b, linear_bits = portable_build_check()  # from the native build
    monkeypatch.setattr(cpu_kernels, "_state", {"lib": build.load(march=march, opt=opt)})
    assert torch.equal(f32_linear.linear_f32(x, f32_linear.pack_f32(w), b), linear_bits)
    test_chunks_match_dense_attention(torch.float32, 9, 3, 64, 16)
    test_chunks_match_dense_attention(torch.bfloat16, 8, 2, 80, 8)
    test_any_chunking_gives_the_bits_of_a_fresh_prefill(torch.float32, 16)
    test_chunks_of_a_few_rows_give_the_bits_of_a_fresh_prefill(torch.float32, 8, 2, 80, 8, 0)
    test_chunks_of_a_few_rows_give_the_bits_of_a_fresh_prefill(torch.float32, 6, 2, 64, 16, 5)
    for window in (5, 48):
        test_sliding_window_chunks_match_dense_attention_and_any_chunking(torch.float32, 16, window)
        test_decode_with_a_sliding_window_matches_reference(torch.float32, 64, 16, window)
    for fmt in FORMATS:
        for head_dim in (64, 24):
            test_cpu_kernels_read_every_byte_value_as_torch_does(fmt, head_dim)
    k, v, q, g = _setup(40, 16, 3, 9, 64, 5, torch.float32, seed=7)
    tables = torch.randint(0, 40, (5, 6), generator=g)
    lens = torch.tensor([1, 16, 17, 50, 96])
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full_like(q, float("nan")).to(dtype)
        cpu_kernels.paged_attention(q.to(dtype), k.to(dtype), v.to(dtype), out, torch.arange(5), tables, lens, 0.125)
        want = paged_decode_ref(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), tables, lens, 0.125)
        assert (out.float() - want).abs().max() <= TOL[dtype] * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 8, 32])
@pytest.mark.parametrize("window", [1, 5, 16, 48])
def test_sliding_window_chunks_match_dense_attention_and_any_chunking(dtype, bs, window):
    """With a window: chunks against the dense reference, and cut anywhere the same bits as whole."""
    heads, kv_heads, d, n = 6, 2, 64, 200
    nb = -(-n // bs)
    k, v, q, g = _setup(nb, bs, kv_heads, heads, d, n, dtype, seed=bs + window)
    table = torch.randperm(nb, generator=g)
    whole = torch.full_like(q, float("nan"))
    cpu_kernels.prefill_attention(q, k, v, whole, torch.tensor([[0, n, n, 0]]), table, 0.2, window)
    kk, vv = (c[table].flatten(0, 1)[:n] for c in (k, v))
    want = attend_ref(q, kk, vv, torch.arange(n), 0.2, window=window)
    err = (whole.float() - want.float()).abs().max().item() / want.float().abs().max().item()
    assert err <= TOL[dtype], err
    cuts = sorted(torch.randperm(n - 1, generator=g)[:5].add(1).tolist())
    out = torch.full_like(q, float("nan"))
    for a, b in zip([0, *cuts], [*cuts, n]):
        cpu_kernels.prefill_attention(q, k, v, out, torch.tensor([[a, b - a, b, 0]]), table[: -(-b // bs)], 0.2,
                                      window)
    assert torch.equal(out, whole)


@pytest.mark.skipif(not cpu_kernels.prefill_bf16_kind(), reason="bfloat16 pairs need AVX512-BF16 or AMX-BF16")
@pytest.mark.parametrize("heads,kv_heads,head_dim,bs,window", [(9, 3, 64, 16, 0), (4, 4, 128, 32, 0), (6, 2, 96, 16, 0),
                                                               (6, 2, 64, 16, 40)])
def test_bf16_pairs_agree_with_the_float32_lanes(heads, kv_heads, head_dim, bs, window):
    """bfloat16 in pairs (AMX tiles, prefill_amx.h, or vdpbf16ps, prefill_bf16.h) against the float32
    lanes on the same chunks (a fresh prompt, a chunk after cached context ending mid-block, a short
    tail): within bf16's rounding of P, not the same bits (so the pairs path did run), and nothing
    read past a sequence's end (NaN there) reaches an output. The chunking tests above run the pairs
    path too on such a CPU."""
    n = 260
    nb = -(-n // bs) + 1
    k, v, q, g = _setup(nb, bs, kv_heads, heads, head_dim, n, torch.bfloat16, seed=head_dim + bs + window)
    table = torch.randperm(nb, generator=g)
    k[table[-1]], v[table[-1]] = float("nan"), float("nan")
    flat_k, flat_v = k[table].flatten(0, 1), v[table].flatten(0, 1)
    flat_k[250:], flat_v[250:] = float("nan"), float("nan")  # past the second chunk's end
    k[table], v[table] = flat_k.view(nb, bs, kv_heads, head_dim), flat_v.view(nb, bs, kv_heads, head_dim)
    seqs = torch.tensor([[0, 150, 150, 0], [150, 97, 250, 0], [247, 3, 3, 0]])
    outs = []
    for pairs in (True, False):
        out = torch.full_like(q, float("nan"))
        cpu_kernels.prefill_attention(q, k, v, out, seqs, table, 0.15, window, bf16_pairs=pairs)
        outs.append(out[:250].float())
    assert not outs[0].isnan().any()
    assert (outs[0] - outs[1]).abs().max() <= 2 * TOL[torch.bfloat16] * outs[1].abs().max()
    assert not torch.equal(outs[0], outs[1])
