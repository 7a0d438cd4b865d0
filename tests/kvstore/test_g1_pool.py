"""G1 block pool against a plain reference model, plus block-key properties."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.g1 import BlockPool
from kvstore.keys import ROOT_KEY, block_key, chain_keys
from policies import BlockInfo, LRUPolicy, make_policy
from recording_policy import RecordingLRU


def test_chain_keys_are_stable_and_chained():
    toks = list(range(40))
    keys = chain_keys(toks, 16)
    assert len(keys) == 2  # only full blocks get keys
    assert keys[0] == block_key(ROOT_KEY, toks[:16])
    assert keys[1] == block_key(keys[0], toks[16:32])
    # A pinned value: the hash must not change across processes or releases (persistent tiers rely on it).
    assert block_key(ROOT_KEY, [1, 2, 3]).hex() == block_key(ROOT_KEY, [1, 2, 3]).hex()
    assert len(keys[0]) == 16


def test_keys_depend_on_prefix_salt_and_tokens():
    a = chain_keys(list(range(32)), 16)
    b = chain_keys([99] + list(range(1, 32)), 16)
    assert a[0] != b[0] and a[1] != b[1]  # a change in block 0 changes every later key
    salted = chain_keys(list(range(32)), 16, cache_salt="tenant-a")
    other = chain_keys(list(range(32)), 16, cache_salt="tenant-b")
    assert salted[0] != a[0] and salted[0] != other[0] and salted[1] != other[1]
    # Resuming the chain from a parent gives the same keys as hashing from the start.
    assert chain_keys(list(range(48)), 16, start=1, parent=a[0]) == chain_keys(list(range(48)), 16)[1:]


class RefPool:
    """Obviously-correct model: lists and dicts, O(n) everything."""

    def __init__(self, n: int) -> None:
        self.ref = [0] * n
        self.key: dict[int, bytes] = {}
        self.index: dict[bytes, int] = {}
        self.lru: list[int] = []  # evictable, oldest first
        self.free = list(range(n))

    def num_free(self) -> int:
        return len(self.free) + len(self.lru)

    def allocate(self, k: int):
        if k > self.num_free():
            return None
        out = [self.free.pop(0) for _ in range(min(k, len(self.free)))]
        while len(out) < k:
            b = self.lru.pop(0)
            del self.index[self.key.pop(b)]
            out.append(b)
        for b in out:
            self.ref[b] = 1
        return sorted(out)  # the pool hands blocks out in ascending id order

    def acquire(self, b: int) -> None:
        if self.ref[b] == 0:
            self.lru.remove(b)
        self.ref[b] += 1

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            (self.lru if b in self.key else self.free).append(b)

    def cache(self, b: int, key: bytes) -> None:
        if key in self.index:
            return
        self.key[b], self.index[key] = key, b


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=0, max_value=2**31), st.integers(min_value=1, max_value=12))
def test_pool_matches_reference(seed: int, n: int):
    rng = random.Random(seed)
    pool, ref = BlockPool(n, LRUPolicy()), RefPool(n)
    held: list[int] = []  # one entry per reference we hold
    for _ in range(80):
        op = rng.choice(["alloc", "alloc", "release", "cache", "hit"])
        if op == "alloc":
            k = rng.randint(0, 3)
            got, want = pool.allocate(k), ref.allocate(k)
            assert got == want
            held.extend(got or [])
        elif op == "release" and held:
            b = held.pop(rng.randrange(len(held)))
            pool.release([b])
            ref.release(b)
        elif op == "cache" and held:
            b = rng.choice(held)
            key = bytes([rng.randrange(6)]) * 16
            if pool.blocks[b].key is None:
                pool.cache(b, key)
                ref.cache(b, key)
        elif op == "hit":
            key = bytes([rng.randrange(6)]) * 16
            b = pool.lookup(key)
            assert b == ref.index.get(key)
            if b is not None:
                pool.acquire([b])
                ref.acquire(b)
                held.append(b)
        pool.check_integrity()
        assert pool.num_free_blocks() == ref.num_free()
        assert [blk.ref_cnt for blk in pool.blocks] == ref.ref


def test_pinned_blocks_make_allocation_refuse_without_change():
    pool = BlockPool(2, make_policy("lru"))
    a, b = pool.allocate(2)
    pool.cache(a, b"a" * 16)
    pool.cache(b, b"b" * 16)
    pool.release([a, b])
    pool.policy.pin(a)
    pool.policy.pin(b)
    assert pool.allocate(1) is None
    pool.check_integrity()
    assert pool.lookup(b"a" * 16) == a


def test_double_release_is_an_error():
    pool = BlockPool(1, LRUPolicy())
    (a,) = pool.allocate(1)
    pool.release([a])
    with pytest.raises(RuntimeError, match="released more times"):
        pool.release([a])


def test_check_integrity_catches_corruption():
    pool = BlockPool(2, LRUPolicy())
    (a,) = pool.allocate(1)
    pool.blocks[a].ref_cnt = 0  # in neither the free list nor the policy
    with pytest.raises(RuntimeError):
        pool.check_integrity()


# --- the policy keeps a cached block across uses (issue 18) -------------------------------


def _cached_prompt(pool: BlockPool, n: int, info=lambda i: BlockInfo(depth=i)) -> list[int]:
    """A finished request's n cached blocks, released tails first, as the engine does."""
    blocks = pool.allocate(n)
    for i, b in enumerate(blocks):
        pool.cache(b, bytes([i + 1]) * 16, info(i))
    pool.release(reversed(blocks))
    return blocks


def test_prefix_hit_touches_then_pins_and_release_unpins_without_losing_history():
    policy = RecordingLRU()
    pool = BlockPool(8, policy)
    a, b, c = _cached_prompt(pool, 3, lambda i: BlockInfo(depth=i, priority=4, session="s1"))
    # First release after caching: insert_block with the caching request's info, tails first.
    assert policy.calls == [("insert_block", c, BlockInfo(depth=2, priority=4, session="s1")),
                            ("insert_block", b, BlockInfo(depth=1, priority=4, session="s1")),
                            ("insert_block", a, BlockInfo(depth=0, priority=4, session="s1"))]
    policy.calls.clear()
    hit = [BlockInfo(depth=0, arrival=7.0, priority=1), BlockInfo(depth=1, parent=a, arrival=7.0, priority=1)]
    pool.acquire([a, b], hit)
    assert policy.calls == [("touch_block", a, hit[0]), ("pin", a), ("touch_block", b, hit[1]), ("pin", b)]
    assert pool.num_free_blocks() == 8 - 2  # pinned blocks are not evictable
    pool.check_integrity()
    second = [BlockInfo(depth=0, priority=3)]
    pool.acquire([a], second)  # another request, while the first holds it: a use, no second pin
    assert policy.names()[-1] == ("touch_block", a)
    policy.calls.clear()
    pool.release([a])
    pool.release([b, a])  # tails first
    assert policy.names() == [("unpin", b), ("unpin", a)]  # never removed: the policy kept them
    assert pool.blocks[a].info.priority == 1  # the most urgent user's priority is kept
    assert pool.allocate(8 - 3 + 1) is not None  # the one evicted is c: a and b were used since
    assert pool.lookup(bytes([3]) * 16) is None and pool.lookup(bytes([1]) * 16) == a
    assert not any(name == "remove" for name, *_ in policy.calls)
    pool.check_integrity()


def test_tails_are_evicted_first():
    pool = BlockPool(4, LRUPolicy())
    blocks = _cached_prompt(pool, 4)
    pool.acquire(blocks, [BlockInfo(depth=i) for i in range(4)])
    pool.release(reversed(blocks))
    assert pool.allocate(1) == [blocks[-1]]
    assert pool.allocate(1) == [blocks[-2]]


def test_a_hold_without_infos_pins_but_is_no_use():
    policy = RecordingLRU()
    pool = BlockPool(4, policy)
    (a,) = _cached_prompt(pool, 1)
    policy.calls.clear()
    pool.acquire([a])  # e.g. a connector holding the block until it is copied
    pool.release([a])
    assert policy.names() == [("pin", a), ("unpin", a)]
    with pytest.raises(ValueError, match="2 blocks but 1 infos"):
        pool.acquire([a, a], [BlockInfo()])


def test_reset_and_free_count_skip_blocks_requests_hold():
    pool = BlockPool(6, LRUPolicy())
    blocks = _cached_prompt(pool, 4)
    pool.acquire(blocks[:2], [BlockInfo(depth=0), BlockInfo(depth=1, parent=blocks[0])])
    assert pool.num_free_blocks() == 2 + 2
    assert pool.reset_prefix_cache() == 2  # only the evictable ones
    assert [pool.lookup(bytes([i + 1]) * 16) for i in range(4)] == [blocks[0], blocks[1], None, None]
    assert pool.num_free_blocks() == 4
    assert pool.allocate(5) is None
    pool.check_integrity()
    pool.release(reversed(blocks[:2]))
    assert pool.num_free_blocks() == 6
    pool.check_integrity()


def test_check_integrity_catches_pins_out_of_step_with_the_policy():
    pool = BlockPool(2, LRUPolicy())
    (a,) = _cached_prompt(pool, 1)
    pool.acquire([a], [BlockInfo()])
    pool.check_integrity()
    pool._pinned.discard(a)  # held, yet counted evictable
    with pytest.raises(RuntimeError, match="in-use block"):
        pool.check_integrity()
    pool._pinned.add(a)
    pool.policy.remove(a)  # held and pinned, but gone from the policy: its history lost
    with pytest.raises(RuntimeError, match="in-use block"):
        pool.check_integrity()


def test_old_style_plugin_works_in_g1():
    """A plugin with only insert/touch/... (no from_config, no insert_block) runs G1."""
    from policies.registry import make_policy as make

    pool = BlockPool(4, make("tests.policies.test_policy_registry:NewestFirstPolicy", capacity=4))
    blocks = _cached_prompt(pool, 3)
    pool.acquire(blocks[:1], [BlockInfo()])
    pool.release(blocks[:1])
    pool.check_integrity()
    assert pool.allocate(2) == sorted([blocks[0], 3])  # the free block, then the newest-used victim
