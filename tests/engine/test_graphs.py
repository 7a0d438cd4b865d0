"""Issue 42: decode steps through the CUDA-graph runner (engine/runner/graphs.py), checked on CPU in
its eager-replay mode: the same static buffers, padding to capture sizes and pad-block writes, with
the forward run eagerly instead of replayed. Oracle: the same engine with graphs off. The CUDA
capture itself is checked on a GPU by tests/gpu/test_graphs_cuda.py."""
from __future__ import annotations

import pytest
import torch

from checkpoints import KINDS, build_eagle3_draft, random_prompt
from engine import LLM, SamplingParams
from engine.config import EngineConfig, GraphMode, default_capture_sizes, parse_capture_sizes
from engine.runner.graphs import padded_size

SIZES = (1, 2, 4, 8)  # small, so batches of 3..7 pad and shrinking batches move between sizes


def test_capture_sizes_follow_vllm_ladder_and_padding_picks_the_next():
    assert default_capture_sizes(1) == (1,)
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert default_capture_sizes(256)[-3:] == (240, 248, 256) and len(default_capture_sizes(256)) == 35
    assert parse_capture_sizes("8,1,4,4") == (1, 4, 8)
    assert [padded_size((1, 2, 4, 8), b) for b in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]
    for bad in ("", "0,1", "a,b"):
        with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
            parse_capture_sizes(bad)


def test_graph_settings_resolve_and_refuse_what_cannot_apply(llama_ckpt):
    model = str(llama_ckpt)
    cpu = EngineConfig(model=model, device="cpu")
    assert cpu.cudagraph_mode is GraphMode.NONE and cpu.cudagraph_capture_sizes is None
    replay = EngineConfig(model=model, device="cpu", cudagraph_mode="eager_replay", max_num_seqs=20)
    assert replay.cudagraph_capture_sizes == (1, 2, 4, 8, 16, 20) and replay.max_cudagraph_capture_size == 20
    for kw, match in [
        (dict(cudagraph_mode="full_decode_only"), "needs a CUDA device"),
        (dict(cudagraph_mode="eager_replay", enforce_eager=True), "contradict"),
        (dict(cudagraph_capture_sizes=(1, 2)), "no CUDA graphs are captured on CPU"),
        (dict(max_cudagraph_capture_size=8), "no CUDA graphs"),
        (dict(cudagraph_mode="eager_replay", cudagraph_capture_sizes=(1, 2), max_cudagraph_capture_size=4), "differs"),
        (dict(cudagraph_mode="eager_replay", tensor_parallel_size=2), "tensor_parallel_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(model=model, device="cpu", **kw)


def _prompts(n: int, shared: list[int] | None = None) -> list[dict]:
    return [{"prompt_token_ids": (shared or []) + random_prompt(3 + (i * 13) % 60, 500 + i)} for i in range(n)]


def _run(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outs]


def _assert_same(got: list[tuple], want: list[tuple]) -> None:
    """Tokens and finish reasons exactly; logprobs to float noise: a padded batch runs GEMMs of
    another height, which may round differently (seen on Gemma 4: 4e-6 in hidden states)."""
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, w in zip(got, want):
        for step_g, step_w in zip(g[2] or [], w[2] or []):
            assert step_g.keys() == step_w.keys()
            for tok in step_g:
                assert abs(step_g[tok] - step_w[tok]) < 1e-4, (tok, step_g[tok], step_w[tok])


def _params(n: int, max_tokens: int = 20) -> list[SamplingParams]:
    # Greedy with logprobs, penalties and a seeded sample: each is a per-row computation padding must not touch.
    kinds = [dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2),
             dict(temperature=0.0, max_tokens=max_tokens - 5, ignore_eos=True, repetition_penalty=1.3),
             dict(temperature=0.8, seed=11, max_tokens=max_tokens + 4, ignore_eos=True)]
    return [SamplingParams(**kinds[i % len(kinds)]) for i in range(n)]


def _pair(model: str, **kw) -> dict[str, LLM]:
    kw = dict(dtype="float32", seed=0, block_size=16, max_num_seqs=8, **kw)
    return {"off": LLM(model, **kw), "on": LLM(model, cudagraph_mode="eager_replay", cudagraph_capture_sizes=SIZES, **kw)}


def _check_live_blocks_equal(pair: dict[str, LLM]) -> None:
    """The two engines computed the same schedule, so their live G1 blocks hold the same K/V: a padded
    row that wrote anywhere but the pad block would show here. The pad block itself was written."""
    off, on = (pair[k].engine.runner for k in ("off", "on"))
    n = off.kv_cache.shape[2]
    assert on.kv_cache.shape[2] == n + 1 and on.graphs.pad_block == n
    torch.testing.assert_close(on.kv_cache[:, :, :n], off.kv_cache, rtol=1e-4, atol=1e-5)
    assert on.kv_cache[:, :, n].abs().sum() > 0  # padded rows decoded token 0 there


@pytest.mark.parametrize("kind", KINDS)
def test_every_model_kind_decodes_the_same_through_the_graph_buffers(kind, ckpt_dir):
    pair = _pair(str(ckpt_dir(kind)), num_gpu_blocks=128, optimization_level=0)
    prompts, params = _prompts(7), _params(7)
    want = _run(pair["off"], prompts, params)
    _assert_same(_run(pair["on"], prompts, params), want)
    stats = pair["on"].engine.runner.graphs.stats()  # Gemma's KV groups (sliding layers apart) each get buffers
    assert stats.replays[8] > 0 and sum(stats.replays.values()) > 10, stats
    _check_live_blocks_equal(pair)
    pair["on"].engine.check_integrity()


def _feature_kw(feature: str, llama_ckpt, tmp_path) -> tuple[dict, list[int] | None]:
    """An engine feature's settings over the base ones, and a prompt prefix the requests share."""
    kw: dict = dict(num_gpu_blocks=128, optimization_level=0)
    shared = None
    if feature == "compiled":
        kw["optimization_level"] = 1
    elif feature == "chunked-preempted-prefix":  # a small G1 and step budget: chunks beside decodes, preemption
        kw.update(num_gpu_blocks=24, max_num_batched_tokens=48)
        shared = random_prompt(40, 77)
    elif feature == "async":
        kw["async_scheduling"] = True
        shared = random_prompt(40, 78)
    elif feature == "draft":  # the target as its own draft: the draft's one-token steps replay its graphs
        kw["speculative_config"] = {"method": "draft_model", "model": str(llama_ckpt), "num_speculative_tokens": 3,
                                    "adaptive": False}
    elif feature == "eagle3":  # the target keeps its aux layers' outputs through the graphs; the draft replays its own
        kw["speculative_config"] = {"method": "eagle3", "model": str(build_eagle3_draft(llama_ckpt, tmp_path / "e3", seed=5)),
                                    "num_speculative_tokens": 3, "adaptive": False}
    else:
        # Fixed proposal lengths: the adaptive ones follow measured step times, so no two runs schedule alike.
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                    "adaptive": False}
    return kw, shared


@pytest.mark.parametrize("feature", ["compiled", "chunked-preempted-prefix", "async", "ngram", "draft", "eagle3"])
def test_graph_buffers_compose_with_engine_features(feature, llama_ckpt, monkeypatch, tmp_path):
    kw, shared = _feature_kw(feature, llama_ckpt, tmp_path)
    pair = _pair(str(llama_ckpt), **kw)
    runner = pair["on"].engine.runner
    verify_replays = []  # verify steps (more logits rows than sampling entries) that replayed a graph

    def run(step, real=runner.run):
        before = sum(runner.graphs.stats().replays.values())
        out = real(step)
        if len(step.sample_rows) > len(step.sampled) and sum(runner.graphs.stats().replays.values()) > before:
            verify_replays.append(step.input_ids.shape[0])
        return out

    monkeypatch.setattr(runner, "run", run)
    proposed: dict[str, list] = {"off": [], "on": []}  # each engine's proposals, in order
    for key, llm in pair.items():
        if llm.engine.spec is not None:
            def propose(*args, real=llm.engine.spec.proposer.propose, into=proposed[key]):
                out = real(*args)
                into.append([p.token_ids for p in out])
                return out
            monkeypatch.setattr(llm.engine.spec.proposer, "propose", propose)
    prompts, params = _prompts(12, shared), _params(12)
    if feature == "ngram":  # repetitive prompts, so that proposals come
        prompts = [{"prompt_token_ids": p["prompt_token_ids"][:6] * 4} for p in prompts]
    want = _run(pair["off"], prompts, params)
    _assert_same(_run(pair["on"], prompts, params), want)
    again = [_run(pair[k], prompts[:5], params[:5]) for k in ("off", "on")]  # again: prefix hits from G1
    _assert_same(again[1], again[0])
    stats = pair["on"].engine.runner.graphs.stats()
    assert sum(stats.replays.values()) > 5, stats
    st = pair["on"].get_stats()
    if feature == "chunked-preempted-prefix":
        assert st.num_preemptions > 0 and st.prefix_cache_hits > 0, st
    if feature in ("ngram", "draft", "eagle3"):  # verify entries ride as decode rows, 1 + k per request
        assert len(verify_replays) >= 2, verify_replays
        # The same proposals (greedy tokens alone would not show a draft fed wrong features or
        # rows: verification corrects it).
        assert proposed["on"] == proposed["off"] and any(any(p) for p in proposed["on"]), proposed
    if feature in ("draft", "eagle3"):
        draft = pair["on"].engine.spec.proposer.runner.graphs
        assert draft is not None and sum(draft.stats().replays.values()) > 5, draft and draft.stats()
        assert pair["off"].engine.spec.proposer.runner.graphs is None
        assert st.spec_decode["num_drafts"] > 0, st.spec_decode
    _check_live_blocks_equal(pair)
    for llm in pair.values():
        llm.engine.check_integrity()
