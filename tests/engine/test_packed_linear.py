"""CPU linears prepacked into oneDNN's layout (engine/models/packed_linear.py): the same maths as
nn.Linear up to summation order. Token-level exactness against transformers is the parity suite's
job (test_parity.py runs on the packed model)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.models.packed_linear import PackedLinear, pack_linears, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch has no oneDNN linear")
# bfloat16 packing needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere the loader keeps plain linears.
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not packing_available(torch.bfloat16),
                                                              reason="oneDNN cannot pack bfloat16 on this CPU"))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), pytest.param(
    torch.bfloat16, 1e-2, marks=BF16.marks)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_nn_linear(dtype, tol, bias, rows):
    torch.manual_seed(rows)
    lin = nn.Linear(96, 160, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    want = lin(x)
    got = PackedLinear(lin)(x)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_pack_linears_replaces_every_linear_and_keeps_tied_embeddings():
    torch.manual_seed(0)
    emb = nn.Embedding(50, 16)
    model = nn.ModuleDict({"emb": emb, "a": nn.Linear(16, 32), "b": nn.Sequential(nn.Linear(32, 16)),
                           "head": nn.Linear(16, 50, bias=False)})
    model["head"].weight = emb.weight  # tied, as in SmolLM
    x = torch.randn(3, 16)
    want = model["head"](model["b"](model["a"](x)))
    assert pack_linears(model) == 3
    assert not [m for m in model.modules() if type(m) is nn.Linear]
    torch.testing.assert_close(model["head"](model["b"](model["a"](x))), want, rtol=1e-5, atol=1e-5)
    assert model["emb"].weight is emb.weight  # the embedding still has its plain weight


def test_the_engine_packs_its_cpu_model(ckpt_dir):
    from engine import LLM

    llm = LLM(model=str(ckpt_dir("llama")), dtype="float32", num_gpu_blocks=32)
    linears = [type(m).__name__ for m in llm.engine.runner.model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert linears and set(linears) == {"PackedLinear"}
    llm.close()


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("bias", [False, True])
def test_parts_are_the_fused_outputs_bit_for_bit(dtype, bias):
    torch.manual_seed(1)
    lin = nn.Linear(64, 96, bias=bias).to(dtype)
    x = torch.randn(300, 64, dtype=dtype)
    fused = PackedLinear(lin)(x)
    split = PackedLinear(lin, parts=(32, 48, 16))
    got = split.forward_parts(x)
    assert [t.shape[-1] for t in got] == [32, 48, 16] and all(t.is_contiguous() for t in got)
    assert all(torch.equal(a, b) for a, b in zip(got, fused.split([32, 48, 16], dim=-1)))
    assert torch.equal(split(x), fused)


def test_parts_that_do_not_add_up_are_refused():
    with pytest.raises(ValueError, match="do not split 96"):
        PackedLinear(nn.Linear(64, 96), parts=(32, 32))


def test_the_engine_packs_gate_and_up_apart(ckpt_dir):
    from engine import LLM

    llm = LLM(model=str(ckpt_dir("llama")), dtype="float32", num_gpu_blocks=32)
    mlp = llm.engine.runner.model.layers[0].mlp
    half = mlp.gate_up_proj.out_features // 2
    assert mlp.gate_up_proj.parts == (half, half)
    llm.close()


def test_a_dtype_oneDNN_cannot_pack_leaves_the_linears_plain(ckpt_dir, monkeypatch):
    """On an AVX2-only CPU bfloat16 packing raises; the model must load with plain linears."""
    from engine import LLM, SamplingParams
    from engine.models import packed_linear

    monkeypatch.setitem(packed_linear._SUPPORTED, torch.float32, False)
    with LLM(model=str(ckpt_dir("llama")), dtype="float32", num_gpu_blocks=32, optimization_level=0) as llm:
        assert not any(isinstance(m, PackedLinear) for m in llm.engine.runner.model.modules())
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2, temperature=0),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
