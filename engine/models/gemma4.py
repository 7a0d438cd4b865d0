"""Gemma 4 text (`Gemma4ForCausalLM`, transformers' `gemma4_text`), dense and MoE.

What differs from Gemma 3, each in transformers' op order so float32 tokens match it:
- global layers have their own head size and KV head count (`per_layer_config`; the cache lays
  layers of different shapes side by side, engine/kv/kv_groups.py) and "proportional" RoPE (only a
  fraction of each head rotated), sliding layers default RoPE;
- RMSNorm weights multiply as `w` (not 1 + w), computed in float32 with pow(-0.5); a weightless
  norm on V; attention unscaled (the q/k norms take that role);
- `attention_k_eq_v`: global layers project no V, their keys (before k_norm) double as values;
- KV sharing (`num_kv_shared_layers`): the last layers compute no K/V and attend to the cache of
  the last earlier layer of their type (ModelConfig.kv_sources), optionally with a double-wide MLP;
- per-layer embeddings: a second embedding and a projection of the first give every layer an
  input of its own, gated into the residual stream after the MLP;
- `enable_moe_block`: an MoE block (routed experts, GELU) runs beside the dense MLP in every layer;
- a learned per-layer scalar on each layer's output.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.runner.attention import AttentionBackend, AttentionMetadata
from engine.model_config import UNSCALED, KVScale, ModelConfig
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llama import _rotate_half, unset_embedding
from engine.models.moe import Experts

_SHARED_KV_WEIGHTS = ("k_proj", "v_proj", "k_norm", "v_norm")


class Gemma4RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            out = out * self.weight.float()
        return out.type_as(x)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer_idx: int) -> None:
        super().__init__()
        hf, h, eps, bias = cfg.hf_config, cfg.hidden_size, cfg.rms_norm_eps, cfg.attention_bias
        self.layer_idx, self.backend = layer_idx, backend
        self.kv_scale = UNSCALED  # an fp8 cache's (engine/runner/kv_quant.py)
        self.num_heads = cfg.num_heads
        self.kv_heads, self.head_dim = cfg.kv_shape(layer_idx)
        self.window = cfg.sliding_windows[layer_idx]
        self.shared = cfg.kv_source(layer_idx) != layer_idx
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.q_norm = Gemma4RMSNorm(self.head_dim, eps)
        if not self.shared:
            kv = self.kv_heads * self.head_dim
            self.k_proj = nn.Linear(h, kv, bias=bias)
            k_eq_v = bool(getattr(hf, "attention_k_eq_v", False)) and not self.window
            self.v_proj = None if k_eq_v else nn.Linear(h, kv, bias=bias)
            self.k_norm = Gemma4RMSNorm(self.head_dim, eps)
            self.v_norm = Gemma4RMSNorm(self.head_dim, eps, with_scale=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)

    def use_kv_scale(self, scale: KVScale) -> None:
        """An fp8 cache's scales for this layer (engine/runner/kv_quant.py), set before compiling."""
        self.kv_scale = scale

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata | None,
                shared_kv: tuple[torch.Tensor, torch.Tensor] | None):
        """Returns the output and the (k, v) it attended with (a KV-sharing layer's are its
        source's: written again to the same slots, which leaves the cache as it was)."""
        n = x.shape[0]
        q = _rope(self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim)), cos, sin)
        if self.shared:
            k, v = shared_kv
        else:
            k = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
            v = self.v_proj(x).view(n, self.kv_heads, self.head_dim) if self.v_proj is not None else k
            k, v = _rope(self.k_norm(k), cos, sin), self.v_norm(v)
        if meta is None:  # compiled (engine/runner/compiled.py)
            out = torch.ops.kvtier.attention(q, k, v, self.layer_idx, 1.0, self.window, self.kv_scale.k,
                                             self.kv_scale.v)
        else:
            out = self.backend.forward(q, k, v, k_cache, v_cache, meta, 1.0, self.window, self.kv_scale)
        return self.o_proj(out), (k, v)


class Gemma4MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hf, h = cfg.hf_config, cfg.hidden_size
        self.top_k = hf.top_k_experts
        self.norm = Gemma4RMSNorm(h, cfg.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(h, hf.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(h))
        self.per_expert_scale = nn.Parameter(torch.ones(hf.num_experts))
        self.root = h ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.proj(self.norm(x) * self.scale * self.root), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[ids]
        return weights, ids


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer_idx: int) -> None:
        super().__init__()
        hf, h, eps = cfg.hf_config, cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma4Attention(cfg, backend, layer_idx)
        wide = bool(getattr(hf, "use_double_wide_mlp", False)) and self.self_attn.shared
        self.mlp = Gemma4MLP(h, cfg.intermediate_size * (2 if wide else 1))
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, Gemma4RMSNorm(h, eps))
        self.register_buffer("layer_scalar", torch.ones(1))
        self.moe = bool(getattr(hf, "enable_moe_block", False))
        if self.moe:
            self.router = Gemma4Router(cfg)
            self.experts = Experts(hf.num_experts, h, hf.moe_intermediate_size, gelu=True)
            # Under tensor parallelism each rank's experts give a partial sum, normed below before it
            # joins the MLP's: it is all-reduced first (engine/parallel/shard.py).
            self.experts.tp_reduce_output = True
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(h, eps)
        self.ple = int(getattr(hf, "hidden_size_per_layer_input", 0) or 0)
        if self.ple:
            self.per_layer_input_gate = nn.Linear(h, self.ple, bias=False)
            self.per_layer_projection = nn.Linear(self.ple, h, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)

    def forward(self, h, cos, sin, k_cache, v_cache, meta, per_layer_input, shared_kv):
        a, kv = self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, meta, shared_kv)
        h = h + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(h))
        if self.moe:  # routed on the MLP's input residual, summed with the dense MLP's output
            weights, ids = self.router(h)
            routed = self.experts(self.pre_feedforward_layernorm_2(h), ids, weights.to(h.dtype))
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(routed)
        h = h + self.post_feedforward_layernorm(m)
        if self.ple:
            gated = nn.functional.gelu(self.per_layer_input_gate(h), approximate="tanh") * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar, kv


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Gemma 3's embedding scale, rotary tables per layer type and logit soft-capping, with Gemma 4's
    layers, per-layer embeddings and KV sharing."""

    layer_cls = Gemma4DecoderLayer
    norm_cls = Gemma4RMSNorm
    own_prefixes: tuple[str, ...] = ()  # modules a subclass loads itself (engine/models/gemma4_mm.py)

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_len: int) -> None:
        super().__init__(cfg, backend, max_len)
        hf = cfg.hf_config
        self.kv_sources = tuple(cfg.kv_source(i) for i in range(cfg.num_layers))
        self.ple = int(getattr(hf, "hidden_size_per_layer_input", 0) or 0)
        if self.ple:
            n, h = cfg.num_layers, cfg.hidden_size
            self.embed_tokens_per_layer = unset_embedding(hf.vocab_size_per_layer_input, n * self.ple)
            self.per_layer_model_projection = nn.Linear(h, n * self.ple, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.ple, cfg.rms_norm_eps)

    def lora_sites(self) -> list:
        raise ValueError("LoRA adapters on Gemma 4 are not supported yet (Llama, Mistral, Qwen2, Qwen3 and Gemma 3 "
                         "take them)")

    def language_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids the embeddings read (the multimodal model's media tokens read the pad token's)."""
        return input_ids

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor | None:
        """`[tokens, layers, ple]`: the token's own per-layer embedding plus a projection of its
        embedding, averaged (transformers' get_per_layer_inputs + project_per_layer_inputs)."""
        if not self.ple:
            return None
        shape = (*input_ids.shape, self.cfg.num_layers, self.ple)
        own = self.embed_tokens_per_layer(input_ids)
        own = (own * torch.tensor(self.ple ** 0.5, dtype=own.dtype)).reshape(shape)
        proj = self.per_layer_model_projection(embeds) * self.cfg.hidden_size ** -0.5
        return (self.per_layer_projection_norm(proj.reshape(shape)) + own) * 2.0 ** -0.5

    def forward(self, input_ids, positions, kv_caches, meta, capture_layers=(), mm=None):
        """As LlamaFamilyForCausalLM.forward. `mm` (rows, embeddings): image placeholders' rows and
        the embeddings that replace theirs."""
        input_ids = self.language_ids(input_ids)
        h = self.embed(input_ids)
        if mm is not None:
            h = h.index_copy(0, mm[0], mm[1].to(h.dtype))
        ple = self.per_layer_inputs(input_ids, h)
        rope = self.layer_rope(positions)
        captured = [h] if 0 in capture_layers else []
        kv_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # a KV source's step k/v, for its sharers
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_caches[i] if kv_caches is not None else (None, None)
            src = self.kv_sources[i]
            h, kv = layer(h, *rope[i], k_cache, v_cache, meta.for_layer(i) if meta is not None else None,
                          ple[:, i] if ple is not None else None, kv_of.get(src) if src != i else None)
            if src == i:
                kv_of[i] = kv
            if i + 1 in capture_layers:
                captured.append(h)
        return self.norm(h), captured

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named tensors (the names are this module's); K/V weights of layers that
        reuse another's KV, which transformers ignores too, are skipped."""
        params = {n: t for n, t in self.state_dict(keep_vars=True).items()  # and persistent buffers (layer_scalar)
                  if not n.startswith(self.own_prefixes)}
        skip = {f"layers.{i}.self_attn.{w}.weight" for i, src in enumerate(self.kv_sources) if src != i
                for w in _SHARED_KV_WEIGHTS}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name in skip or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            if params[name].shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        missing = {n for n in params if n not in loaded and not (n == "lm_head.weight" and self.cfg.tie_word_embeddings)}
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
