"""The compiled model (`optimization_level` 1-3, engine/runner/compiled.py).

Oracles: the eager engine (itself transformers-exact, tests/engine/test_parity.py runs the parity
suite both ways) for tokens and exported hidden states; dynamo's own graph counter for "one graph
serves every step"; the files inductor writes for the on-disk cache.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import random_prompt
from engine import LLM, SamplingParams

KIND = "qwen3"
# 1 to 700 tokens, two sharing a prefix: with a 64-token budget the steps mix prompt chunks,
# decodes, prefix hits, and 1-token steps once only the longest request is left.
BASE = random_prompt(700, 2000)
PROMPTS = [random_prompt(n, 2100 + n) for n in (1, 3, 17, 64, 130)] + [BASE, BASE[:300] + random_prompt(20, 2200)]


def _llm(ckpt_dir, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks", 512)
    return LLM(model=str(ckpt_dir(KIND)), dtype="float32", seed=0, **kw)


def _tokens(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_one_graph_serves_every_step_and_tokens_equal_eager(ckpt_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    eager = _llm(ckpt_dir, max_num_batched_tokens=64)
    want = _tokens(eager, PROMPTS, 24)
    del eager
    gc.collect()

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with caplog.at_level(logging.INFO, logger="engine.runner.compiled"):
        llm = _llm(ckpt_dir, max_num_batched_tokens=64, optimization_level=1)
        compiled_at_start = sum("compiled in" in r.getMessage() for r in caplog.records)
        graphs_at_start = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for round_ in range(2):  # the second round starts from prefix hits
            assert _tokens(llm, PROMPTS, 24) == want, f"round {round_}"
        assert _tokens(llm, PROMPTS[:1], 5) == [want[0][:5]]  # one request alone: 1-token steps
        # one graph per thread count the CPU governor may switch to (engine/runner/cpu_threads.py)
        levels = len(getattr(llm.engine.threads, "levels", (1,)))
    assert graphs_at_start - graphs == levels, "the model should compile at start-up, not in a request's step"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_at_start
    assert compiled_at_start == 1
    assert sum("compiled in" in r.getMessage() for r in caplog.records) == 1
    cached = list((tmp_path / "cache" / "inductor").rglob("*"))
    assert any(p.is_file() for p in cached), "inductor's cache is not under $KVTIER_CACHE_DIR/inductor"


_COMPILE_ONCE = """
import json, sys, torch
from engine import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", num_gpu_blocks=64, optimization_level=1)
llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
print(json.dumps(dict(torch._dynamo.utils.counters["inductor"])))
"""


@pytest.mark.slow  # two processes that compile (~2 min); `make test-all` runs it
def test_a_restart_reuses_the_compiled_code_from_disk(ckpt_dir, tmp_path):
    """The second process finds inductor's graph in $KVTIER_CACHE_DIR/inductor (a freezing build
    bypassed that cache: every process recompiled)."""
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[2])}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _COMPILE_ONCE, str(ckpt_dir(KIND))], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0].get("fxgraph_cache_miss") == 1 and not runs[0].get("fxgraph_cache_hit"), runs[0]
    assert runs[1].get("fxgraph_cache_hit") == 1 and not runs[1].get("fxgraph_cache_miss"), runs[1]


def test_exported_hidden_states_equal_eager(ckpt_dir, tmp_path):
    from safetensors.torch import load_file

    from connectors.hidden_spec import speculative_config

    files = {}
    for name, level in (("eager", 0), ("compiled", 2)):
        out = tmp_path / name
        llm = _llm(ckpt_dir, optimization_level=level, speculative_config=speculative_config([2, 0, 1]),
                   kv_transfer_config={"kv_connector": "HiddenStatesConnector",
                                       "kv_connector_extra_config": {"shared_storage_path": str(out)}})
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS[2:5]], sp, use_tqdm=False, request_ids=["a", "b", "c"])
        del llm
        gc.collect()
        files[name] = {p.name: load_file(p) for p in sorted(out.rglob("*.safetensors"))}
    assert files["eager"].keys() == files["compiled"].keys() and len(files["eager"]) == 3
    for fname, tensors in files["eager"].items():
        for key, t in tensors.items():
            got = files["compiled"][fname][key]
            assert got.shape == t.shape and got.dtype == t.dtype, (fname, key)
            if t.is_floating_point():  # inductor fuses the norms: last-bit differences only
                torch.testing.assert_close(got, t, rtol=1e-4, atol=1e-5, msg=f"{fname}: {key}")
            else:
                assert torch.equal(got, t), (fname, key)


def test_enforce_eager_overrides_the_level_and_says_so(ckpt_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="engine.config"):
        llm = _llm(ckpt_dir, optimization_level=3, enforce_eager=True, num_gpu_blocks=64)
    assert llm.engine.runner.forward is llm.engine.runner.model
    assert llm.config.optimization_level == 0
    assert any("optimization_level=3 not applied" in r.getMessage() for r in caplog.records)


def test_default_level_by_device_and_environment(monkeypatch, caplog):
    from engine.config import OPT_LEVEL_ENV, EngineConfig

    monkeypatch.delenv(OPT_LEVEL_ENV)
    assert EngineConfig(model="x", device="cpu").optimization_level == 1  # compiled: faster on CPU (README)
    with caplog.at_level(logging.WARNING, logger="engine.config"):
        assert EngineConfig(model="x", device="cpu", enforce_eager=True).optimization_level == 0
    assert not caplog.records, "a default level overridden by enforce_eager is not worth a warning"
    monkeypatch.setenv(OPT_LEVEL_ENV, "2")
    assert EngineConfig(model="x", device="cpu").optimization_level == 2
    assert EngineConfig(model="x", device="cpu", optimization_level=0).optimization_level == 0  # explicit wins
    monkeypatch.setenv(OPT_LEVEL_ENV, "fast")
    with pytest.raises(ValueError, match=OPT_LEVEL_ENV):
        EngineConfig(model="x", device="cpu")


@pytest.mark.parametrize("level", [-1, 4, True, "1"])
def test_bad_level_is_a_clear_error(level):
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="optimization_level"):
        EngineConfig(model="x", device="cpu", optimization_level=level)


def test_cli_takes_vllm_spellings():
    from server.args import add_engine_args, llm_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    for argv, want in ((["-O3"], 3), (["-O", "1"], 1), (["--optimization-level", "2"], 2), ([], None)):
        assert llm_kwargs(p.parse_args(argv))["optimization_level"] == want, argv
    with pytest.raises(SystemExit) as e:
        p.parse_args(["-O5"])
    assert e.value.code == 2


def test_a_failed_compile_falls_back_to_eager_and_says_why(ckpt_dir, monkeypatch, caplog):
    import engine.runner.compiled

    def fail(self, *args):
        raise torch._dynamo.exc.TorchDynamoException("no C++ compiler found")

    monkeypatch.setattr(engine.runner.compiled.CompiledForward, "__call__", fail)
    with caplog.at_level(logging.WARNING, logger="engine.core.engine_core"):
        llm = _llm(ckpt_dir, optimization_level=1, num_gpu_blocks=64)
    assert llm.engine.runner.forward is llm.engine.runner.model
    assert any("torch.compile failed" in r.getMessage() and "no C++ compiler" in r.getMessage()
               for r in caplog.records)
    eager = _llm(ckpt_dir, optimization_level=0, num_gpu_blocks=64)
    assert _tokens(llm, PROMPTS[2:4], 8) == _tokens(eager, PROMPTS[2:4], 8)


def test_attention_op_outside_a_step_raises():
    import engine.runner.compiled  # noqa: F401  registers the op

    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="outside a model step"):
        torch.ops.kvtier.attention(q, q[:, :1], q[:, :1], 0, 1.0, 0)
