"""G3 admission (issue 43, point 4): with g3_min_uses K a block is written to G3 once it has been used K
times (stored, or reused from G2), and once only. Oracles: a plain count of uses per block, and the
engine with offload off for the tokens."""
from __future__ import annotations

from checkpoints import random_prompt
from connectors.storage_tier import StorageTier
from kvstore.memory import MemoryBackend
from offload_helpers import OB, g2_gib, hit_tokens, load_kinds, offload_llm, reference, run, tokens


def test_admit_counts_uses_and_skips_what_the_tier_holds():
    backend = MemoryBackend(1 << 20)
    tier = StorageTier.parallel("G3", backend, min_uses=3)
    a, b = b"a" * 16, b"b" * 16
    assert [tier.admit(a) for _ in range(3)] == [False, False, True]
    assert tier.admit(b) is False
    backend.put([a], [b"x"])
    assert tier.admit(a) is False  # used again, but the tier has it
    backend.delete([a])
    assert tier.admit(a) is True  # gone from the tier (evicted): written again on the next use
    always = StorageTier.parallel("G3", MemoryBackend(1 << 20))
    assert all(always.admit(a) for _ in range(3))
    tier.close()
    always.close()


def test_g3_takes_a_block_on_its_second_use(model_dir, tmp_path):
    prompt = random_prompt(400, 7501)
    ref = reference(model_dir, [prompt])
    cfg = {"kv_connector_extra_config": {"g3_min_uses": 2}}
    llm = offload_llm(model_dir, kv_offload_disk=str(tmp_path / "g3"), kv_offloading_size=g2_gib(model_dir, 64),
                      kv_transfer_config=cfg)
    try:
        g3 = llm.engine.connector.tier("G3")
        assert tokens(run(llm, [prompt])) == ref
        llm.engine.connector.flush()
        assert len(g3.backend) == 0  # stored once: one use
        llm.engine.pool.reset_prefix_cache()
        outs = run(llm, [prompt])  # served from G2: the second use
        assert tokens(outs) == ref and load_kinds(outs) == [{"G2": hit_tokens(len(prompt))}]
        llm.engine.connector.flush()
        assert len(g3.backend) == len(prompt) // OB  # every full offload block, reused from G2
        written = g3.backend.stats.bytes_written
        llm.engine.pool.reset_prefix_cache()
        run(llm, [prompt])  # a third use: already in G3, not written again
        llm.engine.connector.flush()
        assert g3.backend.stats.bytes_written == written
    finally:
        llm.close()


def test_a_block_g3_holds_is_not_written_again(model_dir, tmp_path):
    """The block after a repeated prompt's hit (its last prompt tokens and the first output
    tokens) is recomputed and stored again; G3 holds those bytes already, under the same key,
    so it is not rewritten (it once was, on every repeat)."""
    prompt = random_prompt(250, 7502)  # a hit of 3 offload blocks; the 4th completes while decoding
    ref = reference(model_dir, [prompt])
    llm = offload_llm(model_dir, kv_offload_disk=str(tmp_path / "g3"))
    try:
        g3 = llm.engine.connector.tier("G3")
        assert tokens(run(llm, [prompt])) == ref
        llm.engine.connector.flush()
        assert len(g3.backend) == 4
        written = g3.backend.stats.bytes_written
        llm.engine.pool.reset_prefix_cache()
        outs = run(llm, [prompt])
        llm.engine.connector.flush()
        assert tokens(outs) == ref and load_kinds(outs) == [{"G3": 3 * OB}]
        assert g3.backend.stats.bytes_written == written and len(g3.backend) == 4
    finally:
        llm.close()
