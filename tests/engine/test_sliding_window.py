"""Issue 16: sliding-window attention (Mistral's `sliding_window`, Qwen's `layer_types`).
Oracle: transformers' greedy tokens (float32) for prompts below, at and well past the window,
with prompts chunked across the window boundary, with prefix caching off and on (second pass from
cached blocks), on every layer (mistral_swa) and on some layers only (qwen3_swa, gemma3).
test_parity.py runs mistral_swa and gemma3 eagerly and compiled to 1030 tokens."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoints import SLIDING_WINDOW, build_checkpoint, hf_greedy, load_hf, random_prompt

LENGTHS = (5, SLIDING_WINDOW - 1, SLIDING_WINDOW, SLIDING_WINDOW + 1, 3 * SLIDING_WINDOW + 7)


@pytest.fixture(scope="module")
def qwen3_swa(tmp_path_factory):
    return build_checkpoint("qwen3_swa", tmp_path_factory.mktemp("qwen3_swa"))


@pytest.mark.parametrize("kind", ["mistral_swa", "qwen3_swa", "gemma3", "gemma4", "gemma4_moe"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_chunked_sliding_window_prefill_and_decode_equal_transformers(kind, prefix_caching, ckpt_dir, qwen3_swa):
    from engine import LLM, SamplingParams

    path = qwen3_swa if kind == "qwen3_swa" else ckpt_dir(kind)
    windows = LLM(str(path), dtype="float32", num_gpu_blocks=256, max_num_batched_tokens=37,
                  enable_prefix_caching=prefix_caching)
    assert set(windows.engine.model_config.sliding_windows) == ({SLIDING_WINDOW} if kind == "mistral_swa"
                                                                 else {0, SLIDING_WINDOW})
    prompts = [random_prompt(n, 300 + n) for n in LENGTHS]
    hf = load_hf(path)
    want = [list(hf_greedy(hf, p, 2 * SLIDING_WINDOW)) for p in prompts]  # decodes run past the window too
    sp = SamplingParams(temperature=0.0, max_tokens=2 * SLIDING_WINDOW, ignore_eos=True)
    for _ in range(2 if prefix_caching else 1):  # the second pass starts from cached blocks
        outs = windows.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    if prefix_caching:
        assert outs[-1].num_cached_tokens > SLIDING_WINDOW


def test_unknown_layer_types_are_refused(tmp_path):
    from engine import LLM

    path = build_checkpoint("qwen3_swa", tmp_path / "ck")
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = ["full_attention", "chunked_attention"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="chunked_attention"):
        LLM(str(path), dtype="float32", num_gpu_blocks=16)


@pytest.mark.parametrize("key, value", [("hidden_activation", "silu"), ("attn_logit_softcapping", 50.0),
                                        ("use_bidirectional_attention", True)])
def test_gemma3_settings_it_does_not_compute_are_refused(ckpt_dir, tmp_path, key, value):
    import shutil

    from engine import LLM

    path = Path(shutil.copytree(ckpt_dir("gemma3"), tmp_path / "g"))
    cfg = json.loads((path / "config.json").read_text())
    cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=key):
        LLM(str(path), dtype="float32", num_gpu_blocks=16)


def _held_blocks_during(llm, prompts, max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Runs `prompts` greedily step by step; their outputs and, per KV group, the most G1 blocks
    any one request held."""
    from engine import SamplingParams

    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [eng.make_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    for r in reqs:
        eng.add_request(r)
    most = [0] * len(eng.kv.windows)
    while eng.has_unfinished():
        eng.step()
        for g in range(len(most)):
            most[g] = max([most[g]] + [eng.kv.num_held_blocks(r, g) for r in reqs if not r.status.finished])
        eng.check_integrity()
    return [r.output_token_ids for r in reqs], most


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "cache"])
def test_a_model_windowed_on_every_layer_holds_only_its_window_in_g1(ckpt_dir, asynchronous, prefix_caching):
    """mistral_swa (a 48-token window on every layer): a request's G1 blocks stay bounded by the
    window through a long decode, so 8 such requests fit a G1 that would otherwise preempt; the
    tokens are transformers'. With an offload tier too (it stores what the window still holds);
    with one group of every layer kept whole (`disable_hybrid_kv_cache_manager`) the same run
    has to preempt. Without prefix caching a released block is handed out again at once, so a
    block released while still in sight would change the tokens."""
    from engine import LLM

    path = ckpt_dir("mistral_swa")
    prompts = [random_prompt(30 + i, 900 + i) for i in range(8)]
    n_out = 250  # 280 tokens a request: 18 blocks of 16, against a window of 3
    hf = load_hf(path)
    want = [list(hf_greedy(hf, p, n_out)) for p in prompts]
    kw = dict(dtype="float32", block_size=16, num_gpu_blocks=48, max_model_len=320,
              async_scheduling=asynchronous, enable_prefix_caching=prefix_caching)
    with LLM(str(path), **kw) as llm:
        assert llm.engine.kv.windows == (SLIDING_WINDOW,)
        got, (most,) = _held_blocks_during(llm, prompts, n_out)
        assert llm.get_stats().num_preemptions == 0
    assert got == want
    # the window's 3 blocks, the one being written, and one a step may allocate ahead of the release
    assert most <= SLIDING_WINDOW // 16 + 2, most
    if not prefix_caching:
        return  # offload needs prefix caching's block keys
    with LLM(str(path), kv_offloading_size=0.05, **kw) as llm:
        assert llm.engine.kv.windows == (SLIDING_WINDOW,)
        got, (most,) = _held_blocks_during(llm, prompts, n_out)
        assert llm.get_stats().num_preemptions == 0
    assert got == want and most <= SLIDING_WINDOW // 16 + 2
    with LLM(str(path), disable_hybrid_kv_cache_manager=True, **kw) as llm:
        assert llm.engine.kv.windows == (0,)
        got, (most,) = _held_blocks_during(llm, prompts, n_out)
        assert llm.get_stats().num_preemptions > 0
    assert got == want and most >= 18


@pytest.mark.parametrize("kind, asynchronous", [("gemma3", False), ("gemma3", True), ("gemma4", False),
                                                ("gemma4_moe", True)])
def test_gemma_sliding_groups_hold_only_their_window(ckpt_dir, kind, asynchronous):
    """Issue 16, acceptance 3, on the Gemma 3 and 4 checkpoints (windowed and full layers; Gemma 4's
    with per-layer head sizes, shared KV, packed cache rows): KV groups give
    each kind of layer its own block tables, so through a long decode the sliding groups' blocks
    stay bounded by the window while the full group's grow with the sequence; the tokens are
    transformers', and a second pass hits the prefix cache in every group."""
    from engine import LLM

    path = ckpt_dir(kind)
    prompts = [random_prompt(30 + 11 * i, 950 + i) for i in range(4)]
    n_out = 200
    hf = load_hf(path)
    want = [list(hf_greedy(hf, p, n_out)) for p in prompts]
    with LLM(str(path), dtype="float32", block_size=16, num_gpu_blocks=256, max_model_len=320,
             async_scheduling=asynchronous) as llm:
        kv = llm.engine.kv
        assert len(kv.windows) > 1 and kv.windows[0] == 0 and set(kv.windows) == {0, SLIDING_WINDOW}
        got, most = _held_blocks_during(llm, prompts, n_out)
        again, _ = _held_blocks_during(llm, prompts, n_out)
        assert llm.get_stats().prefix_cache_hits > 0
    assert got == want and again == want
    for window, m in zip(kv.windows, most):
        if window:
            assert m <= SLIDING_WINDOW // 16 + 2, most
        else:  # full attention: the whole history
            assert m >= (max(map(len, prompts)) + n_out) // 16, most


@pytest.mark.parametrize("caching", [False, True])
def test_released_blocks_are_exactly_those_out_of_every_later_querys_sight(caching):
    """KVCacheManager against a plain reference: after computed tokens reach n, a request holds
    block i iff some key in it is at a position >= n - window + 1 (a later query at p >= n sees
    keys j > p - window); released blocks go back to the pool once, and free() releases the rest."""
    from engine.kv.kv_cache_manager import KVCacheManager
    from engine.kv.kv_groups import KVLayout
    from engine.core.request import Request, RequestId
    from engine.sampling_params import SamplingParams
    from kvstore.g1 import BlockPool
    from policies import make_policy

    bs, window = 4, 10
    pool = BlockPool(64, make_policy("lru"), caching)
    kv = KVCacheManager(pool, bs, KVLayout.single(1, window))
    req = Request(RequestId("r"), list(range(1, 8)), SamplingParams(max_tokens=40), max_total_tokens=64)
    for n in range(1, 45):
        while req.num_tokens < n + 1:
            req.append_token(100 + req.num_tokens)
        assert kv.allocate_slots(req, n - req.num_computed_tokens)
        req.num_computed_tokens = n
        kv.cache_full_blocks(req)
        table = kv.block_table(req)
        held = [i for i in range(len(table)) if (i + 1) * bs - 1 >= n - window + 1]
        assert kv.num_held_blocks(req) == len(held), n
        for i, b in enumerate(table):
            assert pool.blocks[b].ref_cnt == (1 if i in held else 0), (n, i)
        pool.check_integrity()
    kv.free(req)
    assert all(b.ref_cnt == 0 for b in pool.blocks) and pool.num_free_blocks() == 64
    pool.check_integrity()


def test_a_draft_model_speculates_on_a_model_with_kv_groups(ckpt_dir):
    """Gemma 3 keeps its KV groups under a draft model: the draft's full-attention KV follows the
    first group's table, which is a full-attention group and keeps the whole history. The target
    as its own draft proposes what it would emit; outputs equal speculation off (transformers')."""
    from engine import LLM, SamplingParams

    path = str(ckpt_dir("gemma3"))
    prompts = [random_prompt(40 + 17 * i, 970 + i) for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    hf = load_hf(path)
    want = [list(hf_greedy(hf, p, 80)) for p in prompts]
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3, "adaptive": False}
    with LLM(path, dtype="float32", block_size=16, num_gpu_blocks=256, speculative_config=spec) as llm:
        assert llm.engine.kv.windows == (0, SLIDING_WINDOW)
        got = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                   use_tqdm=False)]
        sd = llm.get_stats().spec_decode
        llm.engine.check_integrity()
    assert got == want
    assert sd["num_draft_tokens"] > 0 and sd["acceptance_rate"] > 0.95, sd


def test_a_draft_keeps_a_windowed_only_models_history(ckpt_dir):
    """mistral_swa's one group is windowed: a draft's KV follows that table, so nothing is released."""
    from engine import LLM, SamplingParams

    path = str(ckpt_dir("mistral_swa"))
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2, "adaptive": False}
    with LLM(path, dtype="float32", block_size=16, num_gpu_blocks=128, speculative_config=spec) as llm:
        assert llm.engine.kv.windows == (0,)
        prompt = random_prompt(90, 980)
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                           use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == list(hf_greedy(load_hf(path), prompt, 40))


def test_gemma4_strided_caches_on_the_torch_path_equal_transformers(ckpt_dir, monkeypatch):
    """gemma4_moe's sliding layers are half-rows of G1 (strided views); the torch path (what runs
    without the C++ kernels) gathers them for prompt chunks after cached context and for decodes."""
    from engine import LLM, SamplingParams, cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "0")
    path = ckpt_dir("gemma4_moe")
    prompts = [random_prompt(n, 400 + n) for n in (20, 3 * SLIDING_WINDOW + 7)]
    hf = load_hf(path)
    want = [list(hf_greedy(hf, p, SLIDING_WINDOW)) for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=SLIDING_WINDOW, ignore_eos=True)
    with LLM(str(path), dtype="float32", num_gpu_blocks=128, max_num_batched_tokens=37) as llm:
        assert type(llm.engine.runner.model.layers[0].self_attn.backend).__name__ == "TorchPagedAttention"
        assert not llm.engine.runner.layer_caches[0][0].is_contiguous()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
