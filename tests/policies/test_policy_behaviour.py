"""Scenario and edge-case tests for the built-in policies."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from policies import EvictionPolicy, LRUPolicy, PriorityPolicy

POLICIES = [LRUPolicy, PriorityPolicy]
PKG_DIR = Path(__file__).resolve().parents[2] / "policies"


def _replay_prefix_vs_flood(policy: EvictionPolicy, capacity: int = 32) -> tuple[int, int]:
    """A priority-0 shared prefix of 8 keys is used once per round; between rounds 50
    priority-10 one-off keys pass through a cache of `capacity` keys (500 in all).
    Returns (prefix hits, prefix lookups)."""
    prefix = [("sys", i) for i in range(8)]
    hits = lookups = 0
    flood = 0

    def make_room(protected: list[tuple[str, int]]) -> None:
        if len(policy) >= capacity:
            victims = policy.evict(1, protected=protected)  # only the current request's keys
            assert victims is not None and len(victims) == 1

    for _ in range(10):
        for key in prefix:
            lookups += 1
            if key in policy:
                hits += 1
                policy.touch(key, priority=0)
            else:
                make_room(prefix)
                policy.insert(key, priority=0)
        for _ in range(50):
            make_room([])
            policy.insert(("user", flood), priority=10)
            flood += 1
        assert len(policy) <= capacity
        policy.check_integrity()
    assert flood == 500
    return hits, lookups


def test_priority_keeps_shared_prefix_resident_under_flood() -> None:
    policy = PriorityPolicy()
    hits, lookups = _replay_prefix_vs_flood(policy)
    assert hits == lookups - 8  # only the very first round misses
    assert all(("sys", i) in policy for i in range(8))


def test_lru_loses_shared_prefix_under_same_flood() -> None:
    policy = LRUPolicy()
    hits, _ = _replay_prefix_vs_flood(policy)
    assert hits == 0  # 50 one-offs > 24 free slots: the prefix is gone every round
    assert not any(("sys", i) in policy for i in range(8))


@pytest.mark.parametrize("cls", POLICIES)
def test_pinned_keys_are_never_evicted(cls: type[EvictionPolicy]) -> None:
    policy = cls()
    for i in range(6):
        policy.insert(i, priority=5 if i < 3 else 0)  # pinned keys are the first victims otherwise
    policy.pin(0)
    policy.pin(1)
    policy.pin(1)  # idempotent: one unpin releases it
    assert policy.evict(4) == ([2, 3, 4, 5])
    assert policy.evict(1) is None  # only pinned keys left: nothing happens
    assert len(policy) == 2 and 0 in policy and 1 in policy
    policy.unpin(1)
    assert policy.evict(2) is None  # 0 is still pinned
    assert policy.evict(1) == [1]
    policy.check_integrity()


@pytest.mark.parametrize("cls", POLICIES)
def test_all_or_nothing_leaves_order_intact(cls: type[EvictionPolicy]) -> None:
    policy = cls()
    for i in range(5):
        policy.insert(i)
    policy.pin(2)
    assert policy.evict(4, protected=[0]) is None  # 3 eligible (1, 3, 4)
    assert len(policy) == 5
    assert policy.evict(5) is None
    assert policy.evict(4) == [0, 1, 3, 4]  # same order as if the failed calls never ran


@pytest.mark.parametrize("cls", POLICIES)
def test_remove_clears_pin(cls: type[EvictionPolicy]) -> None:
    policy = cls()
    policy.insert("a")
    policy.pin("a")
    policy.remove("a")
    policy.insert("a")
    assert policy.evict(1) == ["a"]
    with pytest.raises(KeyError):
        policy.unpin("a")


@pytest.mark.parametrize("cls", POLICIES)
def test_errors(cls: type[EvictionPolicy]) -> None:
    policy = cls()
    policy.insert("a", priority=3)
    with pytest.raises(ValueError):
        policy.insert("a")
    for method in ("touch", "remove", "pin", "unpin"):
        with pytest.raises(KeyError):
            getattr(policy, method)("zz")
    with pytest.raises(ValueError):
        policy.evict(-1)
    assert policy.evict(0) == []
    assert policy.evict(0, protected=["a"]) == []
    assert len(policy) == 1 and "a" in policy and "zz" not in policy
    policy.check_integrity()


def test_priority_touch_keeps_most_urgent_and_ties_go_lru() -> None:
    policy = PriorityPolicy()
    policy.insert("a", priority=1)
    policy.insert("b", priority=1)
    policy.insert("c", priority=4)
    policy.touch("c", priority=9)  # less urgent: stays at 4
    policy.touch("a", priority=1)  # same priority: "a" becomes MRU within bucket 1
    policy.touch("b", priority=-1)  # more urgent: moves to -1
    assert policy.evict(3) == ["c", "a", "b"]
    policy.check_integrity()


def test_lru_ignores_priority() -> None:
    policy = LRUPolicy()
    policy.insert("urgent", priority=-5)
    policy.insert("lazy", priority=100)
    policy.touch("lazy", priority=-10)
    assert policy.evict(2) == ["urgent", "lazy"]


def test_priority_heap_stays_bounded_under_churn() -> None:
    policy = PriorityPolicy()
    for i in range(2000):  # every key in its own, short-lived priority bucket
        policy.insert(i, priority=i)
        if i >= 3:
            policy.remove(i - 3)
    policy.check_integrity()
    # Lazily deleted heap entries must get compacted, not pile up.
    assert len(policy._heap) <= 2 * len(policy._buckets) + 17
    assert policy.evict(3) == [1999, 1998, 1997]


@pytest.mark.parametrize("cls", POLICIES)
def test_check_integrity_detects_corruption(cls: type[EvictionPolicy]) -> None:
    policy = cls()
    policy.insert("a")
    policy.pin("a")
    policy.check_integrity()
    policy._rerank("a")  # a pinned key back in the ranking, where evict would find it
    with pytest.raises(RuntimeError, match="pinned"):
        policy.check_integrity()


@pytest.mark.parametrize("cls", POLICIES)
def test_unpinned_key_ranks_as_just_used(cls: type[EvictionPolicy]) -> None:
    policy = cls()
    for k in "abc":
        policy.insert(k, priority=1)
    policy.pin("a")
    policy.touch("a", priority=0)  # a pinned key may be touched; priority keeps the most urgent
    policy.unpin("a")
    policy.unpin("a")  # not pinned: a no-op, not another use
    policy.touch("b")
    # LRU: a went back after c, then b was used; priority: a is now the most urgent.
    assert policy.evict(3) == (["c", "a", "b"] if cls is LRUPolicy else ["c", "b", "a"])
    policy.check_integrity()


def test_priority_unpin_keeps_the_priority_and_goes_to_its_buckets_mru_end() -> None:
    policy = PriorityPolicy()
    policy.insert("a", priority=2)
    policy.insert("b", priority=2)
    policy.insert("z", priority=9)
    policy.pin("a")
    policy.unpin("a")
    assert policy.evict(3) == ["z", "b", "a"]


class CountedKey:
    """A key that counts how often it is hashed: every set or dict lookup of it does."""

    hashes = 0
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __hash__(self) -> int:
        CountedKey.hashes += 1
        return self.i

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CountedKey) and other.i == self.i


@pytest.mark.parametrize("cls", POLICIES)
def test_evict_does_not_walk_pinned_keys(cls: type[EvictionPolicy]) -> None:
    """G1 keeps every block a running request holds pinned in its policy: evict must not pay for them."""
    policy = cls()
    keys = [CountedKey(i) for i in range(100_000)]
    for k in keys:  # the oldest (and, for priority, least urgent) keys are the pinned ones
        policy.insert(k, priority=5)
        policy.pin(k)
    policy.insert(CountedKey(-1), priority=5)
    policy.insert(CountedKey(-2), priority=0)
    CountedKey.hashes = 0
    assert policy.evict(2) == [CountedKey(-1), CountedKey(-2)]
    assert CountedKey.hashes < 20, f"evict hashed {CountedKey.hashes} keys"
    assert policy.evict(1) is None
    assert CountedKey.hashes < 40
    assert len(policy) == 100_000


def test_priority_check_integrity_detects_bucket_mismatch() -> None:
    policy = PriorityPolicy()
    policy.insert("a", priority=2)
    policy._prio["a"] = 7
    with pytest.raises(RuntimeError):
        policy.check_integrity()


def test_policies_package_is_pure_stdlib() -> None:
    """No torch, no other project package but the bottom-level `plugins` loader: checked statically
    and at import time."""
    for path in PKG_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            bad = [r for r in roots if r not in ("policies", "plugins") and r not in sys.stdlib_module_names]
            assert not bad, f"{path.name} imports {bad}"
    code = (
        "import sys, policies; "
        "bad = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'numpy', 'kvstore', 'connectors', 'engine', 'server'}); "
        "sys.exit(str(bad) if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=PKG_DIR.parent, check=True)
