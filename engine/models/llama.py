"""The Llama family: Llama (incl. llama3 rope scaling), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm),
and Qwen3-MoE (Qwen3 with sparse MoE MLPs, engine/models/moe.py).

They differ only in flags, so one implementation serves all five. Op order follows
transformers' modeling code so that float32 outputs match it token for token.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine import cpu_kernels
from engine.runner.attention import AttentionBackend, AttentionMetadata
from engine.model_config import UNSCALED, KVScale, ModelConfig
from engine.models.moe import SparseMoeBlock, expert_weight_slot, is_moe_layer


def unset_embedding(num: int, dim: int) -> nn.Embedding:
    """An embedding without its random init. Models are built on the meta device and every weight
    is loaded over them, and `normal_` on meta imports torch._dynamo: 1-2 s of every start-up,
    compiled or not."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(cfg: ModelConfig, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[max_len, head_dim]` computed the way transformers computes them per step."""
    return rope_tables_for(cfg, max_len)


def rope_tables_for(cfg: ModelConfig, max_len: int, layer_type: str | None = None, head_dim: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_tables` for one layer type of a model whose `rope_parameters` are per layer type
    (Gemma 3: `{"sliding_attention": {...}, "full_attention": {...}}`), whose layers of that type
    have `head_dim` (default the model's)."""
    with torch.device("cpu"):  # real numbers even when the model is built on the meta device
        return _rope_tables(cfg, max_len, layer_type, head_dim or cfg.head_dim)


def _rope_tables(cfg: ModelConfig, max_len: int, layer_type: str | None, head_dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(cfg.hf_config, "rope_parameters", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(cfg.hf_config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scaling = 1.0
    elif rope_type in ("dynamic", "longrope"):
        raise ValueError(f"rope_type {rope_type!r} is not supported (it depends on the sequence length)")
    else:
        kw = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg.hf_config, "cpu", **kw)
    freqs = torch.arange(max_len, dtype=torch.float).unsqueeze(1) * inv_freq.float().unsqueeze(0)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(cfg.dtype), (emb.sin() * scaling).to(cfg.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# From this many tokens in a step, q/k/v and gate/up run as separate GEMMs on slices of the
# fused weights: on CPU the fused [M, 576] x [576, 3072]-shaped GEMMs run ~5% slower end to end
# at prefill sizes (A/B on the demo model, 12 prompts of 256-1024 tokens), while for decode
# batches one fused call beats several small ones.
SPLIT_GEMM_MIN_TOKENS = 256


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.kv_heads * self.head_dim
        # q, k and v share one matmul: fewer, larger GEMMs are much faster on CPU.
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.window = cfg.sliding_windows[layer_idx]  # 0: attends to the whole context
        self.backend = backend
        self.kv_scale = UNSCALED  # an fp8 cache's (engine/runner/kv_quant.py)
        self.fused = False  # engine/cpu_kernels' fused ops (set by `use_fused_cpu_ops`)

    def use_kv_scale(self, scale: KVScale) -> None:
        """An fp8 cache's scales for this layer (engine/runner/kv_quant.py), set before compiling."""
        self.kv_scale = scale

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata):
        n = x.shape[0]
        # Compiled, the split is inductor's choice (and a size test would be one more graph).
        if not torch.compiler.is_compiling() and n >= SPLIT_GEMM_MIN_TOKENS and type(self.qkv_proj) is nn.Linear:
            w, b = self.qkv_proj.weight, self.qkv_proj.bias
            parts = w.split([self.q_size, self.kv_size, self.kv_size])
            bs = b.split([self.q_size, self.kv_size, self.kv_size]) if b is not None else (None,) * 3
            q, k, v = (nn.functional.linear(x, wi, bi) for wi, bi in zip(parts, bs))
        else:
            q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.kv_heads, self.head_dim)
        v = v.view(n, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused:  # in place on the projection's output: one pass instead of six ops
            cpu_kernels.rope_(q, cos, sin)
            cpu_kernels.rope_(k, cos, sin)
        else:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if meta is None:  # compiled (engine/runner/compiled.py): the op finds the step's cache and metadata itself
            return self.o_proj(torch.ops.kvtier.attention(q, k, v, self.layer_idx, self.scale, self.window,
                                                          self.kv_scale.k, self.kv_scale.v))
        return self.o_proj(self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, self.window,
                                                self.kv_scale))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def packed_parts(self) -> dict[str, tuple[int, ...]]:
        # Prepacked gate and up as two GEMMs: contiguous outputs, SiLU and the product in place;
        # the same bits, an MLP 4-7% faster at prefill sizes; at decode sizes equal once the
        # weights stream from memory (with them in cache, one more call: ~10 us at 1-4 rows).
        half = self.gate_up_proj.out_features // 2
        return {"gate_up_proj": (half, half)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.gate_up_proj, "fuses_silu_mul", False):  # bfloat16 on AMX: one kernel (not under LoRA)
            return self.down_proj(self.gate_up_proj.silu_mul(x))
        if getattr(self.gate_up_proj, "splits_output", False):  # packed in parts, maybe under LoRA
            gate, up = self.gate_up_proj.forward_parts(x)
            return self.down_proj(nn.functional.silu(gate, inplace=True).mul_(up))
        if not torch.compiler.is_compiling() and x.shape[0] >= SPLIT_GEMM_MIN_TOKENS \
                and type(self.gate_up_proj) is nn.Linear:
            w_gate, w_up = self.gate_up_proj.weight.chunk(2)
            h = nn.functional.silu(nn.functional.linear(x, w_gate)).mul_(nn.functional.linear(x, w_up))
            return self.down_proj(h)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg) if is_moe_layer(cfg, layer_idx) else MLP(cfg)
        self.fused = False

    def forward(self, h, cos, sin, k_cache, v_cache, meta):
        if self.fused:  # the residual stream `h` is updated in place
            norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
            a = self.self_attn(cpu_kernels.add_rms_norm(h, None, norm_in.weight, norm_in.eps), cos, sin,
                               k_cache, v_cache, meta)
            m = self.mlp(cpu_kernels.add_rms_norm(h, a, norm_post.weight, norm_post.eps))
            return h.add_(m)
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaFamilyForCausalLM(nn.Module):
    # What a variant (engine/models/gemma3.py) replaces: its decoder layer and norm, and whether
    # engine/cpu_kernels' fused norm and rotary ops compute what its layers do.
    layer_cls: type[nn.Module] = DecoderLayer
    norm_cls: type[nn.Module] = RMSNorm
    supports_fused_cpu_ops = True

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = unset_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(cfg, backend, i) for i in range(cfg.num_layers))
        self.norm = self.norm_cls(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.fused = False
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_rope(max_len)

    def reset_rope(self, max_len: int, device: str | torch.device = "cpu") -> None:
        """(Re)builds the rotary tables (after `to_empty`, which leaves buffers uninitialised)."""
        cos, sin = rope_tables(self.cfg, max_len)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def layer_rope(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos/sin rows for the step's positions."""
        cos_sin = (self.rope_cos[positions], self.rope_sin[positions])
        return [cos_sin] * len(self.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None,
        meta: AttentionMetadata | None,
        capture_layers: tuple[int, ...] = (),
        mm: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final-normed hidden states `[num_tokens, hidden]` and the residual stream at
        each id in `capture_layers` (0 = embeddings, k = after decoder layer k-1, pre-norm).
        `kv_caches` and `meta` are None when compiled: attention reads them from engine/runner/compiled.py's
        step context instead, so that the graph sees only token-sized tensors. `mm`: (rows,
        embeddings) that replace those rows' token embeddings (images' placeholders)."""
        h = self.embed(input_ids)
        if mm is not None:
            h = h.index_copy(0, mm[0], mm[1].to(h.dtype))
        rope = self.layer_rope(positions)
        captured = [h] if 0 in capture_layers else []
        if self.fused:
            captured = [x.clone() for x in captured]  # fused layers update `h` in place
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = kv_caches[i] if kv_caches is not None else (None, None)
            h = layer(h, *rope[i], k_cache, v_cache, meta.for_layer(i) if meta is not None else None)
            if i + 1 in capture_layers:
                captured.append(h.clone() if self.fused else h)
        return self.norm(h), captured

    def use_fused_cpu_ops(self) -> None:
        """Switches the layers' norms (with the residual add) and rotary embedding to
        engine/cpu_kernels' fused ops (the loader does this on CPU when the kernels built): 4-12%
        off a batch-64 decode step here, with float32 results bit-identical to the eager ops'."""
        self.fused = True
        for layer in self.layers:
            layer.fused = layer.self_attn.fused = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def lora_sites(self) -> list[tuple[int, nn.Module, str, tuple[str, ...], tuple[int, ...]]]:
        """Where LoRA adapters apply (engine/lora/slots.py): `(layer, parent, attribute, PEFT module
        names, their output sizes)` of each projection; an MoE layer's experts take none."""
        sites = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            sites.append((i, attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), (attn.q_size, attn.kv_size, attn.kv_size)))
            sites.append((i, attn, "o_proj", ("o_proj",), (attn.o_proj.out_features,)))
            if isinstance(layer.mlp, MLP):
                half = layer.mlp.gate_up_proj.out_features // 2
                sites.append((i, layer.mlp, "gate_up_proj", ("gate_proj", "up_proj"), (half, half)))
                sites.append((i, layer.mlp, "down_proj", ("down_proj",), (layer.mlp.down_proj.out_features,)))
        return sites

    def language_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters `load_weights` fills (a model with a vision part loads that itself)."""
        return dict(self.named_parameters(remove_duplicate=False))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named tensors, fusing q/k/v and gate/up into their shared matrices."""
        params = self.language_parameters()
        q, kv = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
        inter = self.cfg.intermediate_size
        fused = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, inter),
        }
        loaded: set[str] = set()
        moe_inter = getattr(self.cfg.hf_config, "moe_intermediate_size", 0)
        expert_rows: dict[str, int] = {}  # fused expert parameter -> rows loaded from per-expert names
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            slot = expert_weight_slot(name, moe_inter)
            if slot is not None:
                target, expert, row, rows = slot
                if target not in params or expert >= params[target].shape[0]:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                dst = params[target].data[expert]
                dst = dst if rows < 0 else dst.narrow(0, row, rows)
                if dst.shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(tensor)
                expert_rows[target] = expert_rows.get(target, 0) + dst.shape[0]
                continue
            parts = name.split(".")
            target, start, size = name, None, None
            for src, (dst, off, length) in fused.items():
                if src in parts:
                    target, start, size = name.replace(src, dst), off, length
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            p = params[target]
            dst = p.data if start is None else p.data.narrow(0, start, size)
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)
        loaded.update(n for n, rows in expert_rows.items() if rows == params[n].shape[0] * params[n].shape[1])
        expected = {n for n in params if not (n == "lm_head.weight" and self.cfg.tie_word_embeddings)}
        missing = {n for n in expected if not any(_matches(n, l, fused) for l in loaded)}
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")


def _matches(param: str, loaded: str, fused: dict[str, tuple[str, int, int]]) -> bool:
    if param == loaded:
        return True
    return any(loaded.replace(src, dst) == param for src, (dst, _, _) in fused.items() if src in loaded.split("."))
