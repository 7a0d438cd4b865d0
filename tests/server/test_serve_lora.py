"""Issue 46, acceptance 3: `kvtier serve --enable-lora --lora-modules a=DIR b=DIR`. The official
`openai` client reaches each adapter by name in the model field, with transformers + peft's
tokens; an unknown name is a 404; /v1/models lists the adapters under their base; an adapter over
--max-lora-rank or with a module outside --lora-target-modules exits 2 at start, naming it.
vLLM's run-time routes (/v1/load_lora_adapter, /v1/unload_lora_adapter) exist only with
$VLLM_ALLOW_RUNTIME_LORA_UPDATING; an adapter they load serves transformers + peft's tokens, and one
reloaded in place with other weights gets no cached tokens from its old KV."""
from __future__ import annotations

import openai
import pytest
from serving import run_cli_many, start_server

import checkpoints as C
import checkpoints_lora as L

PROMPT = C.random_prompt(30, 7)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def lora_setup(ckpt_dir, tmp_path_factory):
    base = ckpt_dir("llama")
    root = tmp_path_factory.mktemp("serve_lora")
    a = L.build_adapter(base, root / "a", rank=8, seed=11)
    b = L.build_adapter(base, root / "b", rank=8, targets=("q_proj", "v_proj"), seed=12)
    want = {name: L.hf_greedy(base, d, [PROMPT], MAX_TOKENS)[0] for name, d in (("base", None), ("a", a), ("b", b))}
    return base, a, b, want


def test_each_adapter_by_name_through_the_openai_client(lora_setup):
    base, a, b, want = lora_setup
    srv = start_server(str(base), "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
                       "--lora-modules", f"a={a}", f'{{"name": "b", "path": "{b}"}}', "--num-gpu-blocks", "64")
    try:
        oa = openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60)
        got = {}
        for name in ("base", "a", "b", "a"):
            r = oa.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
            got.setdefault(name, []).append(r.choices[0].token_ids)
        assert got == {"base": [want["base"]], "a": [want["a"], want["a"]], "b": [want["b"]]}
        with pytest.raises(openai.NotFoundError, match="The model `c` does not exist"):
            oa.completions.create(model="c", prompt=PROMPT, max_tokens=2)
        with srv.client() as c:
            metrics = c.get("/metrics").text
        assert 'kvtier:lora_requests_total{lora_name="a",model_name="base"} 2.0' in metrics
        assert 'kvtier:lora_requests_total{lora_name="b",model_name="base"} 1.0' in metrics
        assert 'max_lora="2"' in metrics and "kvtier:lora_requests_info{" in metrics
        cards = {m.id: m for m in oa.models.list().data}
        assert set(cards) == {"base", "a", "b"}
        assert cards["a"].parent == "base" and cards["a"].root == str(a) and cards["base"].parent is None
        with srv.client() as c:  # not allowed: the routes do not exist
            assert c.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(a)}).status_code == 404
    finally:
        assert srv.stop() == 0


def test_adapters_over_the_flags_exit_2_naming_them(lora_setup, tmp_path):
    base, a, b, _ = lora_setup
    common = [str(base), "--enable-lora"]
    cases = [[*common, "--max-lora-rank", "4", "--lora-modules", f"a={a}"],
             [*common, "--lora-target-modules", "q_proj,v_proj", "--lora-modules", f"a={a}"],
             [str(base), "--lora-modules", f"b={b}"],
             [*common, "--lora-modules", f"a={tmp_path / 'missing'}"],
             [*common, "--lora-modules", "noequals"],
             [str(base), "--allow-runtime-lora-updating"]]
    (r1, e1), (r2, e2), (r3, e3), (r4, e4), (r5, e5), (r6, e6) = run_cli_many(cases)
    assert r1 == 2 and "rank 8 is over --max-lora-rank 4" in e1
    assert r2 == 2 and "outside --lora-target-modules" in e2 and "'down_proj'" in e2
    assert r3 == 2 and "--lora-modules needs --enable-lora" in e3
    assert r4 == 2 and "not found" in e4
    assert r5 == 2 and "name=path" in e5
    assert r6 == 2 and "--allow-runtime-lora-updating (or $VLLM_ALLOW_RUNTIME_LORA_UPDATING) needs --enable-lora" in e6


def test_a_switch_from_the_environment_is_parsed_strictly():
    import os
    import subprocess
    import sys

    from serving import REPO

    def serve_help(value: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}
        return subprocess.run([sys.executable, "-m", "server.cli", "serve", "--help"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120, check=False)
    bad, good = serve_help("maybe"), serve_help("True")
    assert bad.returncode == 2 and "$VLLM_ALLOW_RUNTIME_LORA_UPDATING='maybe' must be one of" in bad.stderr
    assert good.returncode == 0 and "--allow-runtime-lora-updating" in good.stdout


def _complete(oa: openai.OpenAI, model: str) -> tuple[list[int], int]:
    r = oa.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                              extra_body={"return_token_ids": True, "ignore_eos": True})
    return r.choices[0].token_ids, r.usage.prompt_tokens_details.cached_tokens


def test_adapters_loaded_and_unloaded_at_run_time(lora_setup, tmp_path):
    base, a, b, want = lora_setup
    c_dir = L.build_adapter(base, tmp_path / "c", rank=16, seed=13)  # over --max-lora-rank 8
    d_dir = L.build_adapter(base, tmp_path / "d", rank=8, seed=14)
    want_d = L.hf_greedy(base, d_dir, [PROMPT], MAX_TOKENS)[0]
    srv = start_server(str(base), "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
                       "--max-lora-rank", "8", "--lora-modules", f"a={a}", "--num-gpu-blocks", "64",
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        oa = openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60)
        with srv.client() as c:
            load = lambda **body: c.post("/v1/load_lora_adapter", json=body)  # noqa: E731
            unload = lambda **body: c.post("/v1/unload_lora_adapter", json=body)  # noqa: E731
            with pytest.raises(openai.NotFoundError):
                _complete(oa, "b")
            r = load(lora_name="b", lora_path=str(b))
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' added successfully."
            assert _complete(oa, "b")[0] == want["b"] and _complete(oa, "a")[0] == want["a"]
            assert {m.id: m.root for m in oa.models.list().data} == {"base": str(base), "a": str(a), "b": str(b)}
            refused = {"again": load(lora_name="b", lora_path=str(b)),
                       "full": load(lora_name="c", lora_path=str(c_dir)),
                       "field": load(lora_name="c", lora_path=str(c_dir), lora_rank=8),
                       "base": load(lora_name="base", lora_path=str(b))}
            assert all(r.status_code == 400 for r in refused.values()), {k: r.text for k, r in refused.items()}
            assert "has already been loaded" in refused["again"].json()["error"]["message"]
            assert "--max-loras 2" in refused["full"].json()["error"]["message"]
            assert "lora_rank" in refused["field"].json()["error"]["message"]
            r = unload(lora_name="b")
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'b' removed successfully."
            with pytest.raises(openai.NotFoundError):
                _complete(oa, "b")
            r = unload(lora_name="b")
            assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
            r = load(lora_name="c", lora_path=str(c_dir))  # a slot is free now: refused for its rank
            assert r.status_code == 400 and "rank 16 is over --max-lora-rank 8" in r.json()["error"]["message"]
            # "a" re-read in place from other files: their tokens, and none of a's cached KV
            assert _complete(oa, "a") == (want["a"], 16)  # a's prompt blocks are cached (block size 16)
            assert load(lora_name="a", lora_path=str(d_dir), load_inplace=True).status_code == 200
            assert _complete(oa, "a") == (want_d, 0)
            assert _complete(oa, "a") == (want_d, 16)
    finally:
        assert srv.stop() == 0
