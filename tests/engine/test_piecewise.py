"""Issue 42: steps that mix prompt chunks with decodes through the piecewise graph runner
(engine/runner/piecewise.py), checked on CPU in its eager-replay mode: padded to a capture size in
tokens, the forward split at every attention call, attention on the real rows only through the
static buffers. Oracle: the same engine with graphs off. The CUDA capture itself is checked on a
GPU by tests/gpu/test_graphs_cuda.py."""
from __future__ import annotations

import pytest

from checkpoints import KINDS
from engine import LLM
from engine.config import EngineConfig
from test_graphs import _assert_same, _check_live_blocks_equal, _feature_kw, _params, _prompts, _run

SIZES = (1, 2, 4, 8, 16, 32, 64)  # with a 64-token step budget every step fits one


def _pair(model: str, **kw) -> dict[str, LLM]:
    kw = dict(dtype="float32", seed=0, block_size=16, max_num_seqs=8, **{"max_num_batched_tokens": 64, **kw})
    return {"off": LLM(model, **kw), "on": LLM(model, cudagraph_mode="eager_replay", cudagraph_capture_sizes=SIZES, **kw)}


def _padded_mixed_steps(llm: LLM) -> int:
    """Piecewise steps run at a capture size bigger than their token count."""
    stats = llm.engine.runner.pieces.stats()
    return sum(n for size, n in stats.replays.items() if size > 1)


def test_piecewise_modes_resolve_and_refuse_what_cannot_apply(llama_ckpt):
    model = str(llama_ckpt)
    for kw, match in [
        (dict(cudagraph_mode="full_and_piecewise"), "needs a CUDA device"),
        (dict(cudagraph_mode="eager_replay", enable_lora=True), "enable_lora"),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(model=model, device="cpu", **kw)
    assert EngineConfig(model=model, device="cpu", enable_lora=True).cudagraph_mode.value == "none"


@pytest.mark.parametrize("kind", KINDS)
def test_every_model_kind_gives_the_plain_tokens_through_the_pieces(kind, ckpt_dir):
    pair = _pair(str(ckpt_dir(kind)), num_gpu_blocks=128, optimization_level=0)
    prompts, params = _prompts(7), _params(7)
    want = _run(pair["off"], prompts, params)
    _assert_same(_run(pair["on"], prompts, params), want)
    runner = pair["on"].engine.runner
    assert _padded_mixed_steps(pair["on"]) >= 2, runner.pieces.stats()
    assert sum(runner.graphs.stats().replays.values()) > 5  # decode-only steps still take the decode buffers
    _check_live_blocks_equal(pair)  # padded rows wrote no live block
    pair["on"].engine.check_integrity()


@pytest.mark.parametrize("feature", ["compiled", "chunked-preempted-prefix", "async", "eagle3"])
def test_pieces_compose_with_engine_features(feature, llama_ckpt, tmp_path):
    # compiled: the compiled forward splits at the same op; eagle3: the target's aux layers come out of the
    # pieces as EAGLE-3's features
    kw, shared = _feature_kw(feature, llama_ckpt, tmp_path)
    pair = _pair(str(llama_ckpt), **kw)
    prompts, params = _prompts(12, shared), _params(12)
    want = _run(pair["off"], prompts, params)
    _assert_same(_run(pair["on"], prompts, params), want)
    again = [_run(pair[k], prompts[:5], params[:5]) for k in ("off", "on")]  # prefix hits: chunks after cached blocks
    _assert_same(again[1], again[0])
    assert _padded_mixed_steps(pair["on"]) >= 2, pair["on"].engine.runner.pieces.stats()
    st = pair["on"].get_stats()
    if feature == "chunked-preempted-prefix":
        assert st.num_preemptions > 0 and st.prefix_cache_hits > 0, st
    if feature == "eagle3":
        assert st.spec_decode["num_drafts"] > 0, st.spec_decode
        assert pair["on"].engine.spec.proposer.runner.pieces is None  # drafts keep decode graphs only
    _check_live_blocks_equal(pair)
    for llm in pair.values():
        llm.engine.check_integrity()
