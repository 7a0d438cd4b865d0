"""Issue 11, finding 3, end to end: a fine-tuned copy of a model (layer 0's attention changed,
everything else byte-identical) is never served the base model's G3 entries and never writes
into the base model's namespace.

Layer 0's q_proj and v_proj are changed; k_proj is left alone because, in this small checkpoint,
it lies inside one of the 64 KiB samples the old fingerprint read, and the test is meant to
reproduce the finding (the old sampled fingerprint gave both models one namespace).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from offload_helpers import check_integrity, hit_tokens, load_kinds, offload_llm, reference, run, tokens, workload

PROMPTS = workload()


@pytest.fixture(scope="module")
def finetuned(model_dir, tmp_path_factory) -> Path:
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("finetuned") / "qwen3-ft"
    shutil.copytree(model_dir, out)
    f = out / "model.safetensors"
    weights = load_file(str(f))
    g = torch.Generator().manual_seed(11)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"):
        w = weights[name]
        weights[name] = w + 0.05 * torch.randn(w.shape, generator=g, dtype=w.dtype)
    save_file(weights, str(f), metadata={"format": "pt"})
    return out


def test_finetuned_copy_is_not_served_the_base_models_g3_entries(model_dir, finetuned, tmp_path):
    base_ref, ft_ref = reference(model_dir, PROMPTS), reference(finetuned, PROMPTS)
    assert base_ref != ft_ref, "control: the fine-tune must change the answers"
    disk = tmp_path / "g3"
    base = offload_llm(model_dir, kv_offload_disk=str(disk))
    try:
        assert tokens(run(base, PROMPTS)) == base_ref
    finally:
        base.close()
    (base_ns,) = [d for d in disk.iterdir() if d.is_dir()]
    base_files = {p: p.read_bytes() for p in base_ns.rglob("*.kvb")}
    assert base_files

    ft = offload_llm(finetuned, kv_offload_disk=str(disk))
    try:
        outs = run(ft, PROMPTS)
        assert load_kinds(outs) == [{}, {}, {}], "served another model's KV"
        assert tokens(outs) == ft_ref
        assert ft.get_stats().tiers["G3"]["hit_tokens"] == 0
        ft.engine.connector.flush()
        check_integrity(ft)
    finally:
        ft.close()
    namespaces = sorted(d for d in disk.iterdir() if d.is_dir())
    assert len(namespaces) == 2, "the fine-tune must write into a namespace of its own"
    assert {p: p.read_bytes() for p in base_ns.rglob("*.kvb")} == base_files, "base namespace was written to"

    # each model is still served its own entries
    for model, ref in ((model_dir, base_ref), (finetuned, ft_ref)):
        llm = offload_llm(model, kv_offload_disk=str(disk))
        try:
            outs = run(llm, PROMPTS)
            assert tokens(outs) == ref
            assert load_kinds(outs) == [{"G3": hit_tokens(len(p))} for p in PROMPTS]
        finally:
            llm.close()


def test_shared_kv_namespace_shares_entries_by_the_operators_choice(model_dir, tmp_path):
    """An explicit kv_namespace replaces the weights' identity: two engines that name it alike
    share G3 (here the same weights, so the answers stay right), and it is another directory
    than the computed namespace."""
    disk = tmp_path / "g3"
    ref = reference(model_dir, PROMPTS)
    for expect_hits in (False, True):
        llm = offload_llm(model_dir, kv_offload_disk=str(disk), kv_namespace="qwen3-test-v1")
        try:
            outs = run(llm, PROMPTS)
            assert tokens(outs) == ref
            assert load_kinds(outs) == ([{"G3": hit_tokens(len(p))} for p in PROMPTS] if expect_hits else [{}] * 3)
        finally:
            llm.close()
    llm = offload_llm(model_dir, kv_offload_disk=str(disk))  # computed namespace: nothing there yet
    try:
        assert load_kinds(run(llm, PROMPTS)) == [{}] * 3
    finally:
        llm.close()
    assert len([d for d in disk.iterdir() if d.is_dir()]) == 2
