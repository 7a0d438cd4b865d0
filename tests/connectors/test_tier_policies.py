"""Issue 18: G2's and G3's eviction policies get each offload block's BlockInfo when it is stored
(its index in the request, the key of the block before it, the request's arrival, priority and
cache salt) and a touch_block on every reuse, a G2 load or a G3 read, exactly once. The policies
come from the per-tier keys, in the mapping and JSON forms, with the tier's size in blocks."""
from __future__ import annotations

import json

from checkpoints import random_prompt
from kvstore.keys import chain_keys
from offload_helpers import OB, g2_gib, greedy, offload_llm
from policies import BlockInfo
from recording_policy import RecordingLRU

PROMPT = random_prompt(5 * OB + 10, 7301)
SALT, SESSION = "tenant-7", "conversation-7"
CHUNKS = 5  # offload blocks of the prompt (and of what a rerun loads)


def chunk_keys() -> list[bytes]:
    keys = chain_keys(PROMPT, 16, cache_salt=SALT)
    k = OB // 16
    return [keys[(j + 1) * k - 1] for j in range(CHUNKS)]


def expected(keys: list[bytes], arrival: float, priority: int) -> list[BlockInfo]:
    return [BlockInfo(j, keys[j - 1] if j else None, arrival, priority, SESSION) for j in range(CHUNKS)]


def spec(tag: str) -> dict:
    return {"name": "recording_policy:RecordingLRU", "options": {"tag": tag}}


def test_g2_and_g3_policies_see_block_infos_and_every_reuse(model_dir, tmp_path):
    RecordingLRU.made.clear()
    keys = chunk_keys()
    extra = {"g2_eviction_policy": spec("g2"), "g3_eviction_policy": json.dumps(spec("g3"))}
    llm = offload_llm(model_dir, kv_offloading_size=g2_gib(model_dir, 16), kv_offload_disk=str(tmp_path / "g3"),
                      kv_transfer_config={"kv_connector_extra_config": extra})
    try:
        g2, g3 = RecordingLRU.tagged("g2"), RecordingLRU.tagged("g3")
        assert g2.capacity == 16
        assert g3.capacity is not None and g3.capacity > 16  # 10 GiB of blocks: approximate, but a count
        llm.generate([{"prompt_token_ids": PROMPT}], greedy(), priority=[3], cache_salt=SALT,
                     session=SESSION, use_tqdm=False)
        llm.engine.flush_offload()
        stored = g2.of("insert_block", keys)
        arrival = stored[0].arrival
        assert arrival > 0 and stored == expected(keys, arrival, 3)
        assert g3.of("insert_block", keys) == expected(keys, arrival, 3)  # with the write, not a later touch
        assert not [c for c in g2.calls + g3.calls if c[0] in ("insert", "touch")]

        llm.engine.pool.reset_prefix_cache()  # G1 forgets: the rerun loads from G2
        llm.generate([{"prompt_token_ids": PROMPT}], greedy(), priority=[1], cache_salt=SALT,
                     session=SESSION, use_tqdm=False)
        llm.engine.flush_offload()
        touched = g2.of("touch_block", keys)
        assert len(touched) == CHUNKS and touched == expected(keys, touched[0].arrival, 1)
        assert touched[0].arrival > arrival
        assert not g3.of("touch_block", keys)  # G2 served it all
    finally:
        llm.close()

    # Restart without G2: the rerun reads G3, each block touched once, with its info.
    llm = offload_llm(model_dir, kv_offload_disk=str(tmp_path / "g3"),
                      kv_transfer_config={"kv_connector_extra_config": {"g3_eviction_policy": spec("g3-again")}})
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(), priority=[2], cache_salt=SALT,
                     session=SESSION, use_tqdm=False)
        assert out[0].cached_tokens_by_tier.get("G3") == 5 * OB
        g3 = RecordingLRU.tagged("g3-again")
        touched = g3.of("touch_block", keys)
        assert touched == expected(keys, touched[0].arrival, 2)
        assert [c[0] for c in g3.calls if c[1] in keys] == ["insert"] * CHUNKS + ["touch_block"] * CHUNKS  # scan, reads
    finally:
        llm.close()
