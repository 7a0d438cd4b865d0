"""Issue 46, acceptance 3: `kvtier serve --enable-lora --lora-modules a=DIR b=DIR`. The official
`openai` client reaches each adapter by name in the model field, with transformers + peft's
tokens; an unknown name is a 404; /v1/models lists the adapters under their base; an adapter over
--max-lora-rank or with a module outside --lora-target-modules exits 2 at start, naming it."""
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
    finally:
        assert srv.stop() == 0


def test_adapters_over_the_flags_exit_2_naming_them(lora_setup, tmp_path):
    base, a, b, _ = lora_setup
    common = [str(base), "--enable-lora"]
    cases = [[*common, "--max-lora-rank", "4", "--lora-modules", f"a={a}"],
             [*common, "--lora-target-modules", "q_proj,v_proj", "--lora-modules", f"a={a}"],
             [str(base), "--lora-modules", f"b={b}"],
             [*common, "--lora-modules", f"a={tmp_path / 'missing'}"],
             [*common, "--lora-modules", "noequals"]]
    (r1, e1), (r2, e2), (r3, e3), (r4, e4), (r5, e5) = run_cli_many(cases)
    assert r1 == 2 and "rank 8 is over --max-lora-rank 4" in e1
    assert r2 == 2 and "outside --lora-target-modules" in e2 and "'down_proj'" in e2
    assert r3 == 2 and "--lora-modules needs --enable-lora" in e3
    assert r4 == 2 and "not found" in e4
    assert r5 == 2 and "name=path" in e5
