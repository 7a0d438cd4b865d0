"""Gemma 3 text (`Gemma3ForCausalLM`, transformers' `gemma3_text`) on the Llama-family model.

What differs from Llama, each in transformers' op order so float32 tokens match it: embeddings
scaled by sqrt(hidden); RMSNorm weights applied as (1 + w), in float32; q/k norms; the attention
output and the MLP output normed again before their residual adds (four norms a layer); GELU (tanh)
instead of SiLU; attention scaled by query_pre_attn_scalar^-0.5; rotary tables per layer type
(sliding layers and full-attention layers have their own rope_theta and scaling); optional final
logit soft-capping. Sliding layers attend within `sliding_window` (ModelConfig.sliding_windows).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.runner.attention import AttentionBackend
from engine.model_config import ModelConfig
from engine.models.llama import MLP, Attention, LlamaFamilyForCausalLM, rope_tables_for


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GemmaAttention(Attention):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer_idx: int) -> None:
        super().__init__(cfg, backend, layer_idx)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.hf_config.query_pre_attn_scalar ** -0.5


class GemmaMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "splits_output", False):  # packed in parts, maybe under LoRA
            gate, up = self.gate_up_proj.forward_parts(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer_idx: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.self_attn = GemmaAttention(cfg, backend, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, h, cos, sin, k_cache, v_cache, meta):
        a = self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, meta)
        h = h + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def check_gemma3_config(hf) -> None:
    """Refuses what this implementation (and Gemma 4's) does not compute (rather than computing
    something else)."""
    if getattr(hf, "attn_logit_softcapping", None):
        raise ValueError(f"Gemma with attn_logit_softcapping={hf.attn_logit_softcapping} is not supported")
    act = getattr(hf, "hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma with hidden_activation={act!r} is not supported (gelu_pytorch_tanh is)")
    # "vision" (Gemma 4): image placeholders attend both ways, in the multimodal model (engine/mm/spec.py);
    # text stays causal.
    if getattr(hf, "use_bidirectional_attention", None) not in (None, False, "vision"):
        raise ValueError(f"Gemma with use_bidirectional_attention={hf.use_bidirectional_attention!r} is not "
                         "supported (a causal LM is served)")


class Gemma3ForCausalLM(LlamaFamilyForCausalLM):
    layer_cls = GemmaDecoderLayer
    norm_cls = GemmaRMSNorm
    supports_fused_cpu_ops = False  # the fused C++ norm computes w * x, not (1 + w) * x

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_len: int) -> None:
        check_gemma3_config(cfg.hf_config)
        self.layer_types = tuple(cfg.hf_config.layer_types)
        super().__init__(cfg, backend, max_len)
        self.embed_scale = cfg.hidden_size ** 0.5
        self.softcap = getattr(cfg.hf_config, "final_logit_softcapping", None)

    def reset_rope(self, max_len: int, device: str | torch.device = "cpu") -> None:
        for kind in sorted(set(self.layer_types)):
            # each type's head size (Gemma 4's global layers have their own)
            head_dim = self.cfg.kv_shape(self.layer_types.index(kind))[1]
            cos, sin = rope_tables_for(self.cfg, max_len, layer_type=kind, head_dim=head_dim)
            self.register_buffer(f"rope_cos_{kind}", cos.to(device), persistent=False)
            self.register_buffer(f"rope_sin_{kind}", sin.to(device), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        # transformers multiplies by the scale as a tensor of the weights' dtype
        return h * torch.tensor(self.embed_scale, dtype=h.dtype)

    def layer_rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rows = {kind: (getattr(self, f"rope_cos_{kind}")[positions], getattr(self, f"rope_sin_{kind}")[positions])
                for kind in set(self.layer_types)}
        return [rows[kind] for kind in self.layer_types]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
