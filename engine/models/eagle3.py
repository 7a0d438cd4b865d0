"""An EAGLE-3 draft in `speculators`' checkpoint format (config.json with
`speculators_model_type: "eagle3"`, one Llama decoder layer), as vLLM's `Eagle3LlamaForCausalLM`
runs it.

The row for position t pairs the target's features at t, g_t = the residual streams entering the
aux layers (`eagle_aux_hidden_state_layer_ids`, default [2, N//2, N-3]; kvtier's hidden-state
layer ids mean the same thing), concatenated and projected by `fc`, with the embedding of token
t+1; it predicts token t+2. Further draft steps feed back the layer's output before the final
norm in place of fc(g). The attention input is [input_layernorm(embedding), hidden_norm(h)]
(2 * hidden wide); the residual is h, or hidden_norm(h) with `norm_before_residual`. `lm_head`
covers the draft vocabulary; draft id d is target id d + d2t[d].
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from engine.runner.attention import AttentionBackend, AttentionMetadata
from engine.model_config import ModelConfig
from engine.runner.loader import iter_safetensors
from engine.models.llama import MLP, Attention, RMSNorm, rope_tables, unset_embedding

log = logging.getLogger(__name__)

# Options speculators can set that this implementation (and vLLM's llama_eagle3) does not run.
_UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the draft decoder layer (vocab_size: the target's)
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    target_hidden_size: int
    norm_before_residual: bool


def load_eagle3_config(draft_dir: Path, target: ModelConfig) -> Eagle3Config:
    """Reads and checks a speculators EAGLE-3 config.json against the target."""
    from transformers import LlamaConfig

    from connectors.hidden_spec import eagle3_layer_ids

    path = draft_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"speculative_config model {str(draft_dir)!r} has no config.json")
    raw = json.loads(path.read_text())
    if raw.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{draft_dir} is not an EAGLE-3 draft in speculators' format "
                         f"(speculators_model_type is {raw.get('speculators_model_type')!r}, not 'eagle3')")
    bad = [f for f in _UNSUPPORTED_FLAGS if raw.get(f)]
    if bad:
        raise ValueError(f"EAGLE-3 draft options {bad} are not supported")
    tl = dict(raw.get("transformer_layer_config") or {})
    if tl.get("model_type", "llama") != "llama":
        raise ValueError(f"EAGLE-3 drafts with a {tl.get('model_type')!r} layer are not supported (llama only)")
    tl.pop("model_type", None)
    hf = LlamaConfig(**tl)
    if hf.vocab_size != target.vocab_size:
        raise ValueError(f"the EAGLE-3 draft was made for a {hf.vocab_size}-token vocabulary; the target has "
                         f"{target.vocab_size}")
    heads = hf.num_attention_heads
    layer = replace(target, architecture="Eagle3", hidden_size=hf.hidden_size,
                    intermediate_size=hf.intermediate_size, num_layers=1, num_heads=heads,
                    num_kv_heads=hf.num_key_value_heads or heads,
                    head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads, rms_norm_eps=hf.rms_norm_eps,
                    max_position_embeddings=hf.max_position_embeddings, tie_word_embeddings=False,
                    attention_bias=bool(getattr(hf, "attention_bias", False)),
                    o_proj_bias=bool(getattr(hf, "attention_bias", False)), qk_norm=False, sliding_windows=(0,),
                    hf_config=hf)
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle3_layer_ids(target.num_layers)
    if any(not isinstance(i, int) or not 0 <= i <= target.num_layers for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {ids} must be distinct layer ids in 0..{target.num_layers}")
    if "norm_before_residual" not in raw:
        log.warning("%s does not say norm_before_residual; taking vLLM's default, true", path)
    return Eagle3Config(layer, int(raw.get("draft_vocab_size") or hf.vocab_size), tuple(ids),
                        int(raw.get("target_hidden_size") or target.hidden_size),
                        bool(raw.get("norm_before_residual", True)))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3Config, backend: AttentionBackend, max_len: int) -> None:
        super().__init__()
        lc, h = cfg.layer, cfg.layer.hidden_size
        self.cfg = cfg
        self.embed_tokens = unset_embedding(lc.vocab_size, h)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, lc.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, lc.rms_norm_eps)
        # q/k/v read [embedding, hidden]: 2 * hidden wide; o_proj writes back to hidden.
        self.self_attn = Attention(replace(lc, hidden_size=2 * h), backend, 0)
        self.self_attn.o_proj = nn.Linear(lc.num_heads * lc.head_dim, h, bias=lc.o_proj_bias)
        self.post_attention_layernorm = RMSNorm(h, lc.rms_norm_eps)
        self.mlp = MLP(lc)
        self.norm = RMSNorm(h, lc.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long), persistent=False)
        cos, sin = rope_tables(lc, max_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """`hidden`: fc(features) for first-pass rows, or the previous step's output. Returns the
        layer's output before the final norm `[rows, hidden]` (what the next step feeds back)."""
        hn = self.hidden_norm(hidden)
        resid = hn if self.cfg.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(self.embed_tokens(token_ids)), hn], dim=-1)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        h = resid + self.self_attn(x, cos, sin, kv_cache[0], kv_cache[1], meta)
        return h + self.mlp(self.post_attention_layernorm(h))

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary (-inf outside the draft's), float32."""
        small = self.lm_head(self.norm(out)).float()
        if self.cfg.draft_vocab_size == self.cfg.layer.vocab_size:
            return small
        full = small.new_full((small.shape[0], self.cfg.layer.vocab_size), float("-inf"))
        full[:, torch.arange(self.cfg.draft_vocab_size, device=small.device) + self.d2t] = small
        return full

    def load(self, draft_dir: Path, target_embedding: torch.Tensor) -> None:
        """Loads the checkpoint; without `embed_tokens` the draft shares the target's embedding."""
        params = dict(self.named_parameters())
        q = self.cfg.layer.num_heads * self.cfg.layer.head_dim
        kv = self.cfg.layer.num_kv_heads * self.cfg.layer.head_dim
        inter = self.cfg.layer.intermediate_size
        spans = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv), "gate_proj": (0, inter),
                 "up_proj": (inter, inter)}
        loaded: set[str] = set()
        for name, t in iter_safetensors(draft_dir):
            if name == "t2d":
                continue
            if name == "d2t":
                if t.shape != self.d2t.shape:
                    raise ValueError(f"d2t has shape {tuple(t.shape)}, expected {tuple(self.d2t.shape)}")
                self.d2t.copy_(t)
                continue
            key = name.removeprefix("model.").replace("midlayer.", "").replace("layers.0.", "")
            for src, (start, size) in spans.items():  # q/k/v and gate/up are fused, as in the target
                if f".{src}." in f".{key}":
                    dst_name = key.replace(src, "gate_up_proj" if src in ("gate_proj", "up_proj") else "qkv_proj")
                    break
            else:
                dst_name, start, size = key, None, None
            if dst_name not in params:
                raise ValueError(f"unexpected weight {name!r} in the EAGLE-3 draft")
            dst = params[dst_name].data
            dst = dst if start is None else dst.narrow(0, start, size)
            if dst.shape != t.shape:
                raise ValueError(f"EAGLE-3 weight {name!r} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(t.to(dst.dtype))
            loaded.add(dst_name)
        if "embed_tokens.weight" not in loaded:
            self.embed_tokens.weight = nn.Parameter(target_embedding, requires_grad=False)
            loaded.add("embed_tokens.weight")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the EAGLE-3 draft is missing weights: {missing[:5]}")
        if not bool((self.d2t + torch.arange(len(self.d2t), device=self.d2t.device) < self.cfg.layer.vocab_size).all()):
            raise ValueError("d2t maps draft ids outside the target's vocabulary")
