"""Small random-weight Hugging Face checkpoints for the engine tests.

``build_checkpoint(kind, path)`` writes a complete model directory (``config.json``,
``generation_config.json``, ``model.safetensors`` and a tokenizer) that both
``transformers`` and the engine can load.  ``transformers`` is the correctness oracle
(see DESIGN.md, "Correctness oracles").

Kinds
-----
``llama``            LlamaForCausalLM, GQA (4 q heads / 2 kv heads), untied embeddings,
                     llama3 rope scaling (factor 8, low 1, high 4, original 256).
``mistral``          MistralForCausalLM, GQA, ``sliding_window=None``.
``qwen2``            Qwen2ForCausalLM, q/k/v biases (non-zero), tied embeddings.
``qwen3``            Qwen3ForCausalLM, q/k RMSNorm, explicit ``head_dim=32`` (!= 64/4), GQA.
``llama_mha_tied``   LlamaForCausalLM, ``num_key_value_heads == num_attention_heads``, tied
                     embeddings, default rope.
``qwen3_moe``        Qwen3MoeForCausalLM, 4 experts (2 active), the last layer dense.
``mistral_swa``      MistralForCausalLM with ``sliding_window=48`` on every layer.
``gemma3``           Gemma3ForCausalLM: layer 0 sliding (48), layer 1 full with linear rope
                     scaling, query_pre_attn_scalar 24 (!= head_dim 32), final logit soft-capping.
``gemma4``           Gemma4ForCausalLM, 5 layers (sliding, sliding, full, sliding, full): sliding
                     head_dim 16 with 2 KV heads, global 32 with 1 KV head and keys as values
                     (attention_k_eq_v), proportional RoPE (0.25) on global layers, layers 3-4
                     reuse layers 1-2's KV (double-wide MLPs), per-layer embeddings (8), soft-capping.
``gemma4_moe``       Gemma4ForCausalLM, 4 layers (sliding, full) x 2, an MoE block (4 experts, 2
                     active) beside every MLP, global layers head_dim 32 with 2 KV heads (twice
                     the sliding layers' width: two sliding layers share a cache row).
``qwen3_swa``        (not in KINDS) Qwen3ForCausalLM, layer 0 full, layer 1 a 48-token window.

All: hidden 64, 2 layers, intermediate 128, ``max_position_embeddings`` 2048,
vocab ``len(tokenizer)`` (= 512).

Tokenizer
---------
A ``tokenizers`` WordLevel model over 512 tokens: 6 specials (``<unk>`` 0, ``<s>`` 1,
``</s>`` 2, ``<pad>`` 3, ``<|im_start|>`` 4, ``<|im_end|>`` 5), ~70 English words and
generated two-syllable words ("bada", "kesu", ...).  Lower-casing normalizer, Whitespace
pre-tokenizer (punctuation splits off), WordPiece decoder without clean-up: ``decode`` joins
tokens with single spaces, so ``encode(decode(ids)) == ids`` for ordinary words and stop
strings can be cut out of the text.  No BOS is added on encode (like Qwen); the chat
template (``chat_template.jinja`` in transformers 5) starts with ``{{ bos_token }}``.
Saved through ``PreTrainedTokenizerFast`` (transformers 5 writes ``tokenizer_class:
TokenizersBackend``).

Weights
-------
Every parameter, norms and biases included, is drawn from a fixed-seed generator, so
that an engine that skips a norm weight, a bias or a q/k-norm, or ties/unties the
wrong matrices, produces different logits:

* linear / embedding weights ~ N(0, 0.2^2)  (``INIT_STD``; 10x the HF default, so that
  attention and the MLP move the residual stream as much as the token embedding does
  and the next token depends on the context, not only on the last token);
* RMSNorm weights ~ 1 + N(0, 0.2^2), biases ~ N(0, 0.2^2);
* output matrix (``lm_head``, or the shared embedding when tied): random directions with
  log-normal row norms ``exp(ROW_NORM_SIGMA * z)`` (``ROW_NORM_SIGMA`` = 0.5), and the
  EOS row at ``EOS_ROW_NORM`` (2x) the RMS row norm so greedy output contains EOS now and
  then (about one 24-token continuation in four);
* the final norm weight is scaled so the logits have a standard deviation of about
  ``LOGIT_STD`` (4) over the vocabulary.  Scaling the norm rather than a tied embedding
  keeps the residual stream from being dominated by the token embedding (tied models then
  just repeat the last token).

Separation of the top-2 logits
------------------------------
Scaling logits does not change *relative* top-1/top-2 gaps (float rounding errors scale
with them), and with continuous random logits some steps always have small gaps: over
random prompts about 4% of greedy steps have ``(top1 - top2) / max|logits|`` < 1e-2 and
0.2-0.5% have < 1e-3, whatever the scale.  So no fixed design guarantees 1e-2 on every
step; instead the seeds (weights: 0; prompts: fixed per test) are such that every greedy
step the tests compare has a relative margin above ``MIN_REL_MARGIN`` = 1e-4, and each
test's oracle fixture asserts it.  Measured (seed 0, transformers 5.23): parity prompts
min 1.8e-3 (qwen3) to 3.3e-3 (qwen2); the other tests' prompts >= 9.5e-4.
float32 differences between transformers and a paged engine, or between two schedules of
the same engine, are ~1e-6 relative (transformers' own cached decode vs full forward:
1-3e-6; sdpa vs eager: 4-8e-7), so the smallest margin is >= 100x the noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

VOCAB_SIZE = 512
HIDDEN = 64
LAYERS = 2
INTERMEDIATE = 128
MAX_POS = 2048
INIT_STD = 0.2
LOGIT_STD = 4.0
# Norm of the EOS row of the output matrix relative to the root-mean-square row norm, so
# that greedy generation does produce EOS now and then (see the ignore_eos tests).
EOS_ROW_NORM = 2.0
ROW_NORM_SIGMA = 0.5
# The engine tests assert that every greedy step of their oracle has
# (top1 - top2) / max|logit| above this.  float32 engine-vs-transformers differences are
# around 1e-6 relative, so this leaves a safety factor of >= 100.
MIN_REL_MARGIN = 1e-4

SLIDING_WINDOW = 48  # the sliding-window kinds' window: parity prompts run to 1030 tokens
KINDS = ("llama", "mistral", "qwen2", "qwen3", "llama_mha_tied", "qwen3_moe", "mistral_swa", "gemma3", "gemma4",
         "gemma4_moe")

UNK, BOS, EOS, PAD, IM_START, IM_END = "<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD, IM_START, IM_END]
UNK_ID, BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(6)
# First id of an ordinary word; random-id prompts draw from [FIRST_WORD_ID, VOCAB_SIZE).
FIRST_WORD_ID = len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }} {{ message['content'] }}<|im_end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)

_ENGLISH = (
    "system user assistant you are a helpful hello hi world what is the capital of france paris "
    "how do i tell me story please yes no and or to in on it be this that with for as at by from "
    "cat dog tree sun moon sea sky red blue green one two three four five six seven eight nine ten "
    ". , ? !"
).split()


def _vocab_words() -> list[str]:
    """Deterministic list of ``VOCAB_SIZE - len(SPECIAL_TOKENS)`` distinct lowercase words."""
    words: list[str] = []
    seen: set[str] = set()
    for w in _ENGLISH:
        if w not in seen:
            seen.add(w)
            words.append(w)
    consonants = "bdfgklmnprstvz"
    vowels = "aeiou"
    syllables = [c + v for c in consonants for v in vowels]  # 70
    need = VOCAB_SIZE - len(SPECIAL_TOKENS)
    for a in syllables:
        for b in syllables:
            if len(words) >= need:
                break
            w = a + b
            if w not in seen:
                seen.add(w)
                words.append(w)
        if len(words) >= need:
            break
    assert len(words) == need
    return words


# A reasoning model's markers (``build_tokenizer(think=True)``): the last two ids, ordinary
# (not special) added tokens, as in Qwen3's and DeepSeek-R1's tokenizers.
THINK, END_THINK = "<think>", "</think>"
THINK_ID, END_THINK_ID = VOCAB_SIZE - 2, VOCAB_SIZE - 1
# DeepSeek-R1's way: the generation prompt opens the thinking section.
THINK_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("<|im_start|>assistant{% endif %}",
                                            "<|im_start|>assistant <think>{% endif %}")


def build_tokenizer(think: bool = False):
    """A WordLevel tokenizer over a generated 512-token vocabulary.

    Text is lower-cased and split on whitespace and punctuation; decoding joins tokens with
    single spaces, so ``encode(decode(ids)) == ids`` for any ids of ordinary words.
    ``think``: the last two words are ``<think>`` and ``</think>`` and the chat template's
    generation prompt ends with ``<think>``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = _vocab_words()
    if think:
        words[-2:] = [THINK, END_THINK]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # WordPiece decoder: joins with " " (no token starts with "##"); no clean-up, so the
    # text of n tokens is exactly the n words joined by spaces.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(SPECIAL_TOKENS)
    if think:  # matched before pre-tokenization (which would split off "<" and ">")
        tok.add_tokens([AddedToken(w, normalized=False, special=False) for w in (THINK, END_THINK)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=THINK_CHAT_TEMPLATE if think else CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POS,
    )
    assert len(fast) == VOCAB_SIZE, len(fast)
    return fast


def _config(kind: str, vocab_size: int, overrides: dict):
    from transformers import (Gemma3TextConfig, Gemma4TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,
                              Qwen3MoeConfig)

    common = dict(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        # transformers 5: rope settings live in `rope_parameters` (rope_theta included);
        # there is no top-level `rope_theta`, and `rope_scaling` is only a legacy alias.
        cfg = dict(
            common,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
        cls = LlamaConfig
    elif kind == "llama_mha_tied":
        cfg = dict(common, num_key_value_heads=4, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls = LlamaConfig
    elif kind == "mistral":
        cfg = dict(common, sliding_window=None,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls = MistralConfig
    elif kind == "mistral_swa":  # every layer attends to its last 48 keys only
        cfg = dict(common, sliding_window=SLIDING_WINDOW, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls = MistralConfig
    elif kind == "qwen3_swa":  # layer 0 full attention, layer 1 a sliding window (transformers' layer_types)
        cfg = dict(common, head_dim=32, attention_bias=False, use_sliding_window=True, sliding_window=SLIDING_WINDOW,
                   max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        cls = Qwen3Config
    elif kind == "gemma3":  # layer 0 sliding (window 48), layer 1 full; linear rope scaling on the full layer
        cfg = dict(common, head_dim=32, query_pre_attn_scalar=24, sliding_window=SLIDING_WINDOW,
                   layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
                   final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})
        cls = Gemma3TextConfig
    elif kind in ("gemma4", "gemma4_moe"):
        sliding, full = "sliding_attention", "full_attention"
        cfg = dict(common, head_dim=16, global_head_dim=32, sliding_window=SLIDING_WINDOW,  # untied: tied, the random
                   # residual stream is its own token and greedy decoding repeats it
                   final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=vocab_size,
                   rope_parameters={sliding: {"rope_type": "default", "rope_theta": 10000.0},
                                    full: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1000000.0}})
        if kind == "gemma4":
            cfg.update(num_hidden_layers=5, layer_types=[sliding, sliding, full, sliding, full],
                       attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=2,
                       use_double_wide_mlp=True)
        else:
            cfg.update(num_hidden_layers=4, layer_types=[sliding, full] * 2, enable_moe_block=True, num_experts=4,
                       top_k_experts=2, moe_intermediate_size=INTERMEDIATE // 2)
        cls = Gemma4TextConfig
    elif kind == "qwen2":
        cfg = dict(common, tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        cls = Qwen2Config
    elif kind == "qwen3":
        cfg = dict(common, head_dim=32, attention_bias=False, use_sliding_window=False,
                   sliding_window=None,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        cls = Qwen3Config
    elif kind == "qwen3_moe":
        # 4 experts, 2 active, the last layer dense (mlp_only_layers): both MLP kinds are exercised.
        cfg = dict(common, head_dim=32, attention_bias=False, use_sliding_window=False, sliding_window=None,
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=INTERMEDIATE // 2,
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[LAYERS - 1],
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        cls = Qwen3MoeConfig
    else:
        raise ValueError(f"unknown checkpoint kind {kind!r}; known: {KINDS}")
    cfg.update(overrides)
    return cls(**cfg)


_MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "llama_mha_tied": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral_swa": "MistralForCausalLM",
    "qwen3_swa": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "gemma4_moe": "Gemma4ForCausalLM",
}


@torch.no_grad()
def _randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)

    def randn(shape):
        return torch.randn(shape, generator=g, dtype=torch.float32)

    for name, b in model.named_buffers():  # Gemma 4's learned per-layer output scale
        if name.endswith("layer_scalar"):
            b.copy_(1.0 + 0.2 * randn(b.shape))
    out = model.get_output_embeddings().weight
    emb = model.get_input_embeddings().weight
    tied = out.data_ptr() == emb.data_ptr()
    for name, p in model.named_parameters():  # tied parameters are listed once
        if p is out:
            continue
        if "norm" in name and name.endswith("weight"):
            p.copy_(1.0 + INIT_STD * randn(p.shape))
        elif name.endswith(("mlp.gate.weight", "router.proj.weight")):  # MoE routers: logits far enough apart
            p.copy_(randn(p.shape) / p.shape[1] ** 0.5)             # that routing matters
        elif name.endswith(("router.scale", "router.per_expert_scale")):
            p.copy_(1.0 + 0.2 * randn(p.shape))
        else:  # linear and embedding weights, biases (qwen2 q/k/v)
            p.copy_(INIT_STD * randn(p.shape))
    # Output matrix: random directions with log-normal row norms (mean square norm equal
    # to an ordinary INIT_STD row's, HIDDEN * INIT_STD^2).  The final norm weight is then
    # scaled so that the logits have a standard deviation of about LOGIT_STD: the
    # final-normed hidden state h has |h| ~ sqrt(HIDDEN) * |g| / sqrt(HIDDEN), so
    # <row, h> ~ N(0, |row|^2 * mean(g^2)).  Scaling the norm weight rather than the
    # output matrix keeps a tied embedding at an ordinary size, so the residual stream is
    # not dominated by the token embedding (which makes tied models repeat the last token).
    base = randn(out.shape)
    rows = torch.exp(ROW_NORM_SIGMA * randn((out.shape[0], 1)))
    rows = rows / rows.pow(2).mean().sqrt()
    rows[EOS_ID] = EOS_ROW_NORM
    base = base / base.norm(dim=1, keepdim=True) * rows * (INIT_STD * HIDDEN ** 0.5)
    out.copy_(base)
    final_norm = model.model.norm.weight
    g = final_norm.pow(2).mean().sqrt()
    final_norm.mul_(LOGIT_STD / (INIT_STD * HIDDEN ** 0.5 * g))
    if tied:
        assert emb.data_ptr() == out.data_ptr()


def build_checkpoint(kind: str, path: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                     think: bool = False, **overrides) -> Path:
    """Write a random-weight checkpoint of ``kind`` to ``path`` and return ``path``.

    ``overrides`` replace config fields (e.g. ``num_hidden_layers=1``).  ``seed`` fixes the
    weights.  The same (kind, seed, dtype, overrides) always gives the same files.
    ``think``: a reasoning model's tokenizer and template (``build_tokenizer(think=True)``).
    """
    import transformers
    from transformers import GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(think)
    config = _config(kind, len(tokenizer), dict(overrides))
    if kind == "llama" and "rope_parameters" not in overrides:
        assert config.rope_parameters["rope_type"] == "llama3", config.rope_parameters
    cls = getattr(transformers, _MODEL_CLASSES[kind])
    torch.manual_seed(seed)
    model = cls(config)
    model.eval()
    _randomize(model, seed)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    # sanity: the architecture and dtype recorded are the ones we intended
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [_MODEL_CLASSES[kind]], cfg["architectures"]
    return path


# --------------------------------------------------------------------------- oracle helpers


def load_hf(path: Path, dtype: torch.dtype = torch.float32):
    """Load a checkpoint with transformers (the oracle), eval mode, sdpa attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    return model


@torch.no_grad()
def hf_last_logits(model, prompt_ids: Sequence[int]) -> torch.Tensor:
    """float32 ``[vocab]`` logits after the full prompt (no padding, no cache)."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)
    return model(input_ids=ids).logits[0, -1].float().cpu()


@torch.no_grad()
def hf_greedy(model, prompt_ids: Sequence[int], max_new_tokens: int, *, return_scores: bool = False):
    """transformers' greedy ``generate`` on one prompt, no padding, EOS never stops it.

    Returns the generated ids (and, with ``return_scores``, the raw logits of every step).
    """
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)
    # transformers 5: eos_token_id=None falls back to the model's generation_config (and
    # stops at EOS); an empty list really disables stopping.  min_new_tokens is left at 0
    # so no logits processor touches the EOS logit.
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=[],
        pad_token_id=PAD_ID,
        output_logits=True,
        return_dict_in_generate=True,
    )
    toks = out.sequences[0, ids.shape[1]:].tolist()
    assert len(toks) == max_new_tokens, (len(toks), max_new_tokens)
    if return_scores:
        return toks, [s[0].float().cpu() for s in out.logits]
    return toks


def relative_margin(logits: torch.Tensor) -> float:
    """``(top1 - top2) / max|logits|`` of one logits vector (masked ``-inf`` entries, as in
    processed scores, are left out)."""
    x = logits.float()
    x = x[torch.isfinite(x)]
    top = torch.topk(x, 2).values
    return float((top[0] - top[1]) / x.abs().max())


def random_prompt(length: int, seed: int) -> list[int]:
    """``length`` random ids of ordinary words (no special tokens), deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_WORD_ID, VOCAB_SIZE, (length,), generator=g).tolist()


# --------------------------------------------------------------------------- EAGLE-3 drafts


def build_eagle3_draft(target: Path, path: Path, *, seed: int = 0, draft_vocab_size: int | None = None,
                       aux_layer_ids: Sequence[int] | None = None, norm_before_residual: bool = False,
                       own_embedding: bool = True) -> Path:
    """A random-weight EAGLE-3 draft for the checkpoint at ``target``, laid out as
    ``speculators`` 0.9 saves one (config.json keys and tensor names; checked against
    ``Eagle3DraftModel.save_pretrained``): one Llama layer whose q/k/v read 2 * hidden, ``fc``
    over len(aux) * hidden, ``lm_head`` over ``draft_vocab_size`` ids (the first ones of the
    target's vocabulary, with ``d2t``/``t2d`` when it is smaller)."""
    from safetensors.torch import save_file

    tcfg = json.loads((Path(target) / "config.json").read_text())
    h, vocab = tcfg["hidden_size"], tcfg["vocab_size"]
    heads, kv_heads = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    head_dim = tcfg.get("head_dim") or h // heads
    inter, n_layers = tcfg["intermediate_size"], tcfg["num_hidden_layers"]
    # vLLM's default (2, N//2, N-3), kept below N: a 2-layer test target gets [0, 1]
    aux = list(aux_layer_ids) if aux_layer_ids is not None else sorted({min(2, n_layers - 1), n_layers // 2,
                                                                         max(n_layers - 3, 0)})
    dv = draft_vocab_size or vocab
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=INIT_STD):
        return torch.randn(*shape, generator=g) * std

    def norm_w(n):
        return 1 + randn(n)

    w = {
        "fc.weight": randn(h, len(aux) * h),
        "layers.0.hidden_norm.weight": norm_w(h),
        "layers.0.input_layernorm.weight": norm_w(h),
        "layers.0.self_attn.q_proj.weight": randn(heads * head_dim, 2 * h),
        "layers.0.self_attn.k_proj.weight": randn(kv_heads * head_dim, 2 * h),
        "layers.0.self_attn.v_proj.weight": randn(kv_heads * head_dim, 2 * h),
        "layers.0.self_attn.o_proj.weight": randn(h, heads * head_dim),
        "layers.0.post_attention_layernorm.weight": norm_w(h),
        "layers.0.mlp.gate_proj.weight": randn(inter, h),
        "layers.0.mlp.up_proj.weight": randn(inter, h),
        "layers.0.mlp.down_proj.weight": randn(h, inter),
        "norm.weight": norm_w(h),
        "lm_head.weight": randn(dv, h, std=LOGIT_STD / h ** 0.5),
    }
    if own_embedding:
        w["embed_tokens.weight"] = randn(vocab, h)
    if dv < vocab:
        w["d2t"] = torch.zeros(dv, dtype=torch.long)  # draft id d is target id d (+ 0)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[:dv] = True
        w["t2d"] = t2d
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    rope = tcfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": tcfg.get("rope_theta", 10000.0)}
    config = {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "draft_vocab_size": dv, "target_hidden_size": None, "norm_before_residual": norm_before_residual,
        "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
        "tie_word_embeddings": False, "dtype": "float32", "eagle_aux_hidden_state_layer_ids": aux,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"architectures": tcfg["architectures"], "name_or_path": str(target)}},
        "transformer_layer_config": {
            "model_type": "llama", "vocab_size": vocab, "hidden_size": h, "intermediate_size": inter,
            "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": head_dim, "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6), "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "max_position_embeddings": tcfg["max_position_embeddings"], "rope_parameters": rope},
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
