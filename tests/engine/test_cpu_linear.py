"""bfloat16 linears on AMX tiles (engine/cpu_kernels/linear_amx.cpp) against a float32 reference:
each output is the float32 dot product rounded once, so it may differ from the reference's
rounding by one bfloat16 step at most (summation order). Skipped where the CPU has no AMX."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.cpu_kernels import linear as amx_linear

pytestmark = pytest.mark.skipif(not amx_linear.amx_ready(), reason="no AMX-BF16 here (or the kernels are not built)")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    return (y if b is None else y + b.double()).float()


def assert_rounded_once(got: torch.Tensor, want: torch.Tensor) -> None:
    """`got` (bfloat16) is `want` rounded to bfloat16, give or take one step where the sum order
    moves it across a rounding boundary."""
    step = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    err = (got.float() - want).abs()
    assert bool((err <= step).all()), f"max error {err.max().item()} where one step is {step.max().item()}"


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 64, 65, 130, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_a_float_reference(rows, bias):
    torch.manual_seed(rows)
    w = torch.randn(96, 160, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16) if bias else None
    x = torch.randn(rows, 160, dtype=torch.bfloat16)
    got = amx_linear.linear(x, amx_linear.pack(w), b)
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
    assert_rounded_once(got, reference(x, w, b))


def test_rows_of_a_wider_tensor_and_leading_dims():
    torch.manual_seed(0)
    w = amx_linear.pack(torch.randn(32, 64, dtype=torch.bfloat16))
    wide = torch.randn(20, 128, dtype=torch.bfloat16)
    x = wide[:, 32:96]  # rows 128 elements apart
    assert x.stride(0) == 128
    assert torch.equal(amx_linear.linear(x, w, None), amx_linear.linear(x.contiguous(), w, None))
    x3 = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    assert torch.equal(amx_linear.linear(x3, w, None), amx_linear.linear(x3.reshape(10, 64), w, None).view(2, 5, 32))
    assert amx_linear.linear(torch.empty(0, 64, dtype=torch.bfloat16), w, None).shape == (0, 32)


@pytest.mark.parametrize("cols", [16, 32, 4096])
def test_the_same_bits_at_any_thread_count(cols):
    """Threads split columns (or rows, with fewer column blocks than threads); a tile's sums are in
    one order whoever computes it."""
    torch.manual_seed(cols)
    w = amx_linear.pack(torch.randn(cols, 64, dtype=torch.bfloat16))
    x = torch.randn(200, 64, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(amx_linear.linear(x, w, None))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_shapes_it_does_not_take_are_refused():
    with pytest.raises(ValueError, match="cannot pack"):
        amx_linear.pack(torch.randn(24, 64, dtype=torch.bfloat16))  # 24 rows: not whole tiles
    with pytest.raises(ValueError, match="cannot pack"):
        amx_linear.pack(torch.randn(32, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cannot pack"):
        amx_linear.pack(torch.randn(32, 64))  # float32
    with pytest.raises(ValueError, match="takes bfloat16"):
        amx_linear.linear(torch.randn(2, 64), amx_linear.pack(torch.randn(32, 64, dtype=torch.bfloat16)), None)


def test_packed_linear_takes_the_kernel_where_it_fits(monkeypatch):
    from engine.models.packed_linear import PackedLinear

    torch.manual_seed(0)
    fits = PackedLinear(nn.Linear(64, 96, bias=True).to(torch.bfloat16), parts=(32, 64))
    odd = PackedLinear(nn.Linear(64, 40).to(torch.bfloat16))  # 40 outputs: oneDNN
    assert fits.amx and not odd.amx and "kernel=amx" in repr(fits)
    monkeypatch.setenv(amx_linear.ENV, "0")
    assert not PackedLinear(nn.Linear(64, 96).to(torch.bfloat16)).amx
    monkeypatch.setenv(amx_linear.ENV, "yes")
    with pytest.raises(ValueError, match="KVTIER_AMX_LINEAR must be 0"):
        PackedLinear(nn.Linear(64, 96).to(torch.bfloat16))


def test_the_engine_runs_a_bfloat16_model_on_it(ckpt_dir):
    """The engine packs a bfloat16 checkpoint's linears for the kernel, and its first token's
    logits stay within bfloat16 noise of the oneDNN-packed model's (same checkpoint, same prompt)."""
    from engine import LLM, SamplingParams

    prompt = [{"prompt_token_ids": list(range(5, 40))}]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    got = {}
    for env in ("1", "0"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(amx_linear.ENV, env)
            with LLM(model=str(ckpt_dir("llama")), dtype="bfloat16", num_gpu_blocks=32, optimization_level=0) as llm:
                kinds = {m.amx for m in llm.engine.runner.model.modules() if hasattr(m, "amx")}
                assert kinds == {env == "1"}
                out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
                got[env] = out.logprobs[0]
    amx, dnn = got["1"], got["0"]
    shared = set(amx) & set(dnn)
    assert len(shared) >= 4
    assert max(abs(amx[t] - dnn[t]) for t in shared) < 0.1


@pytest.mark.parametrize("rows", [1, 17, 64, 300])
def test_silu_mul_matches_a_float_reference(rows):
    """The gated MLP's activation in one pass: silu(x Wg^T) * (x Wu^T) from float32 products,
    rounded once, against float64 (bfloat16's step plus the float32 exponential's error)."""
    torch.manual_seed(rows)
    wg, wu = (torch.randn(64, 96, dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    got = amx_linear.silu_mul(x, amx_linear.pack(wg), amx_linear.pack(wu))
    g, u = reference(x, wg, None).double(), reference(x, wu, None).double()
    want = (torch.nn.functional.silu(g) * u).float()
    assert got.shape == (rows, 64)
    assert_rounded_once(got, want)


def test_a_gated_mlp_takes_the_fused_path_and_keeps_its_result():
    from engine.models.packed_linear import PackedLinear

    torch.manual_seed(0)
    lin = nn.Linear(96, 128, bias=False).to(torch.bfloat16)
    fused = PackedLinear(lin, parts=(64, 64))
    assert fused.fuses_silu_mul
    x = torch.randn(9, 96, dtype=torch.bfloat16)
    gate, up = fused.forward_parts(x)
    unfused = torch.nn.functional.silu(gate.float()) * up.float()  # from bf16-rounded gate and up
    torch.testing.assert_close(fused.silu_mul(x).float(), unfused, rtol=2e-2, atol=2e-2)
    assert torch.equal(torch.compile(fused.silu_mul, fullgraph=True)(x), fused.silu_mul(x))
    for other in (PackedLinear(nn.Linear(96, 128, bias=True).to(torch.bfloat16), parts=(64, 64)),
                  PackedLinear(lin, parts=(32, 96)), PackedLinear(lin)):
        assert not other.fuses_silu_mul
        with pytest.raises(RuntimeError, match="does not fuse"):
            other.silu_mul(x)
