"""Issue 5, acceptance 4: the offload, eviction, transfer-config and -sc flags work end to end
through `kvtier serve`.

Oracles: the first pass of the same greedy request (tokens must not change when the prefix
comes back from G2 or G3), the server's own /v1/kv/stats and /metrics (which tier served it),
and the safetensors file the hidden-state connector wrote (complete when the response names it)."""
from __future__ import annotations

import json
import re

import pytest
from safetensors.torch import load_file

from checkpoints import random_prompt
from connectors.hidden_spec import speculative_config
from serving import start_server

G1_BLOCKS = 64  # 1,024 tokens: a 900-token prompt pushes a 600-token one out of G1
LONG, FLOOD = random_prompt(600, 5101), random_prompt(900, 5102)


def complete(srv, prompt: list[int], **kw) -> dict:
    with srv.client() as c:
        r = c.post("/v1/completions", json={"model": srv.model, "prompt": prompt, "max_tokens": 8,
                                            "temperature": 0, "ignore_eos": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of /metrics (0 when absent)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(w in (m.group(1) or "") for w in want):
            return float(m.group(2))
    return 0.0


def second_pass_tier(srv, salt: str) -> tuple[dict, dict, str]:
    first = complete(srv, LONG, cache_salt=salt, return_token_ids=True)
    complete(srv, FLOOD, cache_salt=salt)  # evicts LONG's blocks from G1
    again = complete(srv, LONG, cache_salt=salt, return_token_ids=True)
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    with srv.client() as c:
        stats = c.get("/v1/kv/stats").json()
        metrics = c.get("/metrics").text
    return again, stats, metrics


@pytest.mark.parametrize("tier", ["G2", "G3"])
def test_repeated_long_prompt_is_served_from_the_offload_tier(ckpt_dir, tmp_path, tier):
    flags = ["--kv-offloading-size", "0.05"] if tier == "G2" else ["--kv-offload-disk", str(tmp_path / "g3"),
                                                                   "--kv-offload-disk-size", "0.1"]
    srv = start_server(str(ckpt_dir("llama")), "--num-gpu-blocks", str(G1_BLOCKS), "--dtype", "float32",
                       "--kv-eviction-policy", "priority", *flags)
    try:
        again, stats, metrics = second_pass_tier(srv, "t1")
        hits = stats["tiers"][tier]["hit_tokens"]
        assert hits >= 256, stats  # the flood evicted at least the prompt's first half from G1
        # G1 kept the rest; together they cover all 37 full blocks.
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 576
        assert metric(metrics, "kvtier:offload_hit_tokens_total", tier=tier) == hits
        assert metric(metrics, "kvtier:prompt_tokens_cached_by_tier_total", tier=tier) == hits
        assert metric(metrics, "kvtier:prompt_tokens_by_source_total", source="external_kv_transfer") == hits
        assert metric(metrics, "kvtier:offload_bytes_total", tier=tier, direction="in") > 0
        assert metric(metrics, "kvtier:kv_cache_usage_perc") >= 0
    finally:
        assert srv.stop() == 0


def test_kv_transfer_config_write_back_through_the_server(ckpt_dir):
    cfg = {"kv_connector": "TieredOffloadConnector", "kv_connector_extra_config": {"write_policy": "write_back"}}
    srv = start_server(str(ckpt_dir("llama")), "--num-gpu-blocks", str(G1_BLOCKS), "--dtype", "float32",
                       "--kv-offloading-size", "0.05", "--kv-transfer-config", json.dumps(cfg))
    try:
        _, stats, _ = second_pass_tier(srv, "wb")
        assert stats["offload"]["write_policy"] == "write_back"
        assert stats["offload"]["writeback_blocks"] > 0  # G2 was filled by evictions, not by write-through
        assert stats["tiers"]["G2"]["hit_tokens"] >= 256
    finally:
        assert srv.stop() == 0


def test_hidden_states_path_names_a_complete_file(ckpt_dir, tmp_path):
    out = tmp_path / "hs"
    layer_ids = [0, 1, 2]
    tc = {"kv_connector": "HiddenStatesConnector", "kv_connector_extra_config": {"shared_storage_path": str(out)}}
    srv = start_server(str(ckpt_dir("llama")), "--num-gpu-blocks", "128", "--dtype", "float32",
                       "--kv-transfer-config", json.dumps(tc), "-sc", json.dumps(speculative_config(layer_ids)))
    try:
        prompt = random_prompt(40, 5103)
        body = complete(srv, prompt, return_token_ids=True, max_tokens=1, request_id="doc-7")
        path = body["kv_transfer_params"]["hidden_states_path"]
        assert path == str(out / "doc-7.safetensors")
        data = load_file(path)  # read right away: the response is only sent once the file is written
        assert data["token_ids"].tolist() == body["choices"][0]["prompt_token_ids"] == prompt
        assert tuple(data["hidden_states"].shape) == (len(prompt), len(layer_ids), 64)
        streamed = []
        with srv.client() as c, c.stream("POST", "/v1/completions", json={
                "model": srv.model, "prompt": prompt, "max_tokens": 1, "stream": True, "request_id": "doc-8"}) as r:
            streamed = [json.loads(line[6:]) for line in r.iter_lines()
                        if line.startswith("data: ") and line != "data: [DONE]"]
        last = [ch for ch in streamed if ch.get("kv_transfer_params")]
        assert last and load_file(last[-1]["kv_transfer_params"]["hidden_states_path"])["token_ids"].tolist() == prompt
    finally:
        assert srv.stop() == 0


def test_bad_flags_exit_2_with_a_message(ckpt_dir, tmp_path):
    from serving import run_cli, run_cli_many

    model = str(ckpt_dir("llama"))
    cases = [
        ([model, "--kv-transfer-config", "{not json"], "kv_transfer_config"),
        ([model, "-sc", json.dumps(speculative_config([0]))], "HiddenStatesConnector"),
        ([model, "-sc", '{"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}'], "'lookahead'"),
        ([model, "-sc", json.dumps({"method": "draft_model", "num_speculative_tokens": 2,
                                    "model": str(tmp_path / "nowhere")}), "--num-gpu-blocks", "64"], "nowhere"),
        ([model, "--kv-eviction-policy", "no_such_policy", "--num-gpu-blocks", "64"], "no_such_policy"),
        ([model, "--kv-eviction-policy", '{"name": "lru", "options": {"ghosts": 4}}'],
         "--kv-eviction-policy: eviction policy 'lru' takes no options; got ['ghosts']"),
        ([model, "--kv-eviction-policy", '{"name": "lru"'], "--kv-eviction-policy: eviction policy"),
        ([model, "--kv-offload-remote", "redis://localhost:1", "--kv-transfer-config",
          '{"kv_connector_extra_config": {"g4_eviction_policy": "lru"}}'], "maxmemory-policy"),
        ([model, "--kv-offloading-size", "1", "--kv-transfer-config",
          '{"kv_connector_extra_config": {"g2_eviction_policy": {"name": "nope"}}}'], "g2_eviction_policy"),
        ([str(tmp_path / "missing")], "does not exist"),
        ([model, "--port", "70000"], "--port"),
    ]
    # One process for all (the imports once); the first case again as the real command line.
    for (args, needle), (rc, err) in zip(cases, run_cli_many([args for args, _ in cases])):
        assert rc == 2 and needle in err and "Traceback" not in err, (args, rc, err)
    r = run_cli(*cases[0][0])
    assert r.returncode == 2 and cases[0][1] in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_plugin_backend_tier_through_the_server(ckpt_dir, tmp_path):
    """Issue 13: a plugin backend given in --kv-transfer-config "tiers" (by module:Class) serves
    the repeated prompt once G1 lost it; /v1/kv/stats and /metrics list it as a tier."""
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "kvtier-example-backend"
    plugin = "kvtier_example_backend:DirBackend"
    tc = {"kv_connector": "TieredOffloadConnector",
          "kv_connector_extra_config": {"tiers": [{"backend": plugin, "root": str(tmp_path / "kv")}]}}
    srv = start_server(str(ckpt_dir("llama")), "--num-gpu-blocks", str(G1_BLOCKS), "--dtype", "float32",
                       "--kv-transfer-config", json.dumps(tc),
                       env={"PYTHONPATH": f"{Path(__file__).resolve().parents[2]}:{example}"})
    try:
        _, stats, metrics = second_pass_tier(srv, "plugin")
        g3 = stats["tiers"]["G3"]
        assert g3["backend"] == plugin and g3["hit_tokens"] >= 256 and g3["hits"] > 0, stats
        assert metric(metrics, "kvtier:offload_tier_info", tier="G3", backend=plugin) == 1
        assert metric(metrics, "kvtier:offload_hit_tokens_total", tier="G3") == g3["hit_tokens"]
    finally:
        assert srv.stop() == 0


def test_speculative_decoding_through_the_server(ckpt_dir):
    """-sc with ngram: the same greedy tokens as the tiny server without it, the spec_decode
    counters in /metrics and /v1/kv/stats agree."""
    prompt = (random_prompt(30, 5201) * 3)[:80]  # repeats itself: prompt lookup finds proposals
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "adaptive": False}
    plain = start_server(str(ckpt_dir("llama")), "--num-gpu-blocks", str(G1_BLOCKS), "--dtype", "float32")
    try:
        want = complete(plain, prompt, max_tokens=40, return_token_ids=True)["choices"][0]["token_ids"]
    finally:
        assert plain.stop() == 0
    srv = start_server(str(ckpt_dir("llama")), "--num-gpu-blocks", str(G1_BLOCKS), "--dtype", "float32",
                       "-sc", json.dumps(spec))
    try:
        got = complete(srv, prompt, max_tokens=40, return_token_ids=True)["choices"][0]["token_ids"]
        with srv.client() as c:
            sd = c.get("/v1/kv/stats").json()["spec_decode"]
            metrics = c.get("/metrics").text
    finally:
        assert srv.stop() == 0
    assert got == want
    assert sd["num_drafts"] > 0 and sd["num_accepted_tokens"] > 0, sd
    assert metric(metrics, "kvtier:spec_decode_num_drafts_total") == sd["num_drafts"]
    assert metric(metrics, "kvtier:spec_decode_num_draft_tokens_total") == sd["num_draft_tokens"]
    assert metric(metrics, "kvtier:spec_decode_num_accepted_tokens_total") == sd["num_accepted_tokens"]
    assert metric(metrics, "kvtier:spec_decode_num_accepted_tokens_per_pos_total", position="0") == \
        sd["accepted_per_pos"][0]


def test_async_scheduling_through_the_server(ckpt_dir):
    """--async-scheduling: a G2 hit gives the first pass's tokens, and greedy and stop-string
    answers are the synchronous server's; /v1/kv/stats reports the bubble."""
    args = (str(ckpt_dir("llama")), "--num-gpu-blocks", str(G1_BLOCKS), "--dtype", "float32",
            "--kv-offloading-size", "0.05")
    prompt = random_prompt(40, 5301)
    answers = []
    for flags in ((), ("--async-scheduling",)):
        srv = start_server(*args, *flags)
        try:
            again, stats, _ = second_pass_tier(srv, "async")
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256, again
            plain = complete(srv, prompt, max_tokens=24, return_token_ids=True)["choices"][0]
            word = plain["text"].split()[len(plain["text"].split()) // 2]
            stopped = complete(srv, prompt, max_tokens=24, stop=[word])["choices"][0]
            answers.append((again["choices"][0]["token_ids"], plain["token_ids"], stopped["text"],
                            stopped["finish_reason"]))
            assert 0 < stats["steps"]["bubble_fraction"] < 1, stats["steps"]
        finally:
            assert srv.stop() == 0
    assert answers[0] == answers[1]
