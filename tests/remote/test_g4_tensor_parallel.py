"""G4 under tensor parallelism (issue 41, acceptance 2) on a real Redis: two ranks each write
their shard of every block under a namespace naming the layout and the rank; a second two-rank
engine loads both shards from Redis and gives the tokens of one rank with offload off; a one-rank
engine on the same Redis never reads them (docs/parallel.md)."""
from __future__ import annotations

from checkpoints import random_prompt
from engine import LLM, SamplingParams

SETTINGS = {"dtype": "float32", "num_gpu_blocks": 12, "max_num_batched_tokens": 32, "seed": 0}
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
FIRST_ROUND = [{"prompt_token_ids": random_prompt(91, 7100 + i)} for i in range(3)]


def run(model, **extra):
    with LLM(model, **SETTINGS, **extra) as llm:
        outs = llm.generate(FIRST_ROUND, PARAMS, use_tqdm=False)
        llm.engine.flush_offload()  # every rank's writes are in Redis before the engine goes
    return [o.outputs[0].token_ids for o in outs], [o.cached_tokens_by_tier.get("G4", 0) for o in outs]


def test_two_ranks_reuse_their_g4_shards_and_one_rank_does_not(ckpt_dir, redis_proc):
    model = str(ckpt_dir("llama"))
    ref, _ = run(model)
    g4 = {"kv_offload_remote": redis_proc.url, "kv_offload_remote_trusted": True}
    tokens, hits = run(model, tensor_parallel_size=2, **g4)
    assert tokens == ref and hits == [0, 0, 0]
    tokens, hits = run(model, tensor_parallel_size=2, **g4)  # a fresh engine: G1 and G2 empty
    assert tokens == ref and hits == [80, 80, 80]  # each prompt's five full blocks, from both ranks' shards
    tokens, hits = run(model, **g4)
    assert tokens == ref and hits == [0, 0, 0]
