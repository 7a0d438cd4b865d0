"""Issue 16: KV groups (engine/kv/kv_groups.py) and block tables per group (KVCacheManager).
Oracles: hand-derived layouts, and a brute-force reference for the longest prefix every group can
serve. End-to-end tests (Gemma's tokens, sliding groups' bounded blocks) are in test_sliding_window.py."""
from __future__ import annotations

import pytest

from engine.kv.kv_cache_manager import PLACEHOLDER, KVCacheManager
from engine.kv.kv_groups import KVGroup, KVLayout, plan_kv_layout
from engine.core.request import Request, RequestId
from engine.sampling_params import SamplingParams
from kvstore.g1 import BlockPool
from policies import make_policy


def test_gemma3_270m_pattern_makes_equal_groups_full_first():
    windows = tuple(512 if (i + 1) % 6 else 0 for i in range(18))  # layers 5, 11, 17 global
    layout = plan_kv_layout(windows)
    assert [(g.layer_ids, g.window) for g in layout.groups] == [
        ((5, 11, 17), 0), ((0, 1, 2), 512), ((3, 4, 6), 512), ((7, 8, 9), 512), ((10, 12, 13), 512), ((14, 15, 16), 512)]
    assert layout.slots == 3
    assert layout.placement()[11] == (0, 1, 0) and layout.placement()[6] == (2, 2, 0)


def test_one_kind_of_layer_is_one_group_and_uneven_kinds_leave_slots_unused():
    assert plan_kv_layout((0, 0, 0)) == KVLayout.single(3)
    assert plan_kv_layout((48, 48)).groups == (KVGroup((0, 1), 48),)
    layout = plan_kv_layout((0, 0, 8, 8, 8))  # 2 full, 3 sliding: groups of 2, the last sliding one half full
    assert [g.layer_ids for g in layout.groups] == [(0, 1), (2, 3), (4,)] and layout.slots == 2


def test_narrow_layers_share_a_slot_and_kv_sharing_layers_alias_their_source():
    """Gemma 4-like: sliding layers 32 wide, global ones 64 (two sliding layers a slot row); layers
    4 and 5 reuse layers 2 and 3's KV and get no cache of their own."""
    windows, widths = (8, 0, 8, 0, 8, 0), (32, 64, 32, 64, 32, 64)
    layout = plan_kv_layout(windows, widths, (0, 1, 2, 3, 2, 3))
    assert [(g.layer_ids, g.window, g.per_slot) for g in layout.groups] == [((1,), 0, 1), ((3,), 0, 1), ((0, 2), 8, 2)]
    assert layout.slots == 1 and layout.aliases == ((4, 2), (5, 3)) and layout.num_layers == 6
    assert layout.placement() == [(2, 0, 0), (0, 0, 0), (2, 0, 1), (1, 0, 0), (2, 0, 1), (1, 0, 0)]
    single = KVLayout.single(6, sources=(0, 1, 2, 3, 2, 3))
    assert single.groups == (KVGroup((0, 1, 2, 3), 0),) and single.slots == 4
    with pytest.raises(ValueError, match="alias"):
        KVLayout((KVGroup((0, 1), 0),), aliases=((2, 3),))


def test_per_layer_views_are_disjoint_and_read_back_what_was_written():
    """The cache views of layers of different shapes (engine/runner/model_runner.layer_cache_views) against
    a dense reference: each group owns its own blocks (as the block pool hands them out), and every
    layer's K/V written through its view into its group's blocks reads back unchanged after every
    other layer's write (no two layers of a block overlap)."""
    from types import SimpleNamespace

    import torch

    from engine.runner.model_runner import layer_cache_views, new_kv_cache

    shapes = ((2, 16), (1, 64), (2, 16), (1, 64), (2, 16))
    cfg = SimpleNamespace(num_layers=5, num_kv_heads=2, head_dim=16, dtype=torch.float32, kv_dtype=torch.float32,
                          uniform_kv=False,
                          kv_widths=tuple(h * d for h, d in shapes), kv_shape=lambda i: shapes[i],
                          kv_sources=(0, 1, 2, 3, 2), kv_source=lambda i: (0, 1, 2, 3, 2)[i])
    layout = plan_kv_layout((8, 0, 8, 0, 8), cfg.kv_widths, cfg.kv_sources)
    assert len(layout.groups) == 3 and layout.slots == 1  # two sliding layers share the row
    cache = new_kv_cache(cfg, layout, 6, 4, "cpu")
    assert cache.shape == (1, 2, 6, 4, 1, 64)
    views = layer_cache_views(cache, cfg, layout)
    ref = {}
    g = torch.Generator().manual_seed(0)
    for layer, (group, _, _) in list(enumerate(layout.placement()))[:4]:
        blocks = torch.tensor([2 * group, 2 * group + 1])
        for kv in (0, 1):
            heads, dim = shapes[layer]
            assert views[layer][kv].shape == (6, 4, heads, dim)
            ref[layer, kv] = (blocks, torch.randn(2, 4, heads, dim, generator=g))
            views[layer][kv].index_copy_(0, blocks, ref[layer, kv][1])
    for (layer, kv), (blocks, want) in ref.items():
        assert torch.equal(views[layer][kv][blocks], want), (layer, kv)
    assert views[4][0].data_ptr() == views[2][0].data_ptr()  # layer 4 reads layer 2's cache


@pytest.mark.parametrize("groups", [(), (KVGroup((0,), 0), KVGroup((0,), 8)), (KVGroup((1,), 0),)])
def test_layouts_must_cover_every_layer_once(groups):
    with pytest.raises(ValueError):
        KVLayout(groups)


def test_blocks_per_sequence_counts_full_history_and_sliding_windows():
    layout = KVLayout((KVGroup((0,), 0), KVGroup((1,), 10)))
    assert layout.blocks_per_sequence(100, 4, 8) == 25 + (-(-17 // 4) + 2)
    assert layout.blocks_per_sequence(6, 4, 8) == 2 + 2  # a short sequence: its whole self in both


BS, WINDOW = 4, 10
LAYOUT = KVLayout((KVGroup((0,), 0), KVGroup((1,), WINDOW)))


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(RequestId(rid), tokens, SamplingParams(max_tokens=1), max_total_tokens=256)


def _run_to(kv: KVCacheManager, req: Request, n: int) -> None:
    assert kv.allocate_slots(req, n - req.num_computed_tokens)
    req.num_computed_tokens = n
    kv.cache_full_blocks(req)


def _reference_hit(pool: BlockPool, kv: KVCacheManager, req: Request) -> int:
    """The longest n (blocks) with group 0's blocks 0..n-1 and group 1's window blocks present."""
    for n in range((req.num_tokens - 1) // BS, 0, -1):
        full = all(pool.lookup(kv._keys(req, 0)[i]) is not None for i in range(n))
        lo = max(0, n * BS - WINDOW + 1) // BS
        sliding = all(pool.lookup(kv._keys(req, 1)[i]) is not None for i in range(lo, n))
        if full and sliding:
            return n
    return 0


def _evict_all_but(pool: BlockPool, keep: list) -> None:
    """Evicts every cached block except `keep` (by taking every other block and giving it back)."""
    pool.acquire(keep)
    taken = pool.allocate(pool.num_free_blocks())
    pool.release(reversed(taken))
    pool.release(keep)


@pytest.mark.parametrize("lost, expect", [(None, 10), ("early", 10), ("late", 8)])
def test_prefix_hits_need_the_full_groups_history_and_the_sliding_groups_window(lost, expect):
    pool = BlockPool(64, make_policy("lru"), True)
    kv = KVCacheManager(pool, BS, LAYOUT)
    tokens = list(range(1, 42))
    a = _request("a", tokens)
    _run_to(kv, a, 40)
    assert kv.num_held_blocks(a, 1) <= -(-WINDOW // BS) + 1 and kv.num_held_blocks(a, 0) == 10
    kv.free(a)
    b = _request("b", tokens)
    cached = {(g, i): pool.lookup(kv._keys(b, g)[i]) for g in (0, 1) for i in range(10)}
    if lost is not None:  # the sliding group's block 1 (out of every window that matters) or 8 (inside)
        gone = (1, 1 if lost == "early" else 8)
        _evict_all_but(pool, [b for k, b in cached.items() if b is not None and k != gone])
        assert pool.lookup(kv._keys(b, 1)[gone[1]]) is None
    hits = kv.get_computed_blocks(b)
    assert len(hits) == _reference_hit(pool, kv, b) == expect
    assert all(h[0] == cached[(0, i)] for i, h in enumerate(hits))
    first = (expect * BS - WINDOW + 1) // BS  # the sliding group serves only its window
    assert [h[1] for h in hits] == [None] * first + [cached[(1, i)] for i in range(first, expect)]


def test_allocating_a_hit_acquires_only_the_window_and_free_releases_it_once():
    pool = BlockPool(64, make_policy("lru"), True)
    kv = KVCacheManager(pool, BS, LAYOUT)
    tokens = list(range(1, 42))
    a = _request("a", tokens)
    _run_to(kv, a, 40)
    kv.free(a)
    b = _request("b", tokens)
    hits = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, b.num_tokens - len(hits) * BS, hits)
    b.num_computed_tokens = len(hits) * BS
    full, sliding = kv.block_tables(b)
    assert full[:10] == [h[0] for h in hits]
    first = (40 - WINDOW + 1) // BS
    assert sliding[:first] == [PLACEHOLDER] * first and sliding[first:10] == [h[1] for h in hits[first:]]
    assert kv.num_held_blocks(b, 1) == len(sliding) - first
    kv.free(b)
    assert all(blk.ref_cnt == 0 for blk in pool.blocks)
    pool.check_integrity()
