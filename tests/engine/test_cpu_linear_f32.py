"""float32 linears on the vector units (engine/cpu_kernels/linear_f32.cpp) against a float64
reference, within the rounding bound of a float32 sum of k products, and batch-invariant: a row's
output is the same bits whatever rows, thread count or vector width surround it. Skipped where the
kernels are not built for AVX2 or AVX-512."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.cpu_kernels import linear as lin

pytestmark = pytest.mark.skipif(not lin.f32_build(), reason="no AVX2/AVX-512 build of the CPU kernels here")


def assert_within_sum_bound(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """|got - exact| <= (k + 1) u (|x| |W|^T + |b|): the classic bound on a float32 sum of k products
    (plus the bias), which any summation order meets and a wrong product or a missed term does not."""
    exact = x.double() @ w.double().t() + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
    bound = (x.shape[-1] + 1) * torch.finfo(torch.float32).eps / 2 * scale
    err = (got.double() - exact).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item()} over bound {bound.max().item()}"


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 12, 13, 64, 65, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_a_float64_reference(rows, bias):
    torch.manual_seed(rows)
    w = torch.randn(96, 157)  # any number of inputs
    b = torch.randn(96) if bias else None
    x = torch.randn(rows, 157)
    got = lin.linear_f32(x, lin.pack_f32(w), b)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    assert_within_sum_bound(got, x, w, b)


def test_long_inputs_sliced_along_k_keep_the_bound_and_the_bits():
    """k beyond one slice of W (2048 inputs) is summed slice by slice, continuing from the stored
    partial sums, over several row blocks: still within the bound, and each row's bits are those it
    gets alone."""
    torch.manual_seed(2)
    w, b = torch.randn(32, 4100), torch.randn(32)
    x = torch.randn(30, 4100)
    packed = lin.pack_f32(w)
    got = lin.linear_f32(x, packed, b)
    assert_within_sum_bound(got, x, w, b)
    assert torch.equal(torch.cat([lin.linear_f32(x[i:i + 1], packed, b) for i in range(30)]), got)


def test_a_row_gets_the_same_bits_in_any_batch_and_at_any_thread_count():
    """Each output is one fused multiply-add chain over k ascending, whoever computes it: alone,
    at any position of a batch of any size (every micro-kernel height), on 1, 2 or 3 threads."""
    torch.manual_seed(1)
    w = lin.pack_f32(torch.randn(4096, 64))  # more column panels than threads, and L2 chunks
    x = torch.randn(40, 64)
    alone = torch.cat([lin.linear_f32(x[i:i + 1], w, None) for i in range(40)])
    for size in (2, 5, 6, 7, 13, 40):
        assert torch.equal(torch.cat([lin.linear_f32(x[i:i + size], w, None) for i in range(0, 40, size)]), alone)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            assert torch.equal(lin.linear_f32(x, w, None), alone)
    finally:
        torch.set_num_threads(threads)


def test_rows_of_a_wider_tensor_and_leading_dims():
    torch.manual_seed(0)
    w = lin.pack_f32(torch.randn(32, 64))
    x = torch.randn(20, 128)[:, 32:96]  # rows 128 floats apart
    assert x.stride(0) == 128
    assert torch.equal(lin.linear_f32(x, w, None), lin.linear_f32(x.contiguous(), w, None))
    x3 = torch.randn(2, 5, 64)
    assert torch.equal(lin.linear_f32(x3, w, None), lin.linear_f32(x3.reshape(10, 64), w, None).view(2, 5, 32))
    assert lin.linear_f32(torch.empty(0, 64), w, None).shape == (0, 32)


def test_shapes_and_dtypes_it_does_not_take_are_refused():
    with pytest.raises(ValueError, match="out % 16"):
        lin.pack_f32(torch.randn(40, 64))
    with pytest.raises(ValueError, match="float32"):
        lin.pack_f32(torch.randn(32, 64, dtype=torch.bfloat16))
    w = lin.pack_f32(torch.randn(32, 64))
    with pytest.raises(ValueError, match="takes float32"):
        lin.linear_f32(torch.randn(3, 64, dtype=torch.bfloat16), w, None)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        lin.linear_f32(torch.randn(3, 63), w, None)


def test_packed_linear_takes_the_kernel_where_it_fits(monkeypatch):
    from engine.models.packed_linear import Kernel, PackedLinear

    torch.manual_seed(0)
    src = nn.Linear(64, 96, bias=True)
    monkeypatch.delenv(lin.F32_ENV, raising=False)
    default = PackedLinear(nn.Linear(64, 96)).kernel  # the measured default: AVX2 builds only
    assert default is (Kernel.F32 if lin.f32_build() is lin.F32Build.AVX2 else Kernel.ONEDNN)
    monkeypatch.setenv(lin.F32_ENV, "1")
    fits = PackedLinear(src, parts=(32, 64))
    odd = PackedLinear(nn.Linear(64, 40))  # 40 outputs: oneDNN
    assert fits.kernel is Kernel.F32 and odd.kernel is Kernel.ONEDNN and "kernel=f32" in repr(fits)
    x = torch.randn(7, 64)
    assert_within_sum_bound(fits(x), x, src.weight.detach(), src.bias.detach())
    assert torch.equal(torch.compile(fits, fullgraph=True)(x), fits(x))
    monkeypatch.setenv(lin.F32_ENV, "0")
    assert PackedLinear(nn.Linear(64, 96)).kernel is Kernel.ONEDNN
    monkeypatch.setenv(lin.F32_ENV, "on")
    with pytest.raises(ValueError, match="KVTIER_F32_LINEAR must be 0"):
        PackedLinear(nn.Linear(64, 96))


def test_the_engine_gives_the_same_tokens_on_either_kernel(ckpt_dir):
    """A float32 checkpoint on the kernel and on oneDNN (KVTIER_F32_LINEAR=0): the same greedy
    tokens, and logprobs equal but for the last bits (another summation order)."""
    from engine import LLM, SamplingParams
    from engine.models.packed_linear import PackedLinear

    prompts = [{"prompt_token_ids": list(range(5, 40))}, {"prompt_token_ids": list(range(100, 107))}]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3)
    got = {}
    for env in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(lin.F32_ENV, env)
            with LLM(model=str(ckpt_dir("llama")), dtype="float32", num_gpu_blocks=32, optimization_level=0) as llm:
                kinds = {m.kernel.value for m in llm.engine.runner.model.modules() if isinstance(m, PackedLinear)}
                assert kinds == {"f32" if env == "1" else "onednn"}
                got[env] = llm.generate(prompts, params, use_tqdm=False)
    for ours, dnn in zip(got["1"], got["0"]):
        assert ours.outputs[0].token_ids == dnn.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs, dnn.outputs[0].logprobs):
            assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-4


def portable_build_check() -> tuple[torch.Tensor, ...]:
    """Inputs and this build's outputs, for test_cpu_prefill_kernel's portable builds to compare:
    every build multiplies in the same order with fused multiply-adds, so the bits agree."""
    torch.manual_seed(3)
    w, x, b = torch.randn(64, 50), torch.randn(29, 50), torch.randn(64)
    return w, x, b, lin.linear_f32(x, lin.pack_f32(w), b)
