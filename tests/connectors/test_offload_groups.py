"""Issue 16, acceptance 2: offload per KV group on the Gemma 4 random checkpoints (sliding and full
layers, per-layer head sizes, shared KV; gemma4_moe: two full groups and packed sliding rows), and
on Mistral windowed on every layer (one sliding group).

Oracle: the same engine with offload off and prefix caching off (offload_helpers.reference, itself
equal to transformers' greedy tokens). The offload tiers keep G1's KV groups: each group's share of
an offload block is an entry of its own, and a hit loads the full groups' blocks for the whole
prefix but the sliding groups' only for the window before its end. Bytes moved are checked
against that count, and against the same workload with one group of every layer (what offload
did before, and still does with `--disable-hybrid-kv-cache-manager`)."""
from __future__ import annotations

import pytest

from checkpoints import SLIDING_WINDOW, random_prompt
from offload_helpers import (OB, check_integrity, hit_tokens, load_kinds, offload_llm, reads_through_get_into, reference, run,
                             tokens, workload)

PROMPTS = workload()
EXPECTED_HITS = [hit_tokens(len(p)) for p in PROMPTS]
BS = 16


def _second_pass(llm):
    """Cold pass, then (stores settled, G1's prefix cache dropped) the pass served from below G1."""
    first = run(llm, PROMPTS)
    llm.engine.connector.flush()
    llm.engine.pool.reset_prefix_cache()
    before = llm.get_stats().tiers["load_bytes"]
    return first, run(llm, PROMPTS), llm.get_stats().tiers["load_bytes"] - before


def _expected_load_blocks(windows: tuple[int, ...]) -> int:
    """G1 blocks a hit fills per group: full groups every block up to the hit's end, sliding
    groups those from the first block their window reaches at that end."""
    total = 0
    for end in EXPECTED_HITS:
        last = -(-end // BS)
        total += sum(last - (max(0, end - w + 1) // BS if w else 0) for w in windows)
    return total


@pytest.mark.parametrize("kind, tier", [("gemma4", "G2"), ("gemma4", "G3"), ("gemma4_moe", "G2"), ("gemma4_moe", "G3"),
                                        ("mistral_swa", "G2")])
def test_grouped_offload_serves_identical_tokens_and_loads_only_windows(ckpt_dir, tmp_path, kind, tier):
    path = ckpt_dir(kind)
    ref = reference(path, PROMPTS)
    where = {"kv_offloading_size": 0.05} if tier == "G2" else {"kv_offload_disk": str(tmp_path / "g3")}
    llm = offload_llm(path, num_gpu_blocks=256, **where)
    try:
        windows = llm.engine.kv.windows
        assert SLIDING_WINDOW in windows and (0 in windows) == (kind != "mistral_swa")  # the groups stay
        first, second, moved = _second_pass(llm)
        assert tokens(first) == ref and tokens(second) == ref
        assert load_kinds(second) == [{tier: n} for n in EXPECTED_HITS]
        tiers = llm.get_stats().tiers
        assert tiers[tier]["hit_tokens"] == sum(EXPECTED_HITS) and tiers["load_failures"] == 0
        block_bytes = llm.engine.connector.layout.payload_bytes // llm.engine.connector.layout.g1_blocks
        assert moved == _expected_load_blocks(windows) * block_bytes
        # The loaded blocks before the windows were never written: they must not become G1 hits
        # for a prompt sharing a shorter prefix (its window lies in them).
        branch = PROMPTS[2][:300] + random_prompt(40, 7199)
        (out,) = run(llm, [branch])
        assert out.outputs[0].token_ids == reference(path, [branch])[0]
        assert out.num_cached_tokens == 256  # from the tier: G1 keeps no sliding block of that window
        check_integrity(llm)
    finally:
        llm.close()


def test_a_hit_moves_fewer_bytes_than_a_full_history_load(ckpt_dir, tmp_path):
    """The same G2 workload with KV groups and with one group of every layer: the same tokens
    and hits; the grouped load moves only the sliding layers' windows."""
    path = ckpt_dir("gemma4")
    ref = reference(path, PROMPTS)
    moved = {}
    for one_group in (False, True):
        llm = offload_llm(path, num_gpu_blocks=256, kv_offloading_size=0.05,
                          disable_hybrid_kv_cache_manager=one_group)
        try:
            assert (len(llm.engine.kv.windows) == 1) == one_group
            _, second, moved[one_group] = _second_pass(llm)
            assert tokens(second) == ref
            assert [o.num_cached_tokens for o in second] == EXPECTED_HITS
        finally:
            llm.close()
    # 3 layers with a cache, one group of each with KV groups: one full, two sliding
    grouped_blocks = _expected_load_blocks((0, SLIDING_WINDOW, SLIDING_WINDOW))
    layer_block = moved[False] // grouped_blocks  # one layer's K and V of one G1 block
    assert moved[False] == grouped_blocks * layer_block
    assert moved[True] == 3 * sum(-(-n // BS) for n in EXPECTED_HITS) * layer_block
    assert moved[False] < 0.5 * moved[True], moved


def _sliding_keys(llm, prompt, from_chunk: int) -> set:
    """The sliding groups' entry keys for the prompt's offload blocks from `from_chunk` on."""
    from kvstore.keys import extend_keys, group_key

    keys: list = []
    extend_keys(keys, prompt, BS, None)
    k = OB // BS
    return {group_key(keys[(j + 1) * k - 1], g) for j in range(from_chunk, len(prompt) // OB)
            for g, w in enumerate(llm.engine.kv.windows) if w}


@pytest.mark.parametrize("fault", ["missing", "read_error"])
def test_sliding_entries_missing_or_failing_shorten_or_drop_the_hit(ckpt_dir, tmp_path, monkeypatch, fault):
    """The longest prompt's sliding-group entries from its 6th offload block on are gone from G3
    (`missing`: the lookup does not find them) or fail to read (`read_error`: found, then the
    load fails). Missing: the hit is the longest prefix whose window every group can serve
    (5 blocks: the window before token 320 lies in block 4). Failing: the sliding window was
    loaded for the hit's end only, so the whole hit is recomputed. Tokens stay the oracle's."""
    path = ckpt_dir("gemma4")
    ref = reference(path, PROMPTS)
    llm = offload_llm(path, num_gpu_blocks=256, kv_offload_disk=str(tmp_path / "g3"))
    try:
        run(llm, PROMPTS)
        llm.engine.connector.flush()
        llm.engine.pool.reset_prefix_cache()
        bad = _sliding_keys(llm, PROMPTS[2], 5)
        tier = llm.engine.connector.tiers[0]
        if fault == "missing":
            real = tier.lookup

            def lookup(keys):
                n = real(keys)
                return next((i for i, key in enumerate(keys[:n]) if key in bad), n)

            monkeypatch.setattr(tier, "lookup", lookup)
        else:
            real_get = tier.backend.get_into

            def get_into(keys, bufs):
                if any(key in bad for key in keys):
                    raise OSError("injected read error")
                return real_get(keys, bufs)

            monkeypatch.setattr(tier.backend, "get_into", get_into)
            reads_through_get_into(tier.backend)
        second = run(llm, PROMPTS)
        assert tokens(second) == ref
        want_last = 5 * OB if fault == "missing" else 0
        assert [o.num_cached_tokens for o in second] == EXPECTED_HITS[:2] + [want_last]
        assert llm.get_stats().tiers["load_failures"] == (fault == "read_error")
        check_integrity(llm)
    finally:
        llm.close()
