"""fp8 KV caches (--kv-cache-dtype fp8, fp8_e4m3, fp8_e5m2; issue 44).

Oracles: dense float32 attention over the dequantized cache (each backend, each format, both q
dtypes, a head size the vector path takes and one it does not); transformers whose attention
sees K and V quantized with the engine's scales and dequantized (logits and greedy tokens); the
same engine with its prefix cache, G2 and G3 off vs on; and the offload tiers, which never serve
fp8 entries to an engine with other KV bytes (another format, other scales, the weights' dtype).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import hf_greedy, hf_last_logits, load_hf, random_prompt
from test_kv_cache_dtype import HEADS, KVH, mixed_step
from engine import LLM, SamplingParams, cpu_kernels
from engine.config import EngineConfig
from engine.kernels.reference import attend_ref
from engine.model_config import KVScale, load_model_config
from engine.runner.attention import TorchPagedAttention, quantize
from engine.runner.attention_cpu import CpuPagedAttention
from engine.runner.kv_quant import HEADROOM, power_of_two_scale
from engine.runner.model_runner import kv_cache_bytes_per_block

FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def dequantized(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return cache.float() * scale


@pytest.mark.parametrize("head_dim", [64, 24])  # the CPU kernels' vector path; their scalar one
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_backends_attend_over_the_dequantized_cache(backend, fmt, q_dtype, head_dim):
    """A step of prompt chunks and decodes over an fp8 cache with scales: the step's K/V are
    stored as quantize(x / scale), and the output is dense float32 attention over the cache's
    values times their scales (the CPU kernels widen the bytes in registers)."""
    if backend == "cpu" and cpu_kernels.get() is None:
        pytest.skip("the CPU kernels did not build here")
    dt, ks = FORMATS[fmt], KVScale(0.25, 2.0)
    meta, spans, q, k, v, context = mixed_step(41, head_dim)
    q, k, v = q.to(q_dtype), k.to(q_dtype), v.to(q_dtype)
    k_cache, v_cache = (context[0] / ks.k).to(dt), (context[1] / ks.v).to(dt)
    impl = TorchPagedAttention() if backend == "torch" else CpuPagedAttention()
    out = impl.forward(q, k, v, k_cache, v_cache, meta, 0.125, 0, ks).view_as(q)
    assert out.dtype == q_dtype and k_cache.dtype == dt
    stored_k = k_cache.view(-1, KVH, head_dim).view(torch.uint8)[meta.slot_mapping]
    assert torch.equal(stored_k, quantize(k, dt, ks.k))  # stored quantized, at their slots
    ref = torch.empty(q.shape)
    for start, qlen, ctx, blocks in spans:
        kk = dequantized(k_cache[torch.tensor(blocks)].flatten(0, 1)[:ctx], ks.k)
        vv = dequantized(v_cache[torch.tensor(blocks)].flatten(0, 1)[:ctx], ks.v)
        ref[start:start + qlen] = attend_ref(q[start:start + qlen].float(), kk, vv, torch.arange(ctx - qlen, ctx), 0.125)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err <= (2e-6 if q_dtype == torch.float32 else 1e-2), err
    assert q.shape[1] == HEADS


@pytest.mark.parametrize("head_dim", [64, 24])
@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_kernels_read_every_byte_value_as_torch_does(fmt, head_dim):
    """Values over all 256 bytes of a format (NaN codes, e5m2's infinities and subnormals
    included), uniform attention weights (K all zero): decode and prefill outputs are the mean of
    torch's widened values, NaN where a NaN (or inf - inf) is among them."""
    if cpu_kernels.get() is None:
        pytest.skip("the CPU kernels did not build here")
    dt, n, bs = FORMATS[fmt], -(-256 // head_dim), 16  # n tokens hold every code
    nb = -(-n // bs)
    codes = torch.zeros(nb * bs * head_dim, dtype=torch.uint8)
    codes[:n * head_dim] = torch.arange(n * head_dim) % 256
    v_cache = codes.view(dt).view(nb, bs, 1, head_dim)
    k_cache = torch.zeros_like(v_cache)
    q = torch.randn(1, 1, head_dim)
    want = v_cache.flatten(0, 1)[:n].float().mean(0)  # [1, head_dim]
    table = torch.arange(nb)
    decode, prefill = torch.empty_like(q), torch.empty_like(q)
    cpu_kernels.paged_attention(q, k_cache, v_cache, decode, torch.arange(1), table.view(1, nb), torch.tensor([n]), 0.125)
    cpu_kernels.prefill_attention(q, k_cache, v_cache, prefill, torch.tensor([[0, 1, n, 0]]), table, 0.125)
    assert want.isnan().any()
    for got in (decode, prefill):
        torch.testing.assert_close(got[0], want, rtol=1e-6, atol=0, equal_nan=True)


def test_quantize_saturates_and_keeps_nan():
    x = torch.tensor([1e6, -1e6, 3.0, float("nan")])
    for dt in FORMATS.values():
        got = quantize(x, dt, 1.0).view(dt).float()
        big = torch.finfo(dt).max
        assert got[:3].tolist() == [big, -big, 3.0] and math.isnan(got[3])


def test_scales_are_powers_of_two_with_headroom():
    for dt in FORMATS.values():
        big = torch.finfo(dt).max
        for amax in (1e-3, 0.7, 28.0, 5000.0):
            s = power_of_two_scale(amax, dt)
            assert math.log2(s).is_integer() and amax * HEADROOM / s <= big < 2 * amax * HEADROOM / s
    assert power_of_two_scale(0.0, torch.float8_e4m3fn) == 1.0


@pytest.fixture(scope="module")
def quantized_attention():
    """transformers attention that quantizes K and V with given per-layer scales and
    dequantizes them before SDPA: what an fp8 cache does. Returns a registrar."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def register(name: str, dt: torch.dtype, scales: tuple[KVScale, ...]) -> str:
        def attend(module, q, k, v, *args, **kwargs):
            s = scales[module.layer_idx]
            kq = quantize(k, dt, s.k).view(dt).to(k.dtype) * s.k
            vq = quantize(v, dt, s.v).view(dt).to(v.dtype) * s.v
            return sdpa_attention_forward(module, q, kq, vq, *args, **kwargs)
        AttentionInterface.register(name, attend)
        AttentionMaskInterface.register(name, sdpa_mask)  # sliding windows: SDPA's masks, as "sdpa" gets
        return name
    return register


@pytest.mark.parametrize("kind,fmt", [("llama", "fp8_e4m3"), ("qwen3", "fp8_e5m2"), ("gemma4", "fp8_e4m3")])
def test_engine_equals_transformers_with_the_same_quantization(ckpt_dir, quantized_attention, kind, fmt):
    """float32 weights, an fp8 cache: next-token logits are transformers' with K/V quantized
    alike (10x closer to them than quantization moves them from plain float32), and greedy
    tokens equal that oracle's. Gemma 4's layers that reuse an earlier layer's KV use its scales."""
    from transformers import AutoModelForCausalLM

    model = ckpt_dir(kind)
    prompts = [random_prompt(n, 7500 + n) for n in (5, 40, 100)]
    with LLM(str(model), dtype="float32", kv_cache_dtype=fmt, num_gpu_blocks=64) as llm:
        assert llm.engine.runner.kv_cache.dtype == FORMATS[fmt]
        scales = llm.engine.model_config.kv_scales
        logits = llm.next_token_logits([{"prompt_token_ids": p} for p in prompts])
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    cfg = load_model_config(model, "float32")
    assert len(scales) == cfg.num_layers and all(scales[i] == scales[cfg.kv_source(i)] for i in range(cfg.num_layers))
    oracle = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation=quantized_attention(f"kvtier_{kind}_{fmt}", FORMATS[fmt], scales)).eval()
    plain = load_hf(model)
    for p, got, out in zip(prompts, logits, outs):
        want, f32 = hf_last_logits(oracle, p), hf_last_logits(plain, p)
        scale = want.abs().max()
        moved = ((want - f32).abs().max() / scale).item()
        assert moved > 1e-3, moved  # quantization moves the logits: the oracle can tell
        assert ((got - want).abs().max() / scale).item() <= 0.1 * moved
        assert out.outputs[0].token_ids == list(hf_greedy(oracle, p, GREEDY.max_tokens))


@pytest.mark.parametrize("kind", ["llama", "gemma3", "gemma4", "qwen3_moe", "mistral_swa"])
def test_long_prompts_stay_finite(ckpt_dir, kind):
    """No NaN or inf from either format on any kind, prompts up to 1,500 tokens (sliding
    windows, shared KV and MoE included)."""
    prompts = [random_prompt(1500, 7600), random_prompt(300, 7601)]
    for fmt in FORMATS:
        with LLM(str(ckpt_dir(kind)), dtype="float32", kv_cache_dtype=fmt, num_gpu_blocks=400) as llm:
            logits = llm.next_token_logits([{"prompt_token_ids": p} for p in prompts])
        assert all(torch.isfinite(x).all() for x in logits), (kind, fmt)


def test_checkpoint_scales_are_read_and_calibration_is_stable(ckpt_dir, tmp_path):
    """A checkpoint's k_scale/v_scale are the layers' scales (and ignored by an engine without
    fp8 KV); without them the calibrated scales are the same in every engine, and they, like the
    format, are part of the fingerprint the offload tiers are namespaced by."""
    src = ckpt_dir("llama")
    model = tmp_path / "scaled"
    shutil.copytree(src, model)
    given = {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(s) for i, (ks, vs) in enumerate([(0.5, 0.25), (2.0, 1.5)])
             for kv, s in (("k", ks), ("v", vs))}
    save_file(given, str(model / "kv_scales.safetensors"))
    with LLM(str(model), dtype="float32", kv_cache_dtype="fp8", num_gpu_blocks=32) as llm:
        assert llm.engine.model_config.kv_scales == (KVScale(0.5, 0.25), KVScale(2.0, 1.5))
        scaled = llm.generate([{"prompt_token_ids": random_prompt(20, 1)}], GREEDY, use_tqdm=False)
    with LLM(str(model), dtype="float32", num_gpu_blocks=32) as llm:  # not weights: skipped
        assert llm.engine.model_config.kv_scales == ()
        llm.generate([{"prompt_token_ids": random_prompt(20, 1)}], GREEDY, use_tqdm=False)
    assert scaled[0].outputs[0].token_ids
    save_file({k: v for k, v in given.items() if "layers.1.self_attn.v" not in k}, str(model / "kv_scales.safetensors"))
    with pytest.raises(ValueError, match="missing layer 1 v_scale"):
        LLM(str(model), dtype="float32", kv_cache_dtype="fp8", num_gpu_blocks=32)

    def calibrated(fmt: str):
        with LLM(str(src), dtype="float32", kv_cache_dtype=fmt, num_gpu_blocks=32) as llm:
            return llm.engine.model_config
    first, again, e5 = calibrated("fp8_e4m3"), calibrated("fp8"), calibrated("fp8_e5m2")
    assert first.kv_scales == again.kv_scales and first.fingerprint() == again.fingerprint()
    assert all(math.log2(s.k).is_integer() and math.log2(s.v).is_integer() for s in first.kv_scales)
    assert first.fingerprint()["kv_scales"] and first.fingerprint() != e5.fingerprint()
    plain = load_model_config(src, "float32")
    assert kv_cache_bytes_per_block(first, 16) * 4 == kv_cache_bytes_per_block(plain, 16)  # a byte per value


# The ranks' partial sums are added in another order (1e-4 apart in float32 KV, test_tensor_parallel.py);
# a K or V that lands that close to the midpoint of two fp8 values rounds to the other one.
TP_LOGPROB_TOL = 2e-3


def lopsided(src, dst):
    """`src` with its second KV head's K and V 16x larger: one rank of two holds the largest values."""
    shutil.copytree(src, dst)
    dim = json.loads((dst / "config.json").read_text())["head_dim"]
    (f,) = dst.glob("*.safetensors")
    weights = load_file(str(f))
    for name, w in weights.items():
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            w[dim:2 * dim] *= 16
    save_file(weights, str(f), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("kind", ["llama", "gemma4"])  # gemma4: one global KV head on both ranks, shared KV
def test_two_ranks_with_fp8_give_one_ranks_scales_tokens_and_tier_hits(ckpt_dir, tmp_path, kind):
    """Two ranks calibrate together: each takes the max over both ranks' heads (llama's second KV
    head, rank 1's, is made 16x larger), so every rank's scales are one rank's, and greedy tokens
    and log-probs equal one rank's fp8 run; with G3 on, each rank's shard of the fp8 entries comes
    back in a new engine with the same tokens."""
    src = ckpt_dir(kind)
    model = str(lopsided(src, tmp_path / "lopsided") if kind == "llama" else src)
    g3 = tmp_path / "g3"
    prompts = [{"prompt_token_ids": random_prompt(n, 7800 + n)} for n in (40, 120)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    settings = {"dtype": "float32", "kv_cache_dtype": "fp8", "num_gpu_blocks": 64, "seed": 0}

    def run(**kw):
        with LLM(model, **settings, **kw) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            if kw.get("kv_offload_disk"):
                llm.engine.flush_offload()
            return llm.engine.model_config.kv_scales, [o.outputs[0] for o in outs], [o.cached_tokens_by_tier for o in outs]

    one_scales, one, _ = run()
    two_scales, two, _ = run(tensor_parallel_size=2, kv_offload_disk=str(g3))
    _, again, tiers = run(tensor_parallel_size=2, kv_offload_disk=str(g3))
    assert two_scales == one_scales
    recorded = [json.loads((d / "namespace.json").read_text()) for d in g3.iterdir()]
    assert sorted(r["tensor_parallel"]["rank"] for r in recorded) == [0, 1]
    assert all(r["fingerprint"]["kv_scales"] == [[s.k, s.v] for s in one_scales] for r in recorded), recorded
    for a, b, c in zip(one, two, again):
        assert a.token_ids == b.token_ids == c.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys() and max(abs(la[t] - lb[t]) for t in la) < TP_LOGPROB_TOL
    assert all(t.get("G3", 0) >= 32 for t in tiers), tiers


def test_prefix_hits_and_tiers_serve_fp8_exactly_and_never_across_kv_bytes(ckpt_dir, tmp_path):
    """An fp8 engine's prompt comes back from its prefix cache, from G2 and, in a new engine,
    from G3 with the fresh run's tokens; engines with model-dtype KV or the other format on the
    same G3 directory find none of it, and the fp8 engine finds none of theirs."""
    model, g3 = str(ckpt_dir("llama")), str(tmp_path / "g3")
    prompt = random_prompt(300, 7700)

    def run(llm: LLM, name: str) -> tuple[dict, list[int]]:
        (o,) = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, request_ids=[name])
        return o.cached_tokens_by_tier, list(o.outputs[0].token_ids)

    def engine(fmt: str, **kw) -> LLM:
        return LLM(model, dtype="float32", kv_cache_dtype=fmt, num_gpu_blocks=200, kv_offload_disk=g3, **kw)

    with engine("auto") as llm:  # model-dtype entries on the same directory first
        run(llm, "plain")
        llm.engine.flush_offload()
    with engine("fp8", kv_offloading_size=0.05) as llm:
        tiers, fresh = run(llm, "fresh")
        assert not tiers, f"fp8 KV was served another dtype's entries: {tiers}"
        tiers, again = run(llm, "g1")
        assert tiers.get("G1", 0) >= 256 and again == fresh, tiers
        llm.engine.flush_offload()
        llm.engine.pool.reset_prefix_cache()
        tiers, again = run(llm, "g2")
        assert tiers.get("G2", 0) >= 256 and again == fresh, tiers
    with engine("fp8_e5m2") as llm:
        tiers, _ = run(llm, "other-format")
        assert not tiers, f"e5m2 KV was served e4m3 entries: {tiers}"
    with engine("fp8") as llm:
        tiers, again = run(llm, "g3")
        assert tiers.get("G3", 0) >= 256 and again == fresh, tiers


def test_speculation_and_hidden_states_with_fp8(ckpt_dir, tmp_path):
    """ngram speculation over an fp8 cache gives the tokens of the same engine without it, and
    exported hidden states stay in the weights' dtype (the residual stream is never quantized)."""
    from connectors.hidden_spec import speculative_config

    model = str(ckpt_dir("llama"))
    prompts = [random_prompt(40, 7800) * 3, random_prompt(60, 7801)]  # repeats give ngram its proposals
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    outs = {}
    for name, kw in (("plain", {}), ("spec", {"speculative_config": spec})):
        with LLM(model, dtype="float32", kv_cache_dtype="fp8", num_gpu_blocks=64, **kw) as llm:
            outs[name] = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    assert outs["spec"] == outs["plain"]
    out = tmp_path / "hs"
    tc = {"kv_connector": "HiddenStatesConnector", "kv_connector_extra_config": {"shared_storage_path": str(out)}}
    with LLM(model, dtype="float32", kv_cache_dtype="fp8", num_gpu_blocks=64, kv_transfer_config=tc,
             speculative_config=speculative_config([0, 1])) as llm:
        llm.generate([{"prompt_token_ids": prompts[1]}], sp, use_tqdm=False, request_ids=["hs"])
    assert load_file(out / "hs.safetensors")["hidden_states"].dtype == torch.float32


def test_config_names_every_format():
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert EngineConfig(model="x", kv_cache_dtype=name).kv_cache_dtype == name


@pytest.mark.parametrize("offload_dtype", ["fp8", "bfloat16"])
def test_offload_dtype_hits_equal_an_engine_whose_prefix_kv_was_rounded_alike(ckpt_dir, tmp_path, offload_dtype):
    """--kv-offload-dtype: G1 stays float32 and the tiers hold narrower entries. A hit from G2 (and,
    in a new engine, from G3) gives the tokens and log-probs of an engine whose prefix KV was
    rounded the same way in G1 (the oracle: a plain engine's G1 put through the layout's
    encode/decode); an exact engine on the same G3 directory finds none of the narrow entries."""
    model, g3 = str(ckpt_dir("llama")), str(tmp_path / "g3")
    prompt = random_prompt(300, 7900)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)

    def run(llm: LLM) -> tuple[dict, list[int], list]:
        (o,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        c = o.outputs[0]
        return o.cached_tokens_by_tier, list(c.token_ids), [lp[t] for t, lp in zip(c.token_ids, c.logprobs)]

    with LLM(model, dtype="float32", num_gpu_blocks=200, kv_offloading_size=0.05, kv_offload_disk=g3,
             kv_offload_dtype=offload_dtype) as llm:
        layout = llm.engine.connector.layout
        assert llm.engine.runner.kv_cache.dtype == torch.float32 and layout.converts
        assert layout.dtype == {"fp8": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}[offload_dtype]
        assert bool(layout.kv_scales) == (offload_dtype == "fp8")
        run(llm)
        llm.engine.flush_offload()
        llm.engine.pool.reset_prefix_cache()
        tiers, tokens, lps = run(llm)
        assert tiers.get("G2", 0) >= 256, tiers
    with LLM(model, dtype="float32", num_gpu_blocks=200) as llm:  # the oracle
        run(llm)
        cache = llm.engine.runner.kv_cache
        cache.copy_(layout.decode(layout.encode(cache)))
        tiers, want, want_lps = run(llm)
        assert tiers.get("G1", 0) == 288, tiers  # the same prefix as the tier hit, rounded alike
    assert tokens == want and lps == want_lps
    with LLM(model, dtype="float32", num_gpu_blocks=200, kv_offload_disk=g3) as llm:
        tiers, _, _ = run(llm)
        assert not tiers, f"an exact engine was served {offload_dtype} entries: {tiers}"
    with LLM(model, dtype="float32", num_gpu_blocks=200, kv_offload_disk=g3, kv_offload_dtype=offload_dtype) as llm:
        tiers, again, again_lps = run(llm)
        assert tiers.get("G3", 0) >= 256 and again == want and again_lps == want_lps, tiers


def test_offload_dtype_under_two_ranks_gives_one_ranks_hits(ckpt_dir, tmp_path):
    """--kv-offload-dtype fp8 on two ranks: the ranks calibrate the tiers' scales together (the
    lopsided checkpoint's larger KV head is rank 1's), so each rank's shard is rounded as one
    rank rounds the whole block: G2 and, in a new engine, G3 hits give one rank's tokens."""
    model = str(lopsided(ckpt_dir("llama"), tmp_path / "lopsided"))
    prompt = {"prompt_token_ids": random_prompt(120, 7950)}
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def recorded(g3: str) -> list:
        return [json.loads((d / "namespace.json").read_text())["offload_kv_scales"] for d in Path(g3).iterdir()]

    def hits(g3: str, **kw):
        out = []
        for fresh in (True, False):
            with LLM(model, dtype="float32", num_gpu_blocks=64, seed=0, kv_offload_disk=g3, kv_offloading_size=0.05,
                     kv_offload_dtype="fp8", **kw) as llm:
                if fresh:
                    llm.generate([prompt], sp, use_tqdm=False)
                    llm.engine.flush_offload()
                    llm.engine.pool.reset_prefix_cache()
                (o,) = llm.generate([prompt], sp, use_tqdm=False)
                out.append((o.cached_tokens_by_tier, list(o.outputs[0].token_ids)))
        return out

    (g2_one, one), (g3_one, again_one) = hits(str(tmp_path / "one"))
    (g2_two, two), (g3_two, again_two) = hits(str(tmp_path / "two"), tensor_parallel_size=2)
    assert g2_one.get("G2", 0) >= 96 and g2_two.get("G2", 0) >= 96, (g2_one, g2_two)
    assert g3_one.get("G3", 0) >= 96 and g3_two.get("G3", 0) >= 96, (g3_one, g3_two)
    assert one == two == again_one == again_two
    (scales,) = recorded(str(tmp_path / "one"))
    assert recorded(str(tmp_path / "two")) == [scales, scales]  # each rank's, the layer's max over both


def test_offload_dtype_settings_are_checked(ckpt_dir):
    model = str(ckpt_dir("llama"))
    with pytest.raises(ValueError, match="needs an offload tier"):
        EngineConfig(model=model, kv_offload_dtype="fp8")
    with pytest.raises(ValueError, match="kv_offload_dtype 'int8' is not supported"):
        EngineConfig(model=model, kv_offload_dtype="int8", kv_offloading_size=1)
    with pytest.raises(ValueError, match="not narrower than G1's KV"):
        LLM(model, dtype="float32", kv_cache_dtype="float16", kv_offload_dtype="bfloat16", kv_offloading_size=0.01,
            num_gpu_blocks=32, kv_offload_block_size=16)
    hidden_only = {"kv_connector": "HiddenStatesConnector", "kv_connector_extra_config": {"shared_storage_path": "/x"}}
    with pytest.raises(ValueError, match="builds no offload tiers"):  # accepted and ignored otherwise
        LLM(model, dtype="float32", kv_offload_dtype="fp8", kv_transfer_config=hidden_only, num_gpu_blocks=32)
    with pytest.raises(ValueError, match="fp8_e5m2 is not narrower than G1's KV"):  # G1 fp8 already
        LLM(model, dtype="float32", kv_cache_dtype="fp8", kv_offload_dtype="fp8_e5m2", kv_offloading_size=0.01,
            num_gpu_blocks=32)
