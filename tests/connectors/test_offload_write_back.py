"""Write-back offload (`kv_connector_extra_config.write_policy = "write_back"`).

Oracle: offload off (offload_helpers.reference). Nothing may reach G2/G3 while the blocks are
still in G1; they go down only when G1 evicts them, and the second pass is then served from
the lower tier with identical tokens.
"""

from __future__ import annotations

import pytest

from offload_helpers import (
    OB,
    check_integrity,
    flush_g1,
    g2_gib,
    hit_tokens,
    load_kinds,
    offload_llm,
    reference,
    run,
    tokens,
    workload,
)

PROMPTS = workload()
EXPECTED_HITS = [hit_tokens(len(p)) for p in PROMPTS]
WRITE_BACK = {"kv_connector_extra_config": {"write_policy": "write_back"}}


@pytest.fixture(scope="module")
def ref(model_dir):
    return reference(model_dir, PROMPTS)


@pytest.mark.parametrize("tier", ["G2", "G3"])
def test_blocks_go_down_only_when_g1_evicts_them(model_dir, ref, tmp_path, tier):
    kw = {"kv_offloading_size": g2_gib(model_dir, 128)} if tier == "G2" else {"kv_offload_disk": str(tmp_path / "g3")}
    llm = offload_llm(model_dir, kv_transfer_config=WRITE_BACK, **kw)
    conn = llm.engine.connector
    store = conn.g2 if tier == "G2" else conn.tier("G3").backend
    try:
        first = run(llm, PROMPTS)
        assert tokens(first) == ref
        conn.flush()
        stats = llm.get_stats().tiers
        assert stats["write_policy"] == "write_back"
        assert len(store) == 0, "write-back copied blocks that G1 still holds"
        assert stats["dirty_blocks"] >= sum(EXPECTED_HITS) // OB
        flush_g1(llm)  # evicts every first-pass block: now they are written back
        stats = llm.get_stats().tiers
        assert stats["writeback_blocks"] >= sum(EXPECTED_HITS) // OB
        assert stats["writeback_dropped"] == 0
        assert len(store) == stats["writeback_blocks"]
        second = run(llm, PROMPTS)
        assert tokens(second) == ref
        assert load_kinds(second) == [{tier: n} for n in EXPECTED_HITS]
        assert llm.get_stats().tiers["load_failures"] == 0
        check_integrity(llm)
    finally:
        llm.close()


def test_write_back_needs_prefix_caching(model_dir):
    with pytest.raises(ValueError, match="prefix caching"):
        offload_llm(model_dir, kv_offloading_size=0.01, enable_prefix_caching=False, kv_transfer_config=WRITE_BACK)


def test_unknown_write_policy_names_the_choices(model_dir):
    bad = {"kv_connector_extra_config": {"write_policy": "write_sideways"}}
    with pytest.raises(ValueError, match="write_through"):
        offload_llm(model_dir, kv_offloading_size=0.01, kv_transfer_config=bad)
