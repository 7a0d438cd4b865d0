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


@pytest.mark.parametrize("settings", [
    {}, {"async_scheduling": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}},
], ids=["sync", "async", "ngram"])
def test_chunked_prefill_and_decode_batches_keep_each_rows_adapter(adapters, settings):
    base, dirs, want = adapters["llama"]
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=64,
             max_num_batched_tokens=24, enable_prefix_caching=False, **settings) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                            lora_request=[request(dirs[i % 3], i % 3) for i in range(len(PROMPTS))])
    assert [o.outputs[0].token_ids for o in outs] == [want[dirs[i % 3]][i] for i in range(len(PROMPTS))]


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
