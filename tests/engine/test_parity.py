"""Model-math parity: the engine's greedy tokens and next-token logits equal transformers'.

Oracle: transformers (float32, sdpa) on the small random-weight checkpoints of
tests/checkpoints.py, one prompt at a time, no padding.  The engine runs all prompts of a
kind as one batch, through the paged KV cache (block_size 16), so prompts of 1 to 1030
tokens cover partial, exact and multi-block prompts and llama3 rope past its original
256-position window. Each kind runs eagerly and compiled (torch.compile, engine/runner/compiled.py).
"""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch
from safetensors import safe_open

from checkpoints import (
    EOS_ID,
    KINDS,
    MIN_REL_MARGIN,
    VOCAB_SIZE,
    hf_greedy,
    hf_last_logits,
    random_prompt,
    relative_margin,
)

PARITY_LENGTHS = (1, 2, 15, 16, 17, 100, 511, 1030)
MAX_TOKENS = 16
LOGITS_RTOL = 1e-4  # max|engine - hf| / max|hf|; never loosen
# scripts/gpu-check.sh runs this module with KVTIER_TEST_DEVICE=cuda (Triton attention); CI on CPU.
TEST_DEVICE = os.environ.get("KVTIER_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module", params=KINDS)
def kind(request):
    return request.param


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(n, 1000 + i) for i, n in enumerate(PARITY_LENGTHS)]


@pytest.fixture(scope="module")
def oracle(kind, hf_model, prompts):
    """transformers' greedy tokens, per-step margins and last-position logits per prompt."""
    model = hf_model(kind)
    tokens, margins, last = [], [], []
    for p in prompts:
        toks, steps = hf_greedy(model, p, MAX_TOKENS, return_scores=True)
        tokens.append(toks)
        margins.append([relative_margin(s) for s in steps])
        last.append(hf_last_logits(model, p))
    return {"tokens": tokens, "margins": margins, "last_logits": last}


@pytest.fixture(scope="module", params=["eager", "compiled"])
def llm(request, kind, ckpt_dir):
    """The engine run eagerly (`enforce_eager`) and compiled (`optimization_level=3`, torch.compile)."""
    from engine import LLM

    compiled = request.param == "compiled"
    # the default G1 size (num_gpu_blocks=None) for one kind; allocating it takes seconds,
    # so the other kinds get 1024 blocks (16k tokens, plenty for this batch)
    num_gpu_blocks = None if kind == "qwen3" and not compiled else 1024
    engine = LLM(model=str(ckpt_dir(kind)), dtype="float32", block_size=16, seed=0, num_gpu_blocks=num_gpu_blocks,
                 device=TEST_DEVICE, optimization_level=3 if compiled else 0, enforce_eager=not compiled)
    assert (engine.engine.runner.forward is engine.engine.runner.model) != compiled
    yield engine
    del engine
    gc.collect()


# ------------------------------------------------------------------ the checkpoints themselves


def test_checkpoint_config_is_as_intended(kind, ckpt_dir, tokenizer):
    path = ckpt_dir(kind)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["vocab_size"] == len(tokenizer) == VOCAB_SIZE
    assert cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == {"gemma4": 5, "gemma4_moe": 4}.get(kind, 2)
    assert cfg["intermediate_size"] == 128 and cfg["max_position_embeddings"] == 2048
    assert cfg["num_attention_heads"] == 4
    arch = {
        "llama": "LlamaForCausalLM",
        "llama_mha_tied": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "mistral_swa": "MistralForCausalLM",
        "gemma3": "Gemma3ForCausalLM",
        "gemma4": "Gemma4ForCausalLM",
        "gemma4_moe": "Gemma4ForCausalLM",
    }[kind]
    assert cfg["architectures"] == [arch]
    assert cfg["num_key_value_heads"] == (4 if kind == "llama_mha_tied" else 2)
    assert cfg["tie_word_embeddings"] == (kind in ("qwen2", "llama_mha_tied", "gemma3"))
    rope = cfg["rope_parameters"]  # transformers 5: no top-level rope_theta / rope_scaling
    if kind == "llama":
        assert rope == {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        }
    elif kind == "gemma3":  # per layer type
        assert rope["full_attention"]["rope_type"] == "linear" and rope["sliding_attention"]["rope_type"] == "default"
        assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    elif kind.startswith("gemma4"):  # global layers: proportional rope, their own head size (and KV heads)
        assert rope["full_attention"]["rope_type"] == "proportional"
        assert rope["sliding_attention"]["rope_type"] == "default"
        full = {int(i): o for i, o in cfg["per_layer_config"].items()}
        assert set(full) == {i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"}
        assert all(o["head_dim"] == 32 != cfg["head_dim"] for o in full.values())
        assert cfg["hidden_size_per_layer_input"] == 8
        if kind == "gemma4":
            assert cfg["num_kv_shared_layers"] == 2 and cfg["attention_k_eq_v"]
            assert all(o["num_key_value_heads"] == 1 for o in full.values())
        else:
            assert cfg["enable_moe_block"] and cfg["num_experts"] == 4 and cfg["top_k_experts"] == 2
    else:
        assert rope["rope_type"] == "default"
    if kind == "mistral":
        assert cfg["sliding_window"] is None
    if kind == "mistral_swa":
        assert 0 < cfg["sliding_window"] < max(PARITY_LENGTHS)
    if kind == "qwen3":
        assert cfg["head_dim"] == 32 != cfg["hidden_size"] // cfg["num_attention_heads"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        if kind == "qwen2":
            for proj in ("q_proj", "k_proj", "v_proj"):
                bias = f.get_tensor(f"model.layers.0.self_attn.{proj}.bias")
                assert bias.abs().min() > 0 and bias.abs().mean() > 0.05
        if kind == "qwen3_moe":  # saved with per-expert names; routing weights spread out
            assert cfg.get("num_experts", cfg.get("num_local_experts")) == 4 and cfg["num_experts_per_tok"] == 2 and cfg["mlp_only_layers"] == [1]
            assert "model.layers.0.mlp.experts.3.up_proj.weight" in names and "model.layers.1.mlp.up_proj.weight" in names
            assert f.get_tensor("model.layers.0.mlp.gate.weight").std() > 0.05
        if kind == "qwen3":
            qn = f.get_tensor("model.layers.0.self_attn.q_norm.weight")
            assert qn.shape == (32,) and (qn - 1).abs().mean() > 0.05
        if kind.startswith("gemma4"):  # learned layer scalars and PLE weights are in the file, not defaults
            assert (f.get_tensor("model.layers.0.layer_scalar") - 1).abs().max() > 0.05
            assert "model.embed_tokens_per_layer.weight" in names and "model.layers.0.per_layer_input_gate.weight" in names
            assert ("model.layers.3.self_attn.k_proj.weight" in names) == (kind == "gemma4_moe")  # shared: none
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
        assert (norm - 1).abs().mean() > 0.05  # norms are not all-ones: skipping one shows
    assert "model.embed_tokens.weight" in names


def test_llama3_rope_scaling_is_in_effect_in_the_oracle(hf_model):
    """The llama checkpoint's oracle really uses llama3 rope (so parity checks it)."""
    model = hf_model("llama")
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert model.model.rotary_emb.rope_type == "llama3"
    base = model.config.rope_parameters["rope_theta"]
    dim = model.config.head_dim
    default_inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    inv_freq = model.model.rotary_emb.inv_freq.float()
    assert torch.allclose(inv_freq[:2], default_inv_freq[:2])  # high frequencies kept
    assert (inv_freq[-3:] < default_inv_freq[-3:] / 7.9).all()  # low ones divided by 8
    assert not torch.allclose(inv_freq, default_inv_freq)  # and some in between smoothed


def test_oracle_greedy_steps_are_well_separated(oracle):
    """Every greedy step of the oracle has a top-1/top-2 gap far above float32 noise.

    If this fails the checkpoints or prompts changed: pick another seed; do not loosen.
    """
    worst = min(min(m) for m in oracle["margins"])
    assert worst > MIN_REL_MARGIN, worst


# ------------------------------------------------------------------ engine vs transformers


def test_greedy_tokens_equal_transformers(llm, prompts, oracle):
    from engine import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert len(outs) == len(prompts)
    for i, (p, o, want) in enumerate(zip(prompts, outs, oracle["tokens"])):
        assert list(o.prompt_token_ids) == p, f"prompt {i}: outputs not in input order"
        got = list(o.outputs[0].token_ids)
        assert got == want, f"prompt {i} (len {len(p)}): engine {got} != transformers {want}"
        assert o.outputs[0].finish_reason == "length"


def test_next_token_logits_equal_transformers(llm, prompts, oracle):
    got = llm.next_token_logits([{"prompt_token_ids": p} for p in prompts])
    assert len(got) == len(prompts)
    for i, (p, g, want) in enumerate(zip(prompts, got, oracle["last_logits"])):
        g = torch.as_tensor(g)
        assert g.shape == (VOCAB_SIZE,) and g.dtype == torch.float32, (g.shape, g.dtype)
        rel = float((g - want).abs().max() / want.abs().max())
        assert rel < LOGITS_RTOL, f"prompt {i} (len {len(p)}): max|diff|/max|hf| = {rel:.3e}"


def test_text_prompts_and_chat(kind, llm, tokenizer, hf_model):
    """A text prompt is tokenized with the checkpoint's tokenizer; chat applies its template."""
    if kind != "qwen3":
        pytest.skip("one kind is enough")
    from engine import SamplingParams

    model = hf_model(kind)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    text = "hello world what is the capital of france ? tell me a story please"
    ids = tokenizer.encode(text, add_special_tokens=True)
    (out,) = llm.generate([text], sp, use_tqdm=False)
    assert list(out.prompt_token_ids) == ids
    toks = list(out.outputs[0].token_ids)
    assert toks == hf_greedy(model, ids, 8)
    # the text is the decoded tokens (whitespace conventions aside)
    assert out.outputs[0].text.split() == tokenizer.decode(toks, skip_special_tokens=True).split()

    messages = [
        {"role": "system", "content": "you are a helpful assistant ."},
        {"role": "user", "content": "what is the capital of france ?"},
    ]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer.encode(chat_ids, add_special_tokens=False)
    assert chat_ids[0] != EOS_ID and len(chat_ids) > 10
    (cout,) = llm.chat(messages, sp, use_tqdm=False)
    assert list(cout.prompt_token_ids) == chat_ids
    assert list(cout.outputs[0].token_ids) == hf_greedy(model, chat_ids, 8)
    # a list of conversations gives one output each, in order
    convs = [messages, [{"role": "user", "content": "hi"}]]
    couts = llm.chat(convs, sp, use_tqdm=False)
    assert len(couts) == 2 and list(couts[0].outputs[0].token_ids) == list(cout.outputs[0].token_ids)
