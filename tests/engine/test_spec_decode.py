"""Speculative decoding in the engine (issue 15).

Oracles: the same engine with speculation off (itself token-identical to transformers, the
parity suite), transformers' exact next-token distributions for the sampling test, and prefix
caching / offload off for the KV that accepted proposals leave behind.

Random-weight checkpoints rarely repeat themselves, so n-gram lookup alone accepts little; the
`OracleProposer` proposes the known continuation with a share of tokens made wrong, which drives
every acceptance length (0..k) through the engine, including stops inside an accepted run.
"""
from __future__ import annotations

import random

import pytest
import torch

from checkpoints import build_checkpoint, build_eagle3_draft, load_hf, random_prompt
from engine import LLM, SamplingParams
from engine.spec.config import SpeculativeConfig, parse_speculative_config
from engine.spec.decode import Proposal

KIND = "llama"
K = 4


def ngram(k: int = K) -> dict:
    # Every proposal made, whatever it costs (adaptive lengths are tested on their own below).
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "adaptive": False}


class OracleProposer:
    """Proposes each request's reference continuation; each token is replaced by a wrong one with
    probability `error`."""

    needs_lookahead = False

    def __init__(self, ref: dict[tuple[int, ...], list[int]], error: float, vocab: int, seed: int = 0) -> None:
        self.ref, self.error, self.vocab = ref, error, vocab
        self.rng = random.Random(seed)

    def release(self, req_id):
        pass

    def propose(self, reqs, limits, tokens):
        out = []
        for r, n, seq in zip(reqs, limits, tokens):
            cont = self.ref.get(tuple(r.prompt_token_ids), [])
            done = len(seq) - r.num_prompt_tokens
            toks = [t if self.rng.random() >= self.error else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                    for t in cont[done:done + n]]
            out.append(Proposal(tuple(toks)))
        return out


def _llm(ckpt: str, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks", 256)
    return LLM(ckpt, block_size=16, speculative_config=spec, **kw)


def _generate(llm: LLM, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _summary(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def _repetitive(n: int, seed: int) -> list[int]:
    """A prompt that repeats itself, so n-gram lookup finds proposals."""
    base = random_prompt(24 + seed % 7, seed)
    return (base * 4)[:n]


@pytest.fixture(scope="module")
def drafts(ckpt_dir, tmp_path_factory):
    """Draft checkpoints for the target KIND: `same` (the target's weights: every greedy proposal
    is right) and `other` (a smaller model with other random weights, the same tokenizer)."""
    root = tmp_path_factory.mktemp("drafts")
    return {"same": str(ckpt_dir(KIND)),
            "other": str(build_checkpoint(KIND, root / "other", seed=1, num_hidden_layers=1))}


def _spec(method: str, drafts: dict) -> dict:
    if method == "ngram":
        return ngram()
    return {"method": "draft_model", "model": drafts[method.split("-")[1]], "num_speculative_tokens": 3,
            "adaptive": False}


@pytest.mark.parametrize("method", ["ngram", "draft-same", "draft-other"])
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_greedy_identical_with_prefix_caching_and_offload(ckpt_dir, drafts, method, batch, asynchronous):
    """With async scheduling, proposals follow tokens not yet applied and the next step is
    planned before verification says where it starts (EngineCore._speculate)."""
    ckpt = str(ckpt_dir(KIND))
    prompts = [_repetitive(70 + 3 * i, 100 + i % 8) for i in range(batch)]  # shared prefixes: G1 hits
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # G1 tight enough to preempt at batch 32 (requests waiting for a shared prefix being computed hold no blocks)
    kw = dict(kv_offloading_size=0.01, num_gpu_blocks=96)
    with _llm(ckpt, **kw) as off:
        ref = _summary(_generate(off, prompts, params))
        again = _summary(_generate(off, prompts, params))  # the second pass hits G1 and G2
    with _llm(ckpt, _spec(method, drafts), async_scheduling=asynchronous, **kw) as on:
        got = _summary(_generate(on, prompts, params))
        got_again = _summary(_generate(on, prompts, params))
        on.engine.flush_offload()
        on.engine.check_integrity()
        sd = on.get_stats().spec_decode
        preempted = on.get_stats().num_preemptions
    assert got == ref and got_again == again == ref
    assert sd["num_drafts"] > 0, sd
    assert 0 <= sd["acceptance_rate"] <= 1 and sum(sd["accepted_per_pos"]) == sd["num_accepted_tokens"]
    if method == "ngram":
        assert sd["num_accepted_tokens"] > 0, sd
    if method == "draft-same":  # the target as its own draft: what it proposes is what it would emit
        assert sd["acceptance_rate"] > 0.95, sd
    if batch == 32:
        assert preempted > 0


def _stop_cases(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts and params whose reference outputs end every way a request can end."""
    g = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    probe = [random_prompt(30 + 7 * i, 300 + i) for i in range(16)]
    free = _generate(llm, probe, SamplingParams(temperature=0.0, max_tokens=40))
    eos = [p for p, o in zip(probe, free) if o.outputs[0].finish_reason == "stop" and len(o.outputs[0].token_ids) > 3]
    assert len(eos) >= 2, "no prompt whose greedy output reaches EOS"
    plain = _generate(llm, probe[:2], g)
    words = plain[0].outputs[0].text.split()
    cases = [
        (probe[0], g),
        (eos[0], SamplingParams(temperature=0.0, max_tokens=60)),  # EOS inside an accepted run
        (eos[1], SamplingParams(temperature=0.0, max_tokens=60, min_tokens=len(free[probe.index(eos[1])]
                                                                            .outputs[0].token_ids) + 2)),
        (probe[1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                  stop_token_ids=[plain[1].outputs[0].token_ids[17]])),
        (probe[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[" ".join(words[9:11])])),
        (probe[2], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)),
        (probe[3], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)),
        (probe[4], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, logprobs=2)),
        (probe[5], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3)),
    ]
    return [c[0] for c in cases], [c[1] for c in cases]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_every_acceptance_length_gives_identical_outputs(ckpt_dir, asynchronous):
    """Stops, max_tokens, min_tokens, logprobs and penalties behave as without speculation when
    the proposals are long runs of right tokens with wrong ones among them."""
    ckpt = str(ckpt_dir(KIND))
    with _llm(ckpt) as off:
        prompts, params = _stop_cases(off)
        ref = [_generate(off, [p], sp)[0] for p, sp in zip(prompts, params)]
    reasons = [o.outputs[0].finish_reason for o in ref]
    assert [reasons[i] for i in (1, 3, 4)] == ["stop"] * 3, reasons
    assert len(ref[2].outputs[0].token_ids) >= params[2].min_tokens  # min_tokens held EOS back
    for error in (0.0, 0.3):
        with _llm(ckpt, ngram(), async_scheduling=asynchronous) as on:
            got = []
            for p, sp, r in zip(prompts, params, ref):  # one at a time: probe[0] runs twice
                on.engine.spec.proposer = OracleProposer({tuple(p): r.outputs[0].token_ids}, error, 512, seed=len(got))
                got += _generate(on, [p], sp)
            on.engine.check_integrity()
            sd = on.get_stats().spec_decode
        assert _summary(got) == _summary(ref), f"error={error}"
        for g, r in zip(got, ref):  # the target's logprobs for accepted tokens
            lp_g, lp_r = g.outputs[0].logprobs, r.outputs[0].logprobs
            assert (lp_g is None) == (lp_r is None)
            for a, b in zip(lp_g or (), lp_r or ()):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
        if error == 0.0:  # whole proposals accepted: 5 tokens a step
            assert sd["accepted_per_pos"][K - 1] > 0 and sd["mean_acceptance_length"] > 3, sd
        else:
            assert 0 < sd["acceptance_rate"] < 0.9, sd


def test_penalised_requests_get_no_proposals(ckpt_dir):
    ckpt = str(ckpt_dir(KIND))
    with _llm(ckpt, ngram()) as on:
        _generate(on, [_repetitive(80, 5)], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                           repetition_penalty=1.2))
        assert on.get_stats().spec_decode["num_drafts"] == 0


def test_only_accepted_tokens_reach_prefix_cache_and_offload(ckpt_dir):
    """Continuing a speculated request from its output must hit G1 and, after G1 is flushed, G2
    on blocks that hold generated tokens, and give what a fresh engine without any cache gives."""
    ckpt = str(ckpt_dir(KIND))
    prompts = [random_prompt(n, 500 + n) for n in (40, 75, 100)]
    params = SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True)
    with _llm(ckpt) as off:
        first = _generate(off, prompts, params)
    continuation = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, first)}
    longer = [p + o.outputs[0].token_ids[:-1] for p, o in zip(prompts, first)]  # 84, 119, 144 tokens
    follow = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with _llm(ckpt, enable_prefix_caching=False) as fresh:
        expect = _summary(_generate(fresh, longer, follow))
    with _llm(ckpt, ngram(), kv_offloading_size=0.01, num_gpu_blocks=40) as on:
        on.engine.spec.proposer = OracleProposer(continuation, 0.4, 512, seed=3)
        assert _summary(_generate(on, prompts, params)) == _summary(first)
        assert on.get_stats().spec_decode["num_accepted_tokens"] > 20
        g1 = _generate(on, longer, follow)
        assert _summary(g1) == expect
        assert [o.num_cached_tokens for o in g1] == [(len(p) - 1) // 16 * 16 for p in longer]
        on.engine.flush_offload()
        _generate(on, [random_prompt(600, 9)], SamplingParams(temperature=0.0, max_tokens=1))  # evicts G1
        on.engine.flush_offload()
        g2 = _generate(on, longer, follow)
        on.engine.check_integrity()
    assert _summary(g2) == expect
    # an offload hit may end one token short of a full last block (that token is recomputed)
    assert [o.cached_tokens_by_tier.get("G2", 0) for o in g2] == [min(len(p) // 16 * 16, len(p) - 1) for p in longer]


def test_seeded_sampling_does_not_depend_on_the_batch(ckpt_dir):
    ckpt = str(ckpt_dir(KIND))
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True, seed=7)
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    prompt = _repetitive(60, 11)
    with _llm(ckpt, ngram()) as on:
        alone = _generate(on, [prompt], seeded)[0].outputs[0].token_ids
    with _llm(ckpt, ngram()) as on:
        mixed = _generate(on, [_repetitive(50, 12), prompt, _repetitive(70, 13)], [other, seeded, other])
    assert mixed[1].outputs[0].token_ids == alone


# -- the output distribution ---------------------------------------------------------------
VOCAB = 8
SAMPLES = 20_000
MAX_TOKENS = 4  # after the first token, 2 proposals and a bonus token


class RandomDraft:
    """A deliberately bad draft: draws its tokens from a random distribution per position (or,
    with `point_mass`, from one fixed skewed distribution, proposing them as if certain: a
    uniform point-mass draft would hide some verification bugs, whose errors then cancel)."""

    needs_lookahead = False

    def __init__(self, point_mass: bool, seed: int) -> None:
        self.point_mass = point_mass
        self.gen = torch.Generator().manual_seed(seed)
        self.fixed = torch.softmax(2 * torch.randn(VOCAB, generator=self.gen), dim=0)
        self.dirichlet = torch.distributions.Dirichlet(torch.full((VOCAB,), 0.5))

    def release(self, req_id):
        pass

    def propose(self, reqs, limits, tokens):
        total = sum(limits)  # the whole step's proposals drawn at once, then split per request
        if not total:
            return [Proposal(()) for _ in limits]
        if self.point_mass:
            toks = torch.multinomial(self.fixed, total, replacement=True, generator=self.gen).split(limits)
            return [Proposal(tuple(t.tolist())) for t in toks]
        q = self.dirichlet.sample((total,))
        toks = torch.multinomial(q, 1, generator=self.gen).squeeze(1)
        return [Proposal(tuple(t.tolist()), qi) for t, qi in zip(toks.split(limits), q.split(limits))]


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """A checkpoint with an 8-token vocabulary, and transformers' exact distribution over its
    first MAX_TOKENS sampled tokens (temperature 1) after PROMPT."""
    path = build_checkpoint(KIND, tmp_path_factory.mktemp("tiny") / "ckpt", vocab_size=VOCAB)
    hf = load_hf(path)
    prompt = [3, 6, 1, 7, 5]
    probs = torch.ones(1)
    seqs = torch.empty(1, 0, dtype=torch.long)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids = torch.cat([torch.tensor(prompt).expand(seqs.shape[0], -1), seqs], dim=1)
            p = torch.softmax(hf(input_ids=ids).logits[:, -1].double(), dim=-1)  # [n, V]
            probs = (probs[:, None] * p).reshape(-1)
            seqs = torch.cat([seqs.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(seqs.shape[0])[:, None]], 1)
    return str(path), prompt, probs  # probs[i]: sequence i in base-VOCAB order


def _counts(llm: LLM, prompt: list[int], temperature: float = 1.0) -> torch.Tensor:
    params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt}] * SAMPLES, params, use_tqdm=False)
    index = torch.zeros(SAMPLES, dtype=torch.long)
    for i, o in enumerate(outs):
        for t in o.outputs[0].token_ids:
            index[i] = index[i] * VOCAB + t
    return torch.bincount(index, minlength=VOCAB ** MAX_TOKENS).double()


def _chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test, cells with an expected count under 5 pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))


def _sampling_llm(path: str, spec: dict | None, **kw) -> LLM:
    return LLM(path, block_size=16, num_gpu_blocks=2048, max_num_seqs=256, speculative_config=spec, seed=1, **kw)


@pytest.mark.parametrize("draft", ["none", "point_mass", "distribution", "draft_model", "draft_model_async"])
def test_sampled_outputs_follow_the_targets_distribution(tiny_vocab, tmp_path, draft):
    path, prompt, probs = tiny_vocab
    spec = None if draft == "none" else ngram(2)
    if draft.startswith("draft_model"):  # a real draft: other weights, its own distribution as q
        other = build_checkpoint(KIND, tmp_path / "draft", seed=3, vocab_size=VOCAB, num_hidden_layers=1)
        spec = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2, "adaptive": False}
    with _sampling_llm(path, spec, async_scheduling=draft.endswith("async")) as llm:
        if draft in ("point_mass", "distribution"):
            llm.engine.spec.proposer = RandomDraft(draft == "point_mass", seed=5)
        counts = _counts(llm, prompt)
        sd = llm.get_stats().spec_decode
    p = _chi2_p(counts, probs)
    # At 0.001 each, a correct sampler fails one of the five cases 0.5% of the time (at 0.01 it was
    # 5%: seed 1 gave p=0.008 for draft_model after the CPU's draw changed, seeds 2-5 0.14-0.82);
    # the test below shows that a real change in the distribution lands far beyond it.
    assert p > 0.001, f"chi-square p={p:.2g} with draft={draft}"
    if draft != "none":
        assert sd["num_draft_tokens"] >= SAMPLES and 0 < sd["acceptance_rate"] < 1, sd


def test_the_distribution_test_detects_a_wrong_distribution(tiny_vocab):
    """The chi-square above has the power to see a modest change: temperature 1.15 fails it."""
    path, prompt, probs = tiny_vocab
    with _sampling_llm(path, None) as llm:
        assert _chi2_p(_counts(llm, prompt, temperature=1.15), probs) < 1e-6


# -- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, message", [
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "'model' not supported for method 'ngram'"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "'medusa' is not supported"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
    ('{"method": ', "not valid JSON"),
])
def test_bad_speculative_configs_are_refused(cfg, message):
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(cfg)


def test_ngram_defaults_follow_vllm():
    _, spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert spec == SpeculativeConfig(spec.method, 3, 4, 4)
    _, spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)


# -- EAGLE-3 -----------------------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _eagle3_reference(draft_dir, hf, seq: list[int], n: int) -> list[int]:
    """Greedy EAGLE-3 proposals after `seq`, the plain way: the target's aux features from
    transformers' hidden states (hs[l] = the residual stream entering layer l), row t = (fc(g_t),
    token t+1), causal attention recomputed over every row, the output fed back for later rows,
    draft ids mapped through d2t. No cache, no paging: the oracle for the engine's proposer."""
    import json

    from safetensors.torch import load_file
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers import LlamaConfig

    cfg = json.loads((draft_dir / "config.json").read_text())
    W = {k.removeprefix("layers.0."): v.double() if v.is_floating_point() else v
         for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
    tl = cfg["transformer_layer_config"]
    nh, nkv, hd, eps = tl["num_attention_heads"], tl["num_key_value_heads"], tl["head_dim"], tl["rms_norm_eps"]
    inv, scale = ROPE_INIT_FUNCTIONS[tl["rope_parameters"]["rope_type"]](LlamaConfig(**{k: v for k, v in tl.items()
                                                                                        if k != "model_type"}), "cpu")
    with torch.no_grad():
        hs = hf(input_ids=torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states
    g = torch.cat([hs[i][0].double() for i in cfg["eagle_aux_hidden_state_layer_ids"]], -1)
    hidden = g @ W["fc.weight"].T  # rows 0..T-2
    tokens = list(seq[1:])  # the token after each row's position
    emb = W.get("embed_tokens.weight")
    if emb is None:
        emb = hf.model.embed_tokens.weight.double()
    d2t = W.get("d2t", torch.zeros(W["lm_head.weight"].shape[0], dtype=torch.long))
    out_tokens: list[int] = []
    for _ in range(n):
        m = hidden.shape[0]
        pos = torch.arange(m).double()
        f = pos[:, None] * inv.double()[None]
        cos, sin = (torch.cat([f, f], -1).cos() * scale)[:, None], (torch.cat([f, f], -1).sin() * scale)[:, None]
        hn = _rms(hidden, W["hidden_norm.weight"], eps)
        resid = hn if cfg["norm_before_residual"] else hidden
        x = torch.cat([_rms(emb[torch.tensor(tokens)], W["input_layernorm.weight"], eps), hn], -1)
        q, k, v = ((x @ W[f"self_attn.{p}_proj.weight"].T).view(m, -1, hd) for p in "qkv")

        def rope(t):
            return t * cos + torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], -1) * sin
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
        s = s.masked_fill(torch.ones(m, m, dtype=torch.bool).triu(1), float("-inf"))
        a = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(m, -1) @ W["self_attn.o_proj.weight"].T
        h = resid + a
        y = _rms(h, W["post_attention_layernorm.weight"], eps)
        out = h + (torch.nn.functional.silu(y @ W["mlp.gate_proj.weight"].T) * (y @ W["mlp.up_proj.weight"].T)) \
            @ W["mlp.down_proj.weight"].T
        d = int((_rms(out[-1], W["norm.weight"], eps) @ W["lm_head.weight"].T).argmax())
        out_tokens.append(d + int(d2t[d]))
        hidden = torch.cat([hidden, out[-1:]])
        tokens.append(out_tokens[-1])
    return out_tokens


class _Recorder:
    """Wraps a proposer and records (sequence, proposal) pairs."""

    def __init__(self, inner) -> None:
        self.inner, self.seen = inner, []
        self.needs_lookahead = inner.needs_lookahead

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, reqs, limits, tokens):
        props = self.inner.propose(reqs, limits, tokens)
        self.seen += [(list(seq), p.token_ids) for seq, p in zip(tokens, props) if p.token_ids]
        return props


@pytest.mark.parametrize("variant", [dict(), dict(draft_vocab_size=300, norm_before_residual=True, own_embedding=False),
                                     dict(lazy=True), dict(asynchronous=True)])
def test_eagle3_proposals_match_a_plain_reference(ckpt_dir, hf_model, tmp_path, variant):
    """The engine's EAGLE-3 proposals (paged draft KV written step by step, first passes over
    accepted positions, prefix hits; with `lazy`, requests proposing only every third step, so
    first passes cover several steps' positions) equal proposals recomputed from scratch from
    transformers' hidden states; and outputs equal speculation off."""
    variant = dict(variant)
    lazy = variant.pop("lazy", False)
    asynchronous = variant.pop("asynchronous", False)  # proposals from tokens not applied yet
    ckpt = ckpt_dir(KIND)
    draft = build_eagle3_draft(ckpt, tmp_path / "eagle", seed=4, **variant)
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    prompts = [_repetitive(60, 21), _repetitive(60, 21)[:50] + random_prompt(12, 22), random_prompt(37, 23)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with _llm(str(ckpt)) as off:
        ref = _summary(_generate(off, prompts, params))
    with _llm(str(ckpt), spec, max_num_batched_tokens=48,  # chunked prompts: first passes per chunk
              async_scheduling=asynchronous) as on:
        rec = _Recorder(on.engine.spec.proposer)
        on.engine.spec.proposer = rec
        if lazy:
            calls = iter(range(10**6))
            on.engine.spec.adaptive = True
            on.engine.spec.budget.lengths = lambda ids, limits: [n if (next(calls) % 3 == 0) else 0 for n in limits]
        got = _summary(_generate(on, prompts, params))
        on.engine.check_integrity()
    assert got == ref
    assert len(rec.seen) > (10 if lazy else 30)
    hf = hf_model(KIND)
    for seq, proposal in rec.seen[::5]:
        assert list(proposal) == _eagle3_reference(draft, hf, seq, len(proposal)), len(seq)


@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_eagle3_greedy_identical_with_offload(ckpt_dir, tmp_path, batch, asynchronous):
    ckpt = str(ckpt_dir(KIND))
    draft = build_eagle3_draft(ckpt_dir(KIND), tmp_path / "eagle", seed=5)
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    prompts = [_repetitive(70 + 3 * i, 100 + i % 8) for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kw = dict(kv_offloading_size=0.01, num_gpu_blocks=160)
    with _llm(ckpt, **kw) as off:
        ref = [_summary(_generate(off, prompts, params)) for _ in range(2)]
    with _llm(ckpt, spec, async_scheduling=asynchronous, **kw) as on:
        got = [_summary(_generate(on, prompts, params)) for _ in range(2)]
        on.engine.check_integrity()
        assert on.get_stats().spec_decode["num_draft_tokens"] > 0
    assert got == ref


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(speculators_model_type="eagle"), "not an EAGLE-3 draft"),
    (lambda c: c.update(norm_output=True), "norm_output"),
    (lambda c: c["transformer_layer_config"].update(vocab_size=1000), "vocabulary"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 0, 1]), "distinct"),
])
def test_bad_eagle3_drafts_are_refused(ckpt_dir, tmp_path, change, message):
    import json

    draft = build_eagle3_draft(ckpt_dir(KIND), tmp_path / "eagle")
    cfg = json.loads((draft / "config.json").read_text())
    change(cfg)
    (draft / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        _llm(str(ckpt_dir(KIND)), {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2})


@pytest.mark.parametrize("method", ["draft-same", "eagle3"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_lookahead_slots_stop_at_max_model_len(ckpt_dir, drafts, tmp_path, method, asynchronous):
    """A request that runs to max_model_len (a whole number of blocks) must not be given
    lookahead slots past it: its block table would outgrow the input batch's row."""
    ckpt = str(ckpt_dir(KIND))
    spec = _spec(method, drafts) if method != "eagle3" else {
        "method": "eagle3", "model": str(build_eagle3_draft(ckpt_dir(KIND), tmp_path / "eagle")),
        "num_speculative_tokens": 4, "adaptive": False}
    prompts = [random_prompt(100, 1), _repetitive(90, 2)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=100)
    with _llm(ckpt, max_model_len=128) as off:
        ref = _summary(_generate(off, prompts, params))
    with _llm(ckpt, spec, max_model_len=128, async_scheduling=asynchronous) as on:
        got = _summary(_generate(on, prompts, params))
    assert got == ref and [len(t) for t, _, _ in got] == [28, 38]


def test_eagle3_reads_the_compiled_models_features(ckpt_dir, tmp_path):
    """-O1: the aux layers come out of the compiled graph; proposals equal the eager engine's."""
    ckpt = str(ckpt_dir(KIND))
    spec = {"method": "eagle3", "model": str(build_eagle3_draft(ckpt_dir(KIND), tmp_path / "eagle", seed=6)),
            "num_speculative_tokens": 3, "adaptive": False}
    prompts = [_repetitive(50, 31), random_prompt(41, 32)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    seen = {}
    for level in (0, 1):
        with _llm(ckpt, spec, optimization_level=level) as llm:
            rec = _Recorder(llm.engine.spec.proposer)
            llm.engine.spec.proposer = rec
            seen[level] = (_summary(_generate(llm, prompts, params)), rec.seen)
    assert seen[0] == seen[1] and len(seen[0][1]) > 10
