"""The C++ CPU kernels: attention against a dense fp32 reference (engine/kernels/reference.py) and
the engine's CPU backend on mixed batches; the fused norm and rotary embedding against the eager
ops; the whole engine with and without them against transformers."""
from __future__ import annotations

import logging

import pytest
import torch

from engine import cpu_kernels
from engine.kernels.reference import attend_ref, paged_decode_ref

if cpu_kernels.get() is None:
    pytest.skip("the CPU kernel did not build here (no C++ compiler?)", allow_module_level=True)

TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}  # max |kernel - ref| / max |ref|


def _cache(num_blocks: int, bs: int, kv_heads: int, head_dim: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    return kv[0], kv[1], g


def _check(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    err = (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
    assert err <= TOL[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 64 and 128 take the lanes path (attend_lanes), other head sizes the generic one
@pytest.mark.parametrize("heads,kv_heads,head_dim,bs", [(9, 3, 64, 16), (4, 4, 128, 16), (8, 2, 64, 8), (6, 1, 128, 32),
                                                        (8, 2, 80, 8), (6, 1, 32, 32)])
@pytest.mark.parametrize("n", [1, 3, 40])  # few rows split by kv head; many rows go whole
def test_decode_matches_reference(dtype, heads, kv_heads, head_dim, bs, n):
    k, v, g = _cache(96, bs, kv_heads, head_dim, dtype, seed=n + heads)
    lens = torch.randint(1, 10 * bs, (n,), generator=g)
    lens[0] = 1
    if n > 2:
        lens[1], lens[2] = bs, 4 * bs + 1  # block edges
    width = int(-(-lens.max() // bs))
    tables = torch.randint(0, 96, (n, width), generator=g)  # scattered (and shared) blocks
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    cpu_kernels.paged_attention(q, k, v, out, torch.arange(n), tables, lens, 0.3)
    _check(out, paged_decode_ref(q, k, v, tables, lens, 0.3), dtype)


def test_rows_are_scattered_and_other_rows_untouched():
    k, v, g = _cache(16, 16, 2, 64, torch.float32, seed=1)
    q = torch.randn(10, 4, 64, generator=g)
    out = torch.zeros_like(q)
    rows = torch.tensor([7, 2])
    tables = torch.tensor([[3, 9], [5, 0]])
    lens = torch.tensor([20, 16])
    cpu_kernels.paged_attention(q, k, v, out, rows, tables, lens, 0.125)
    want = paged_decode_ref(q[rows], k, v, tables, lens, 0.125)
    _check(out[rows], want, torch.float32)
    others = [i for i in range(10) if i not in (2, 7)]
    assert out[others].abs().sum() == 0


def test_kernel_calls_show_in_a_profile_only_while_profiling(monkeypatch):
    k, v, g = _cache(8, 16, 1, 64, torch.float32, seed=2)
    q = torch.randn(1, 2, 64, generator=g)
    args = (q, k, v, torch.empty_like(q), torch.tensor([0]), torch.tensor([[1, 4]]), torch.tensor([20]), 0.125)
    with torch.profiler.profile() as prof:
        cpu_kernels.paged_attention(*args)
    assert "kvtier::cpu_paged_attention" in {e.key for e in prof.key_averages()}
    opened: list[str] = []
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: opened.append(name))
    cpu_kernels.paged_attention(*args)  # no profiler: no range (it costs ~10 us a call)
    assert opened == []


def test_zero_length_row_gives_zeros_not_nan():
    k, v, _ = _cache(4, 16, 1, 64, torch.float32, seed=2)
    out = torch.full((1, 1, 64), float("nan"))
    cpu_kernels.paged_attention(torch.ones(1, 1, 64), k, v, out, torch.tensor([0]), torch.tensor([[0]]),
                                torch.tensor([0]), 1.0)
    assert torch.equal(out, torch.zeros_like(out))


def test_large_scores_stay_finite():
    """Online softmax keeps exp() arguments <= 0: scores in the thousands do not overflow."""
    k, v, g = _cache(8, 16, 1, 64, torch.float32, seed=3)
    q = torch.randn(1, 1, 64, generator=g) * 200
    out = torch.empty_like(q)
    lens, tables = torch.tensor([100]), torch.arange(7).view(1, 7)
    cpu_kernels.paged_attention(q, k, v, out, torch.tensor([0]), tables, lens, 1.0)
    assert torch.isfinite(out).all()
    _check(out, paged_decode_ref(q, k, v, tables, lens, 1.0), torch.float32)


def test_bad_arguments_are_refused():
    k, v, _ = _cache(4, 16, 2, 64, torch.float32, seed=4)
    q, rows, tables, lens = torch.zeros(1, 4, 64), torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1])
    with pytest.raises(ValueError, match="dtypes"):
        cpu_kernels.paged_attention(q.double(), k, v, q.double(), rows, tables, lens, 1.0)
    with pytest.raises(ValueError, match="int64"):
        cpu_kernels.paged_attention(q, k, v, torch.empty_like(q), rows.int(), tables, lens, 1.0)
    with pytest.raises(ValueError, match="unsupported shape"):  # 3 query heads over 2 kv heads
        cpu_kernels.paged_attention(torch.zeros(1, 3, 64), k, v, torch.zeros(1, 3, 64), rows, tables, lens, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_matches_torch_path_on_a_mixed_batch(dtype):
    """Decodes (the kernel), a short and a long chunk after cached context (SDPA with a mask) and
    a fresh prompt (causal SDPA) in one step: both CPU backends equal dense attention."""
    from engine.runner.attention import AttentionMetadata, DecodeGroup, PrefillSeq, TorchPagedAttention
    from engine.runner.attention_cpu import CpuPagedAttention

    bs, kvh, heads, d = 16, 2, 6, 64
    k_cache, v_cache, g = _cache(64, bs, kvh, d, dtype, seed=5)
    # (query_len, context_len, blocks): short chunk, long chunk, fresh prompt
    seqs = [(5, 40, [10, 3, 7]), (36, 70, [20, 21, 22, 23, 24]), (30, 30, [30, 31])]
    decodes = [(9, [40, 41]), (33, [50, 51, 52])]
    prefills, slots, start = [], [], 0
    for qlen, ctx, blocks in seqs:
        ids = torch.tensor(blocks)
        run = blocks[0] if blocks == list(range(blocks[0], blocks[0] + len(blocks))) else None
        prefills.append(PrefillSeq(start, qlen, ctx, ids, run))
        slots += [blocks[p // bs] * bs + p % bs for p in range(ctx - qlen, ctx)]
        start += qlen
    rows = list(range(start, start + len(decodes)))
    slots += [t[(n - 1) // bs] * bs + (n - 1) % bs for n, t in decodes]
    width = max(len(t) for _, t in decodes)
    tables = torch.tensor([t + [0] * (width - len(t)) for _, t in decodes])
    lens = torch.tensor([n for n, _ in decodes])
    mask = (torch.arange(width * bs)[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(torch.tensor(slots), prefills, [DecodeGroup(torch.tensor(rows), tables, lens, mask)])
    total = start + len(decodes)
    q = torch.randn(total, heads, d, generator=g).to(dtype)
    k = torch.randn(total, kvh, d, generator=g).to(dtype)
    v = torch.randn(total, kvh, d, generator=g).to(dtype)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    torch_path = TorchPagedAttention().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    got = CpuPagedAttention().forward(q, k, v, kc2, vc2, meta, 0.125)
    assert torch.equal(kc2, k_cache) and torch.equal(vc2, v_cache)  # the same K/V writes
    ref = torch.zeros_like(q)  # dense attention over each row's causal context, in fp32
    spans = [(p.query_start, p.query_len, ctx, blocks) for p, (_, ctx, blocks) in zip(prefills, seqs)]
    spans += [(r, 1, n, t) for r, (n, t) in zip(rows, decodes)]
    for start, qlen, ctx, blocks in spans:
        kk, vv = (c[torch.tensor(blocks)].flatten(0, 1)[:ctx] for c in (k_cache, v_cache))
        pos = torch.arange(ctx - qlen, ctx)
        ref[start : start + qlen] = attend_ref(q[start : start + qlen], kk, vv, pos, 0.125)
    _check(got.view_as(q), ref, dtype)
    _check(torch_path.view_as(q), ref, dtype)


def test_disabled_by_env_falls_back_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    with caplog.at_level(logging.WARNING, logger="engine.cpu_kernels"):
        assert cpu_kernels.get() is None
    assert f"{cpu_kernels.DISABLE_ENV}=0" in caplog.text


def test_a_bad_switch_value_is_an_error_naming_it(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "false")
    with pytest.raises(ValueError, match=f"{cpu_kernels.DISABLE_ENV} must be 0 .* got 'false'"):
        cpu_kernels.get()


def test_a_broken_compiler_falls_back_with_the_reason(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="engine.cpu_kernels"):
        assert cpu_kernels.get() is None
    assert "/bin/false" in caplog.text and "failed" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_eager(dtype, with_delta):
    from engine.models.llama import RMSNorm

    g = torch.Generator().manual_seed(6)
    h = torch.randn(37, 576, generator=g).to(dtype) * 3
    delta = torch.randn(37, 576, generator=g).to(dtype) if with_delta else None
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = (1 + 0.2 * torch.randn(576, generator=g)).to(dtype)
    want_h = h + delta if with_delta else h.clone()
    want = norm(want_h)
    got_h = h.clone()
    got = cpu_kernels.add_rms_norm(got_h, delta, norm.weight, norm.eps)
    assert torch.equal(got_h, want_h)
    assert torch.equal(got, want)  # the same float ops in the same order as the eager norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_matches_eager(dtype):
    from engine.models.llama import _rotate_half

    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(19, 9 * 64 + 2 * 3 * 64, generator=g).to(dtype)
    q = qkv[:, : 9 * 64].view(19, 9, 64)  # strided rows, as the projection's split gives them
    cos, sin = torch.randn(19, 64, generator=g).to(dtype), torch.randn(19, 64, generator=g).to(dtype)
    want = q * cos.unsqueeze(1) + _rotate_half(q) * sin.unsqueeze(1)
    rest = qkv[:, 9 * 64 :].clone()
    cpu_kernels.rope_(q, cos, sin)
    assert torch.equal(qkv[:, 9 * 64 :], rest)  # k and v untouched
    if dtype == torch.float32:
        assert torch.equal(q, want)  # same products and sums, rounded the same way
    else:
        _check(q, want, dtype)


def test_engine_with_and_without_cpu_kernels_matches_transformers(ckpt_dir, hf_model, monkeypatch):
    """Greedy tokens with the kernels (the CPU default) and with the torch path both equal
    transformers'; the prompts cross blocks and the batch mixes prefill chunks with decodes."""
    from checkpoints import hf_greedy, random_prompt
    from engine import LLM, SamplingParams

    prompts = [random_prompt(n, 7000 + n) for n in (5, 40, 300)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run():
        llm = LLM(str(ckpt_dir("qwen2")), dtype="float32", block_size=16, num_gpu_blocks=256,
                  max_num_batched_tokens=64, seed=0)
        fused = llm.engine.runner.model.fused
        return [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)], fused

    with_kernels, fused = run()
    assert fused
    monkeypatch.setattr(cpu_kernels, "_state", {"lib": None})
    without, fused = run()
    assert not fused
    want = [hf_greedy(hf_model("qwen2"), p, 10) for p in prompts]
    assert with_kernels == want and without == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,bs", [(64, 16), (80, 8), (128, 32)])  # lanes path, generic path
@pytest.mark.parametrize("window", [1, 7, 16, 37])  # mid-block, block-aligned, and past a 16-key slice
def test_decode_with_a_sliding_window_matches_reference(dtype, head_dim, bs, window):
    heads, kv_heads, n = 8, 2, 12
    k, v, g = _cache(96, bs, kv_heads, head_dim, dtype, seed=window + head_dim)
    lens = torch.randint(1, 8 * bs, (n,), generator=g)
    lens[0], lens[1], lens[2] = 1, window, window + 1  # shorter than, equal to and just past the window
    tables = torch.randint(0, 96, (n, int(-(-lens.max() // bs))), generator=g)
    q = torch.randn(n, heads, head_dim, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    cpu_kernels.paged_attention(q, k, v, out, torch.arange(n), tables, lens, 0.3, window)
    _check(out, paged_decode_ref(q, k, v, tables, lens, 0.3, window=window), dtype)
