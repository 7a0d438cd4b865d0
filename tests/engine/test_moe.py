"""Issue 16: Qwen3-MoE. The grouped expert op against a token-by-token reference, and both
checkpoint layouts (per-expert names, as transformers saves them, and the fused 3D tensors
transformers 5 uses in memory) loading to the same model. Parity with transformers for the whole
model is test_parity.py's `qwen3_moe` kind (eager and compiled, prompts up to 1030 tokens)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import random_prompt


def _reference(x, ids, weights, gate_up, down):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_grouped_experts_equal_a_token_by_token_loop(tokens):
    import engine.models.moe  # noqa: F401 - registers kvtier::moe_experts

    g = torch.Generator().manual_seed(tokens)
    experts, k, hidden, inter = 6, 2, 16, 24
    x = torch.randn(tokens, hidden, generator=g)
    # Expert 5 never chosen: the op must skip experts without tokens.
    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g)
    down = torch.randn(experts, hidden, inter, generator=g)
    got = torch.ops.kvtier.moe_experts(x, ids, weights, gate_up, down, False)
    torch.testing.assert_close(got, _reference(x, ids, weights, gate_up, down), rtol=1e-5, atol=1e-4)


def _rewrite(src, dst, tensors: dict[str, torch.Tensor]):
    """A copy of checkpoint `src` at `dst` with these weights."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_fused_expert_tensors_load_like_per_expert_names(ckpt_dir, tmp_path):
    from engine import LLM, SamplingParams
    from engine.models.moe import Experts
    from engine.models.packed_linear import packing_available

    src = ckpt_dir("qwen3_moe")
    tensors = load_file(src / "model.safetensors")
    fused: dict[str, torch.Tensor] = {}
    layer0 = "model.layers.0.mlp.experts"
    per = {k: v for k, v in tensors.items() if k.startswith(layer0 + ".")}
    n = len(per) // 3
    fused[f"{layer0}.gate_up_proj"] = torch.stack(
        [torch.cat([per[f"{layer0}.{e}.gate_proj.weight"], per[f"{layer0}.{e}.up_proj.weight"]]) for e in range(n)])
    fused[f"{layer0}.down_proj"] = torch.stack([per[f"{layer0}.{e}.down_proj.weight"] for e in range(n)])
    dst = _rewrite(src, tmp_path / "fused", {**{k: v for k, v in tensors.items() if k not in per}, **fused})
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": random_prompt(n, 40 + n)} for n in (5, 70)]
    outs = []
    for d in (src, dst):
        llm = LLM(str(d), dtype="float32", num_gpu_blocks=64)
        outs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)])
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]
        assert len(experts) == 1  # layer 1 is dense (mlp_only_layers)
        assert (experts[0].key is not None) == packing_available()  # the packed path is what ran
    assert outs[0] == outs[1]


def test_a_checkpoint_missing_an_expert_is_refused(ckpt_dir, tmp_path):
    from engine import LLM

    src = ckpt_dir("qwen3_moe")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.2.up_proj.weight"]
    dst = _rewrite(src, tmp_path / "partial", tensors)
    with pytest.raises(ValueError, match="missing weights.*experts.gate_up_proj"):
        LLM(str(dst), dtype="float32", num_gpu_blocks=64)
