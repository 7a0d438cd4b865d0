"""Issue 46: LoRA adapters (PEFT's format) on one base model, batched in one forward, with KV
keyed by the adapter's files.

Oracle: transformers + peft with the adapter merged into the weights, greedy, for random-weight
adapters on the Llama and Qwen3 checkpoints (q/k/v/o and MLP targets, ranks 8 and 64), in steps
mixing three adapters and the base model; the engine itself with LoRA off for the base rows; a
plain comparison of cached tokens for isolation."""
from __future__ import annotations

import json
import shutil

import pytest

import checkpoints as C
import checkpoints_lora as L
from engine.llm import LLM
from engine.lora.adapter import LoRARequest
from engine.sampling_params import SamplingParams

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
BLOCK = 16
PROMPTS = [C.random_prompt(n, seed) for n, seed in ((37, 1), (20, 2), (45, 3), (29, 4))]


@pytest.fixture(scope="module")
def adapters(ckpt_dir, tmp_path_factory):
    """Per kind: three adapters (all seven targets at rank 8; attention only at rank 64; MLP only
    at rank 8, rsLoRA scaling) and the oracle's tokens for each prompt under each and the base."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for kind in ("llama", "qwen3"):
        base = ckpt_dir(kind)
        dirs = [L.build_adapter(base, root / f"{kind}-a", rank=8, seed=1),
                L.build_adapter(base, root / f"{kind}-b", rank=64, targets=("q_proj", "k_proj", "v_proj", "o_proj"),
                                seed=2, std=0.05),
                L.build_adapter(base, root / f"{kind}-c", rank=8, targets=("gate_proj", "up_proj", "down_proj"), seed=3,
                                use_rslora=True)]
        want = {d: L.hf_greedy(base, d, PROMPTS, MAX_TOKENS) for d in [None, *dirs]}
        out[kind] = (base, dirs, want)
    return out


def request(d, i: int) -> LoRARequest | None:
    return LoRARequest(d.name, i + 1, str(d)) if d is not None else None


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_mixed_batches_of_three_adapters_and_the_base_equal_peft_merged(adapters, kind):
    base, dirs, want = adapters[kind]
    choices = [None, *dirs]
    assert len({tuple(want[d][0]) for d in choices}) == 4  # every adapter moves the tokens
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=64) as llm:
        # every prompt under every adapter and the base, all in one batch
        pairs = [(p, d) for p in range(len(PROMPTS)) for d in choices]
        outs = llm.generate([{"prompt_token_ids": PROMPTS[p]} for p, _ in pairs], GREEDY, use_tqdm=False,
                            lora_request=[request(d, choices.index(d)) for _, d in pairs])
        assert [o.outputs[0].token_ids for o in outs] == [want[d][p] for p, d in pairs]
        llm.engine.loras.check_integrity()


@pytest.mark.parametrize("variant", ["sync", "async", "ngram", "draft", "eagle3"])
def test_chunked_prefill_and_decode_batches_keep_each_rows_adapter(adapters, variant, tmp_path):
    """Also under speculation: the draft (the base checkpoint itself, or an EAGLE-3 head) runs
    without the adapter; verification under it keeps the tokens the merged model's."""
    base, dirs, want = adapters["llama"]
    settings = {"sync": {}, "async": {"async_scheduling": True},
                "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
                "draft": {"speculative_config": {"method": "draft_model", "model": str(base), "num_speculative_tokens": 3,
                                                 "adaptive": False}}}.get(variant)
    if variant == "eagle3":
        draft = C.build_eagle3_draft(base, tmp_path / "eagle", seed=4)
        settings = {"speculative_config": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3,
                                           "adaptive": False}}
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=64,
             max_num_batched_tokens=24, enable_prefix_caching=False, **settings) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                            lora_request=[request(dirs[i % 3], i % 3) for i in range(len(PROMPTS))])
        proposed = llm.engine.spec.stats.num_draft_tokens if variant in ("draft", "eagle3") else None
    assert [o.outputs[0].token_ids for o in outs] == [want[dirs[i % 3]][i] for i in range(len(PROMPTS))]
    assert proposed is None or proposed > 0


def test_the_same_prompt_under_two_adapters_shares_no_blocks(adapters):
    base, dirs, want = adapters["qwen3"]
    a, b = request(dirs[0], 0), request(dirs[1], 1)
    prompt = {"prompt_token_ids": PROMPTS[2]}
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=64) as llm:
        first = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
        other = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=b)[0]
        plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
    assert first.num_cached_tokens == other.num_cached_tokens == plain.num_cached_tokens == 0
    assert again.num_cached_tokens == (len(PROMPTS[2]) - 1) // BLOCK * BLOCK
    assert [first.outputs[0].token_ids, other.outputs[0].token_ids, plain.outputs[0].token_ids,
            again.outputs[0].token_ids] == [want[dirs[0]][2], want[dirs[1]][2], want[None][2], want[dirs[0]][2]]


def test_an_adapter_changed_on_disk_under_its_name_gets_no_hits_from_its_old_entries(adapters, tmp_path):
    base, dirs, want = adapters["llama"]
    live = tmp_path / "live"
    shutil.copytree(dirs[0], live)
    req = LoRARequest("live", 1, str(live))
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=64) as llm:
        old = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=req)[0]
        shutil.rmtree(live)
        shutil.copytree(dirs[2], live)  # new weights, same name and path
        new = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=req)[0]
        same = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=req)[0]
    assert old.outputs[0].token_ids == want[dirs[0]][0]
    assert new.num_cached_tokens == 0 and new.outputs[0].token_ids == want[dirs[2]][0]
    assert same.num_cached_tokens > 0 and same.outputs[0].token_ids == want[dirs[2]][0]


def test_adapter_blocks_from_g3_after_a_restart_only_for_the_same_adapter(adapters, tmp_path):
    base, dirs, want = adapters["llama"]
    a, b = request(dirs[0], 0), request(dirs[2], 2)
    prompt = {"prompt_token_ids": PROMPTS[2]}
    settings = dict(dtype="float32", enable_lora=True, max_loras=2, kv_offload_disk=str(tmp_path / "g3"),
                    kv_offload_block_size=BLOCK)
    with LLM(str(base), **settings) as llm:
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)
        llm.engine.connector.flush()
    with LLM(str(base), **settings) as llm:  # a restart: G1 and G2 are empty
        other = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=b)[0]
        plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        llm.engine.pool.reset_prefix_cache()
        same = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
    assert other.num_cached_tokens == plain.num_cached_tokens == 0
    assert dict(same.cached_tokens_by_tier) == {"G3": (len(PROMPTS[2]) - 1) // BLOCK * BLOCK}
    assert same.outputs[0].token_ids == want[dirs[0]][2] and other.outputs[0].token_ids == want[dirs[2]][2]


def test_adapters_over_the_limits_are_refused_by_name(adapters, tmp_path):
    base, dirs, _ = adapters["llama"]
    bad = tmp_path / "dora"
    shutil.copytree(dirs[0], bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, lora_target_modules="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj") as llm:
        with pytest.raises(ValueError, match="rank 64 is over --max-lora-rank 16"):
            llm.generate(prompt, GREEDY, lora_request=request(dirs[1], 1))
        with pytest.raises(ValueError, match="use_dora=True is not supported"):
            llm.generate(prompt, GREEDY, lora_request=LoRARequest("dora", 9, str(bad)))
        with pytest.raises(ValueError, match="not found"):
            llm.generate(prompt, GREEDY, lora_request=LoRARequest("none", 9, str(tmp_path / "missing")))
        huge = tmp_path / "huge"  # bounded before anything is read: the step loop reads adapters
        shutil.copytree(dirs[0], huge)
        with open(huge / "adapter_model.safetensors", "ab") as f:
            f.write(b"\0" * (2 << 20))
        with pytest.raises(ValueError, match=r"bytes, more than an adapter within --max-lora-rank 16 can be"):
            llm.generate(prompt, GREEDY, lora_request=LoRARequest("huge", 9, str(huge)))
        assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(base), dtype="float32", enable_lora=True, lora_target_modules="q_proj,v_proj") as llm:
        with pytest.raises(ValueError, match=r"module\(s\) \['down_proj', 'gate_proj', 'k_proj'"):
            llm.generate(prompt, GREEDY, lora_request=request(dirs[0], 0))
    with LLM(str(base), dtype="float32") as llm:
        with pytest.raises(ValueError, match="need enable_lora"):
            llm.generate(prompt, GREEDY, lora_request=request(dirs[0], 0))
    with pytest.raises(ValueError, match="max_loras applies to LoRA adapters"):
        LLM(str(base), dtype="float32", max_loras=2)


def test_g2_hits_only_for_the_same_adapter(adapters):
    base, dirs, want = adapters["qwen3"]
    a, b = request(dirs[0], 0), request(dirs[2], 2)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, kv_offloading_size=0.05,
             kv_offload_block_size=BLOCK) as llm:
        first = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
        llm.engine.connector.flush()
        llm.engine.pool.reset_prefix_cache()  # G1 emptied: what hits now comes from G2
        other = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=b)[0]
        llm.engine.pool.reset_prefix_cache()
        same = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids == want[dirs[2]][0]
    assert dict(same.cached_tokens_by_tier) == {"G2": (len(PROMPTS[0]) - 1) // BLOCK * BLOCK}
    assert same.outputs[0].token_ids == first.outputs[0].token_ids == want[dirs[0]][0]


def test_kv_events_and_hidden_state_files_name_the_adapter(adapters, tmp_path):
    """G1 and G2 BlockStored events carry vLLM's lora_name and lora_id (from the adapter's digest,
    kvstore.events.LoRATag), nil for the base model's blocks; the hidden-state file of a request
    under an adapter records it."""
    import time

    import msgpack
    import zmq
    from safetensors import safe_open

    from kvstore.events import LoRATag

    base, dirs, _ = adapters["llama"]
    a = request(dirs[0], 0)
    events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "topic": "t"}
    with LLM(str(base), dtype="float32", enable_lora=True, kv_events_config=events_cfg, kv_offloading_size=0.05,
             kv_offload_block_size=BLOCK) as llm:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.connect(llm.engine.publisher.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"t")
        time.sleep(0.3)  # ZMQ's slow joiner
        llm.generate({"prompt_token_ids": PROMPTS[2]}, GREEDY, use_tqdm=False, lora_request=a)
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)
        llm.engine.flush_offload()
        llm.generate({"prompt_token_ids": C.random_prompt(5, 10)}, GREEDY, use_tqdm=False)  # publishes the offloads
        tag = LoRATag.of(a.lora_name, llm.engine.loras.get(a.lora_name).digest)
        events, until = [], time.monotonic() + 1.5
        while time.monotonic() < until:
            if sub.poll(100):
                events.extend(msgpack.unpackb(sub.recv_multipart()[2], raw=False)[1])
        sub.close()
    stored = [e for e in events if e["type"] == "BlockStored"]
    first = {p: {(e["medium"], e["lora_name"], e["lora_id"]) for e in stored
                 if e["parent_block_hash"] is None and e["token_ids"][:BLOCK] == PROMPTS[p][:BLOCK]} for p in (2, 0)}
    assert first == {2: {("GPU", a.lora_name, tag.id), ("CPU", a.lora_name, tag.id)},
                     0: {("GPU", None, None), ("CPU", None, None)}}
    assert {(e["lora_name"], e["lora_id"]) for e in stored} == {(a.lora_name, tag.id), (None, None)}
    assert 0 < tag.id < 2**31

    from connectors.hidden_spec import speculative_config

    conn = {"kv_connector": "HiddenStatesConnector", "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    with LLM(str(base), dtype="float32", enable_lora=True, speculative_config=speculative_config([1]),
             kv_transfer_config=conn) as llm:
        outs = llm.generate([{"prompt_token_ids": PROMPTS[1]}] * 2, SamplingParams(max_tokens=1), use_tqdm=False,
                            lora_request=[a, None])
        llm.engine.connector.flush()
    meta = [safe_open(o.kv_transfer_params["hidden_states_path"], "pt").metadata() for o in outs]
    assert (meta[0]["lora_name"], int(meta[0]["lora_id"])) == (a.lora_name, tag.id)
    assert "lora_name" not in meta[1] and "lora_id" not in meta[1]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_two_tensor_parallel_ranks_give_peft_merged_tokens(adapters, kind):
    """Adapters cut as their base modules are (B's rows on q/k/v and gate/up, A's columns on o and
    down, whose all-reduce then sums base and update): two gloo ranks, three adapters and the base
    in one batch, loaded by rank 0 and sent to the worker, equal transformers + peft."""
    base, dirs, want = adapters[kind]
    choices = [None, *dirs]
    pairs = [(p, d) for p in range(len(PROMPTS)) for d in choices]
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=64, tensor_parallel_size=2,
             max_num_batched_tokens=64) as llm:
        outs = llm.generate([{"prompt_token_ids": PROMPTS[p]} for p, _ in pairs], GREEDY, use_tqdm=False,
                            lora_request=[request(d, choices.index(d)) for _, d in pairs])
    assert [o.outputs[0].token_ids for o in outs] == [want[d][p] for p, d in pairs]


def test_structured_outputs_under_an_adapter_equal_the_merged_checkpoints(adapters, tmp_path):
    """A choice and a regex under an adapter, beside unconstrained and base rows, pick what the
    same constraints pick on a checkpoint with the adapter merged into its weights (LoRA off)."""
    import re

    from transformers import AutoTokenizer

    base, dirs, _ = adapters["llama"]
    merged = tmp_path / "merged"
    L.load_merged(base, dirs[0]).save_pretrained(merged)
    tok = AutoTokenizer.from_pretrained(base)
    tok.save_pretrained(merged)
    words = [tok.decode([i]) for i in range(40, 60)]  # one token each: the tokenizer has no space token
    choices = words[:10]
    regex = "|".join(words[10:])
    params = [SamplingParams(temperature=0, max_tokens=12, structured_outputs={"choice": choices}),
              SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": regex}), GREEDY]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    with LLM(str(base), dtype="float32", enable_lora=True) as llm:
        got = llm.generate(prompts * 2, params * 2, use_tqdm=False, lora_request=[request(dirs[0], 0)] * 3 + [None] * 3)
    with LLM(str(merged), dtype="float32") as llm:
        want = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got[:3]] == [o.outputs[0].token_ids for o in want]
    assert got[0].outputs[0].text in choices and re.fullmatch(regex, got[1].outputs[0].text), got[1].outputs[0].text
    assert got[3].outputs[0].text in choices and re.fullmatch(regex, got[4].outputs[0].text)
    assert [o.outputs[0].text for o in got[:2]] != [o.outputs[0].text for o in got[3:5]]  # the adapter moved a pick
