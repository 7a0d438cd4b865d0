"""Issue 16, acceptance 5: `kvtier serve` serves each architecture beyond the Llama family's dense
ones, and `/v1/kv/stats` and `/metrics` show G1 per KV group. Oracle: transformers' greedy tokens
for the same prompt (float32)."""
from __future__ import annotations

import pytest

from checkpoints import hf_greedy, load_hf, random_prompt
from serving import start_server


WINDOWS = {"gemma3": [0, 48], "mistral_swa": [48], "gemma4": [0, 48, 48], "gemma4_moe": [0, 0, 48]}
# Layers with a cache of their own (Gemma 4's layers 3 and 4 reuse layers 1 and 2's KV).
CACHED_LAYERS = {"gemma4": 3, "gemma4_moe": 4}


@pytest.mark.parametrize("kind", ["qwen3_moe", "gemma3", "mistral_swa", "gemma4", "gemma4_moe"])
def test_served_greedy_tokens_are_transformers(ckpt_dir, kind):
    prompt = random_prompt(60, 5401)  # longer than the sliding kinds' window
    want = hf_greedy(load_hf(ckpt_dir(kind)), prompt, 12)
    srv = start_server(str(ckpt_dir(kind)), "--num-gpu-blocks", "64", "--dtype", "float32", compiled=True)
    try:
        with srv.client() as c:
            r = c.post("/v1/completions", json={"model": srv.model, "prompt": prompt, "max_tokens": 12,
                                                "temperature": 0, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == list(want)
        with srv.client() as c:
            groups = c.get("/v1/kv/stats").json()["tiers"]["G1"]["groups"]
            metrics = c.get("/metrics").text
        # per-group usage: Gemma's global and sliding layers apart, one group otherwise
        assert [g["window"] for g in groups] == WINDOWS.get(kind, [0])
        assert sorted(i for g in groups for i in g["layers"]) == list(range(CACHED_LAYERS.get(kind, 2)))
        assert all(g["held_blocks"] == 0 for g in groups)  # nothing running
        assert metrics.count("kvtier:kv_group_held_blocks{") == len(groups)
    finally:
        assert srv.stop() == 0
