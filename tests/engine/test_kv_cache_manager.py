"""What KVCacheManager tells G1's eviction policy about each block (issue 18): its index in the
request, the block before it, and the request's arrival, priority and cache salt."""
from __future__ import annotations

from engine.kv.kv_cache_manager import KVCacheManager
from engine.kv.kv_groups import KVLayout
from engine.core.request import Request, RequestId
from engine.sampling_params import SamplingParams
from kvstore.g1 import BlockPool
from policies import BlockInfo
from recording_policy import RecordingLRU

BS = 4


def _request(rid: str, tokens: list[int], **kw) -> Request:  # type: ignore[no-untyped-def]
    return Request(RequestId(rid), tokens, SamplingParams(max_tokens=1), max_total_tokens=256, **kw)


def test_cached_and_hit_blocks_carry_their_depth_parent_and_request():
    policy = RecordingLRU()
    pool = BlockPool(16, policy)
    kv = KVCacheManager(pool, BS, KVLayout.single(1))
    tokens = list(range(1, 3 * BS + 2))  # three full blocks and one token
    first = _request("a", tokens, priority=2, cache_salt="tenant", session="conv")
    assert kv.allocate_slots(first, len(tokens))
    first.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(first)
    kv.free(first)
    table = [c[1] for c in policy.calls][::-1]  # inserted tails first
    want = [BlockInfo(i, table[i - 1] if i else None, first.arrival_time, 2, "conv") for i in range(3)]
    assert policy.calls == [("insert_block", table[i], want[i]) for i in (2, 1, 0)]

    policy.calls.clear()
    second = _request("b", tokens, priority=1, cache_salt="tenant", session="conv")
    hit = kv.get_computed_blocks(second)
    assert [h[0] for h in hit] == table
    assert kv.allocate_slots(second, 1, hit)
    want = [BlockInfo(i, table[i - 1] if i else None, second.arrival_time, 1, "conv") for i in range(3)]
    assert policy.calls == [c for i in range(3) for c in (("touch_block", table[i], want[i]), ("pin", table[i]))]
    pool.check_integrity()
