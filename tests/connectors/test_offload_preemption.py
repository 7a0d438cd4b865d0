"""A preempted request reloads its offloaded blocks from G2 instead of recomputing them."""
from __future__ import annotations

from checkpoints import random_prompt
from engine import LLM, SamplingParams

PROMPTS = [random_prompt(160, s) for s in (2400, 2402, 2407)]  # distinct: no prefix is shared


def test_preempted_requests_come_back_from_g2(ckpt_dir):
    ckpt = str(ckpt_dir("qwen3"))
    sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    ref = LLM(ckpt, dtype="float32", enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": p} for p in PROMPTS], sp,
                                                         use_tqdm=False)]
    # 24 G1 blocks hold ~1.5 of these requests as they grow to 256 tokens: preemption must happen.
    llm = LLM(ckpt, dtype="float32", num_gpu_blocks=24, kv_offloading_size=0.01, kv_offload_block_size=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    stats = llm.get_stats()
    assert stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == want
    # Nothing repeats across requests, so every G2 hit is a preempted request coming back.
    assert stats.tiers["G2"]["hit_tokens"] > 0
    assert all(o.num_cached_tokens == 0 for o in outs)  # a resume's reload is not a prompt-cache hit
    llm.engine.flush_offload()
    llm.engine.check_integrity()
    llm.engine.connector.g2.check_integrity()
    llm.close()
