"""Issue 4: hidden-state export (speculative_config extract_hidden_states + HiddenStatesConnector).

Oracles: transformers' `output_hidden_states` (ids < N) and a hook on the last decoder layer
(id N, before the final norm); and, for prefix-cache independence, the file of a fresh
computation of the same prompt.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from checkpoints import LAYERS, random_prompt
from connectors.hidden_spec import eagle3_layer_ids, speculative_config
from engine import LLM, SamplingParams

PROMPTS = [random_prompt(n, 4100 + n) for n in (1, 7, 40, 150)]


def hs_transfer(path: Path, **extra) -> dict:
    return {"kv_connector": "HiddenStatesConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(path), **extra}}


def extractor(model_dir, out: Path, layer_ids, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_gpu_blocks", 200)
    kw.setdefault("kv_transfer_config", hs_transfer(out))
    return LLM(str(model_dir), speculative_config=speculative_config(layer_ids), **kw)


def prefill(llm: LLM, prompts, ids, **kw):
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False, request_ids=ids, **kw)


@torch.no_grad()
def hf_states(model, prompt) -> list[torch.Tensor]:
    """[N+1] residual streams, index k = after decoder layer k-1 before the final norm."""
    pre_norm = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda mod, args, out: pre_norm.setdefault("h", out[0] if isinstance(out, tuple) else out))
    try:
        hs = model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return [h[0] for h in hs[:-1]] + [pre_norm["h"][0]]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3", "qwen3_moe", "gemma4"])
def test_exported_states_equal_transformers(ckpt_dir, hf_model, tmp_path, kind):
    layer_ids = [LAYERS, 0, 1]  # file order is the order given, not sorted
    out = tmp_path / "hs"
    llm = extractor(ckpt_dir(kind), out, layer_ids, max_num_batched_tokens=32)  # chunked prefill too
    try:
        outs = prefill(llm, PROMPTS, [f"p{i}" for i in range(len(PROMPTS))])
    finally:
        llm.close()
    model = hf_model(kind)
    for i, (prompt, o) in enumerate(zip(PROMPTS, outs)):
        path = Path(o.kv_transfer_params["hidden_states_path"])
        assert path == out / f"p{i}.safetensors"
        data = load_file(path)
        assert set(data) == {"hidden_states", "token_ids"}
        assert data["token_ids"].dtype == torch.int64 and data["token_ids"].tolist() == prompt
        hs = data["hidden_states"]
        assert hs.dtype == torch.float32 and hs.shape == (len(prompt), len(layer_ids), model.config.hidden_size)
        ref = hf_states(model, prompt)
        for j, lid in enumerate(layer_ids):
            # float32 summed in another order than transformers' SDPA (kvtier's attention kernels):
            # errors grow with the residual stream's scale (~20 here), so the bound is relative to
            # it: 1e-6 of the scale is a few ulps of the largest element, far below any real defect.
            scale = ref[lid].abs().max().item()
            # Gemma norms each sublayer's output before adding it (post_attention/post_feedforward),
            # which scales a small output's rounding up to the residual's size: measured 1.8e-6 (torch
            # path) to 2.8e-6 (C++ kernels) of the scale after its last layer, logits within 1.7e-6.
            # A wrong window or norm shows as 1e-2 and more.
            tol = 1e-5 if kind.startswith("gemma") else 1e-6
            torch.testing.assert_close(hs[:, j], ref[lid], rtol=1e-5, atol=tol * scale, msg=f"layer id {lid}")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        assert meta == {"model": ckpt_dir(kind).name, "layer_ids": json.dumps(layer_ids), "format_version": "1"}


def test_states_are_bit_identical_from_g1_g2_and_g3(ckpt_dir, tmp_path):
    """The same prompt's file, computed fresh and with its prefix from G1, G2 and G3."""
    model_dir, ids = ckpt_dir("qwen3"), [0, 1, LAYERS]
    prompt = random_prompt(300, 4200)
    out = tmp_path / "hs"
    multi = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "TieredOffloadConnector"}, hs_transfer(out)]}}
    files: dict[str, torch.Tensor] = {}
    llm = extractor(model_dir, out, ids, kv_transfer_config=multi, kv_offloading_size=0.05,
                    kv_offload_disk=str(tmp_path / "g3"))
    try:
        for label, tier in (("fresh", None), ("G1", "G1"), ("G2", "G2")):
            if tier == "G2":
                llm.engine.flush_offload()
                llm.engine.pool.reset_prefix_cache()
            (o,) = prefill(llm, [prompt], [label])
            if tier is None:
                assert o.num_cached_tokens == 0
            else:
                assert o.cached_tokens_by_tier.get(tier, 0) >= 256, o.cached_tokens_by_tier
            files[label] = load_file(out / f"{label}.safetensors")["hidden_states"]
    finally:
        llm.close()
    llm = extractor(model_dir, out, ids, kv_transfer_config=multi, kv_offload_disk=str(tmp_path / "g3"))  # G3 only
    try:
        (o,) = prefill(llm, [prompt], ["G3"])
        assert o.cached_tokens_by_tier.get("G3", 0) >= 256, o.cached_tokens_by_tier
        files["G3"] = load_file(out / "G3.safetensors")["hidden_states"]
    finally:
        llm.close()
    for label in ("G1", "G2", "G3"):
        assert torch.equal(files[label], files["fresh"]), f"{label}: exported states differ from a fresh prefill"


def test_output_tokens_are_included_on_request(ckpt_dir, tmp_path):
    out = tmp_path / "hs"
    llm = extractor(ckpt_dir("llama"), out, [1], kv_transfer_config=hs_transfer(out, include_output_tokens=True))
    try:
        sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        (o,) = llm.generate([{"prompt_token_ids": PROMPTS[2]}], sp, use_tqdm=False, request_ids=["x"])
    finally:
        llm.close()
    data = load_file(out / "x.safetensors")
    # Every output token but the last went through the model.
    assert data["token_ids"].tolist() == PROMPTS[2] + list(o.outputs[0].token_ids[:-1])
    assert data["hidden_states"].shape[0] == len(PROMPTS[2]) + 4


@pytest.mark.parametrize("layer_ids, match", [
    ([-1], "integers >= 0"), ([LAYERS + 1], "exceed the model"), ([], "empty"), ([1, 1], "duplicates"),
])
def test_bad_layer_ids_fail_before_any_work(ckpt_dir, tmp_path, layer_ids, match):
    with pytest.raises(ValueError, match=match):
        extractor(ckpt_dir("llama"), tmp_path / "hs", layer_ids)
    assert not (tmp_path / "hs").exists() or not any((tmp_path / "hs").iterdir())


def test_unwritable_output_directory_fails_before_any_work(ckpt_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="not writable"):
        extractor(ckpt_dir("llama"), blocker / "hs", [1])


def test_connector_and_speculative_config_need_each_other(ckpt_dir, tmp_path):
    with pytest.raises(ValueError, match="HiddenStatesConnector"):
        LLM(str(ckpt_dir("llama")), speculative_config=speculative_config([1]), num_gpu_blocks=64)
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(str(ckpt_dir("llama")), kv_transfer_config=hs_transfer(tmp_path / "hs"), num_gpu_blocks=64)
    with pytest.raises(ValueError, match="not supported"):
        LLM(str(ckpt_dir("llama")), speculative_config={"method": "medusa", "num_speculative_tokens": 2}, num_gpu_blocks=64)


def test_vllm_connector_name_is_an_alias(ckpt_dir, tmp_path):
    out = tmp_path / "hs"
    cfg = {**hs_transfer(out), "kv_connector": "ExampleHiddenStatesConnector"}
    llm = extractor(ckpt_dir("llama"), out, [1], kv_transfer_config=cfg)
    try:
        (o,) = prefill(llm, [PROMPTS[1]], ["a"])
    finally:
        llm.close()
    assert load_file(o.kv_transfer_params["hidden_states_path"])["token_ids"].tolist() == PROMPTS[1]


def test_eagle3_default_layers():
    assert eagle3_layer_ids(32) == [2, 16, 29]
    assert eagle3_layer_ids(32, include_last=True) == [2, 16, 29, 32]
    assert eagle3_layer_ids(4) == [2, 1]


def test_prefix_states_come_from_the_offload_block(ckpt_dir, tmp_path):
    """Control for the test above: noise in the hidden-state section of every G2 slot (KV and
    headers kept) shows up in the file, so prefix states are read from the block, not recomputed."""
    from connectors.codec import hidden_payload

    model_dir, out = ckpt_dir("qwen3"), tmp_path / "hs"
    prompt = random_prompt(300, 4201)
    multi = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "TieredOffloadConnector"}, hs_transfer(out)]}}
    llm = extractor(model_dir, out, [1], kv_transfer_config=multi, kv_offloading_size=0.05)
    try:
        prefill(llm, [prompt], ["fresh"])
        llm.engine.flush_offload()
        llm.engine.pool.reset_prefix_cache()
        tiered = llm.engine.connector.connectors[0]
        for slot in range(tiered.g2.num_slots):
            hidden_payload(tiered.g2.slot_view(slot), tiered.layout).normal_()
        (o,) = prefill(llm, [prompt], ["noisy"])
        assert o.cached_tokens_by_tier == {"G2": 288}
    finally:
        llm.close()
    fresh = load_file(out / "fresh.safetensors")["hidden_states"]
    noisy = load_file(out / "noisy.safetensors")["hidden_states"]
    assert not torch.equal(noisy[:288], fresh[:288])
    assert torch.equal(noisy[288:], fresh[288:])  # the recomputed tail is unaffected


def test_writer_queue_is_bounded_and_applies_backpressure(tmp_path, monkeypatch):
    """With the writer stuck, gathering more finished requests than the queue holds blocks
    (the step loop waits) instead of piling states up in memory; all files land once it moves."""
    import threading
    import time
    from types import SimpleNamespace

    import connectors.hidden_states as hs_module
    from connectors.hidden_spec import HiddenStatesSpec
    from kvstore.g1 import BlockPool
    from policies import make_policy

    gate = threading.Event()
    real_write = hs_module.write_atomically
    monkeypatch.setattr(hs_module, "write_atomically", lambda *a: (gate.wait(10), real_write(*a)))
    pool = BlockPool(16, make_policy("lru"))
    conn = hs_module.HiddenStatesConnector(tmp_path, HiddenStatesSpec((1,)), pool, 4, "m",
                                           writer_threads=1, max_queued_files=1)
    conn.register_hidden_cache(torch.randn(16, 4, 1, 8))
    for i in range(4):  # four finished 6-token requests, each on its own two blocks
        blocks = pool.allocate(2)
        req = SimpleNamespace(error=None, num_computed_tokens=6, num_prompt_tokens=6, num_tokens=7,
                              request_id=f"r{i}", all_token_ids=list(range(7)), lora_tag=None)
        conn.request_finished(req, blocks)
        pool.release(blocks)
    worker = threading.Thread(target=conn.get_finished)
    worker.start()
    time.sleep(0.3)
    assert worker.is_alive(), "gathering did not wait for the stuck writer"
    assert conn._queue.qsize() <= 1  # noqa: SLF001
    gate.set()
    worker.join(10)
    conn.close()
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [f"r{i}.safetensors" for i in range(4)]
    assert all(load_file(p)["hidden_states"].shape == (6, 1, 8) for p in tmp_path.glob("*.safetensors"))
    pool.check_integrity()
    assert pool.num_free_blocks() == 16  # the connector's holds were all released
