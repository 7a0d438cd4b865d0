"""--kv-cache-dtype (issue 17): G1 stores K and V in another dtype than the weights'.

Oracles: dense float32 attention over the rounded keys and values (each backend); transformers
whose attention sees its K/V rounded to the same dtype (the engine's logits and greedy tokens; its
distance to plain float32 transformers shows the rounding is real); and the offload tiers: a block
written with one KV dtype is never served to an engine with the other, while hidden states (kept
in the weights' dtype) come back from G2 and G3 bit for bit.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import LAYERS, hf_greedy, hf_last_logits, load_hf, random_prompt
from connectors.hidden_spec import speculative_config
from engine import LLM, SamplingParams, cpu_kernels
from engine.runner.attention import AttentionMetadata, DecodeGroup, PrefillSeq, TorchPagedAttention
from engine.runner.attention_cpu import CpuPagedAttention
from engine.config import EngineConfig
from engine.model_config import load_model_config
from engine.spec.draft_proposer import draft_model_config
from engine.kernels.reference import attend_ref
from engine.runner.model_runner import kv_cache_bytes_per_block

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
BS, KVH, HEADS, D = 16, 2, 6, 64


def mixed_step(seed: int, head_dim: int = D):
    """A step with a chunk after cached context, a fresh prompt and two decodes: its metadata,
    each row span's (first row, rows, context length, blocks), and float32 q/k/v."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(5, 40, [10, 3, 7]), (30, 30, [30, 31])]  # (query_len, context_len, blocks)
    decodes = [(9, [40]), (33, [50, 51, 52])]
    prefills, slots, spans, start = [], [], [], 0
    for qlen, ctx, blocks in seqs:
        run = blocks[0] if blocks == list(range(blocks[0], blocks[0] + len(blocks))) else None
        prefills.append(PrefillSeq(start, qlen, ctx, torch.tensor(blocks), run))
        slots += [blocks[p // BS] * BS + p % BS for p in range(ctx - qlen, ctx)]
        spans.append((start, qlen, ctx, blocks))
        start += qlen
    rows = list(range(start, start + len(decodes)))
    slots += [t[(n - 1) // BS] * BS + (n - 1) % BS for n, t in decodes]
    spans += [(r, 1, n, t) for r, (n, t) in zip(rows, decodes)]
    width = max(len(t) for _, t in decodes)
    tables = torch.tensor([t + [0] * (width - len(t)) for _, t in decodes])
    lens = torch.tensor([n for n, _ in decodes])
    mask = (torch.arange(width * BS)[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(torch.tensor(slots), prefills, [DecodeGroup(torch.tensor(rows), tables, lens, mask)])
    total = start + len(decodes)
    q, k, v = (torch.randn(total, h, head_dim, generator=g) for h in (HEADS, KVH, KVH))
    context = torch.randn(2, 64, BS, KVH, head_dim, generator=g)
    return meta, spans, q, k, v, context


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_backend_attends_in_float32_over_the_rounded_kv(backend, cache_dtype):
    """float32 q/k/v over a 16-bit cache: the step's K/V are stored rounded, the output is
    float32 and equals dense float32 attention over the cache's (rounded) values. The CPU kernels
    read a bfloat16 cache in place; a float16 one goes through the torch path."""
    if backend == "cpu" and cpu_kernels.get() is None:
        pytest.skip("the CPU kernels did not build here")
    meta, spans, q, k, v, context = mixed_step(31)
    k_cache, v_cache = (c.to(cache_dtype) for c in context)
    impl = TorchPagedAttention() if backend == "torch" else CpuPagedAttention()
    out = impl.forward(q, k, v, k_cache, v_cache, meta, 0.125).view_as(q)
    assert out.dtype == torch.float32 and k_cache.dtype == cache_dtype
    flat_k, flat_v = k_cache.view(-1, KVH, D), v_cache.view(-1, KVH, D)
    assert torch.equal(flat_k[meta.slot_mapping], k.to(cache_dtype))  # stored rounded, at their slots
    assert torch.equal(flat_v[meta.slot_mapping], v.to(cache_dtype))
    ref = torch.empty_like(q)
    for start, qlen, ctx, blocks in spans:
        kk, vv = (c[torch.tensor(blocks)].flatten(0, 1)[:ctx].float() for c in (k_cache, v_cache))
        ref[start:start + qlen] = attend_ref(q[start:start + qlen], kk, vv, torch.arange(ctx - qlen, ctx), 0.125)
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err <= 2e-6, err


def test_cache_sizes_and_offload_identity_follow_the_kv_dtype(ckpt_dir):
    model = ckpt_dir("llama")
    f32 = load_model_config(model, "float32")
    bf16 = load_model_config(model, "float32", kv_cache_dtype="bfloat16")
    assert (f32.kv_dtype, bf16.kv_dtype, bf16.dtype) == (torch.float32, torch.bfloat16, torch.float32)
    assert kv_cache_bytes_per_block(bf16, 16) * 2 == kv_cache_bytes_per_block(f32, 16)
    assert draft_model_config(model, "float32", "cpu", bf16).kv_dtype == torch.bfloat16  # a draft's KV too
    # Exported hidden states stay float32: only the KV part of a block halves.
    hidden = 16 * 2 * f32.hidden_size * 4
    assert kv_cache_bytes_per_block(bf16, 16, 2) - hidden == kv_cache_bytes_per_block(bf16, 16)
    # The KV dtype is part of what G3/G4 entries are namespaced by; "auto", or the weights' own
    # dtype, leaves the namespace as it was.
    assert "kv_dtype" not in f32.fingerprint() and bf16.fingerprint()["kv_dtype"] == "torch.bfloat16"
    assert load_model_config(model, "bfloat16", kv_cache_dtype="bfloat16").fingerprint() == \
        load_model_config(model, "bfloat16").fingerprint()
    for bad in ("fp8_inc", "int8", "float64"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype '{bad}' is not supported"):
            EngineConfig(model=str(model), kv_cache_dtype=bad)


@pytest.fixture(scope="module")
def rounded_attention():
    """Registers transformers attention functions that round K/V to a dtype and back before
    SDPA: what the engine's cache does. Returns the implementation name for a dtype name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for name, dt in DTYPES.items():
        def rounded(module, q, k, v, *args, _dt=dt, **kwargs):
            return sdpa_attention_forward(module, q, k.to(_dt).to(k.dtype), v.to(_dt).to(v.dtype), *args, **kwargs)
        AttentionInterface.register(f"kvtier_kv_{name}", rounded)
    return lambda name: f"kvtier_kv_{name}"


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_engine_equals_transformers_with_the_same_kv_rounding(ckpt_dir, rounded_attention, kv_dtype):
    """float32 weights, a 16-bit KV cache: next-token logits are transformers' with K/V rounded
    alike (10x closer to them than rounding moves them from plain float32), and greedy tokens
    equal that oracle's."""
    from transformers import AutoModelForCausalLM

    model = ckpt_dir("llama")
    prompts = [random_prompt(n, 7300 + n) for n in (5, 40, 100)]
    oracle = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32,
                                                  attn_implementation=rounded_attention(kv_dtype)).eval()
    plain = load_hf(model)
    with LLM(str(model), dtype="float32", kv_cache_dtype=kv_dtype, num_gpu_blocks=64) as llm:
        assert llm.engine.runner.kv_cache.dtype == DTYPES[kv_dtype]
        logits = llm.next_token_logits([{"prompt_token_ids": p} for p in prompts])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, got, out in zip(prompts, logits, outs):
        want, f32 = hf_last_logits(oracle, p), hf_last_logits(plain, p)
        scale = want.abs().max()
        rounding = ((want - f32).abs().max() / scale).item()
        assert rounding > 1e-4, rounding  # the rounding moves the logits: the oracle can tell
        assert ((got - want).abs().max() / scale).item() <= 0.1 * rounding
        assert out.outputs[0].token_ids == list(hf_greedy(oracle, p, 16))


def test_offload_tiers_keep_kv_dtypes_apart(ckpt_dir, tmp_path):
    """A bfloat16-KV engine exporting hidden states: its prompt's KV comes back from G2 and, in a
    new engine, from G3 with the same (float32) hidden states; an engine with float32 KV on the
    same G3 directory finds none of it."""
    model, ids, out = ckpt_dir("llama"), [0, 1, LAYERS], tmp_path / "hs"
    prompt = random_prompt(300, 7400)
    g3 = str(tmp_path / "g3")

    def engine(kv_dtype: str, **kw) -> LLM:
        tc = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "TieredOffloadConnector"},
            {"kv_connector": "HiddenStatesConnector", "kv_connector_extra_config": {"shared_storage_path": str(out)}}]}}
        return LLM(str(model), dtype="float32", kv_cache_dtype=kv_dtype, num_gpu_blocks=200, kv_offload_disk=g3,
                   kv_transfer_config=tc, speculative_config=speculative_config(ids), **kw)

    def prefill(llm: LLM, name: str) -> tuple[dict, torch.Tensor, list[int]]:
        (o,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                            use_tqdm=False, request_ids=[name])
        return o.cached_tokens_by_tier, load_file(out / f"{name}.safetensors")["hidden_states"], o.outputs[0].token_ids

    with engine("bfloat16", kv_offloading_size=0.05) as llm:
        tiers, fresh, tokens = prefill(llm, "fresh")
        assert not tiers and fresh.dtype == torch.float32
        llm.engine.flush_offload()
        llm.engine.pool.reset_prefix_cache()
        tiers, states, again = prefill(llm, "g2")
        assert tiers.get("G2", 0) >= 256, tiers
        assert torch.equal(states, fresh) and again == tokens
    with engine("auto") as llm:
        tiers, _, _ = prefill(llm, "other-dtype")
        assert not tiers, f"float32 KV was served bfloat16 entries: {tiers}"
    with engine("bfloat16") as llm:
        tiers, states, again = prefill(llm, "g3")
        assert tiers.get("G3", 0) >= 256, tiers
        assert torch.equal(states, fresh) and again == tokens
