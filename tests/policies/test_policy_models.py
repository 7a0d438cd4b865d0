"""Stateful property tests: each built-in policy against an obviously-correct O(n) model."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Hashable

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from policies import EvictionPolicy, LRUPolicy, PriorityPolicy

KEYS = list(range(12))  # a small universe so collisions, re-inserts and errors are common
key_st = st.sampled_from(KEYS)
prio_st = st.integers(-2, 3)


class RefLRU:
    """Recency list, oldest first."""

    def __init__(self) -> None:
        self.order: list[Hashable] = []
        self.pinned: set[Hashable] = set()

    def _need(self, key: Hashable) -> None:
        if key not in self.order:
            raise KeyError(key)

    def insert(self, key: Hashable, priority: int = 0) -> None:
        if key in self.order:
            raise ValueError(key)
        self.order.append(key)

    def touch(self, key: Hashable, priority: int | None = None) -> None:
        self._need(key)
        self.order.remove(key)
        self.order.append(key)

    def remove(self, key: Hashable) -> None:
        self._need(key)
        self.order.remove(key)
        self.pinned.discard(key)

    def pin(self, key: Hashable) -> None:
        self._need(key)
        self.pinned.add(key)

    def unpin(self, key: Hashable) -> None:
        self._need(key)
        if key in self.pinned:  # the built-ins rank an unpinned key as just used
            self.pinned.discard(key)
            self.touch(key)

    def ranked(self) -> list[Hashable]:
        return list(self.order)

    def evict(self, n: int, protected: Collection[Hashable] = ()) -> list[Hashable] | None:
        if n < 0:
            raise ValueError(n)
        eligible = [k for k in self.ranked() if k not in self.pinned and k not in protected]
        if len(eligible) < n:
            return None
        for k in eligible[:n]:
            self.remove(k)
        return eligible[:n]

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, key: object) -> bool:
        return key in self.order


class RefPriority(RefLRU):
    """Same bookkeeping plus a priority per key and a global use stamp; ranks by
    (highest priority value first, then oldest stamp)."""

    def __init__(self) -> None:
        super().__init__()
        self.prio: dict[Hashable, int] = {}
        self.stamp: dict[Hashable, int] = {}
        self.clock = itertools.count()

    def insert(self, key: Hashable, priority: int = 0) -> None:
        super().insert(key)
        self.prio[key], self.stamp[key] = priority, next(self.clock)

    def touch(self, key: Hashable, priority: int | None = None) -> None:
        super().touch(key)
        if priority is not None:
            self.prio[key] = min(self.prio[key], priority)
        self.stamp[key] = next(self.clock)

    def ranked(self) -> list[Hashable]:
        return sorted(self.order, key=lambda k: (-self.prio[k], self.stamp[k]))


class PolicyMachine(RuleBasedStateMachine):
    """Applies every operation to the policy and the model; outcomes must match exactly."""

    policy_cls: type[EvictionPolicy] = LRUPolicy
    model_cls: type[RefLRU] = RefLRU

    def __init__(self) -> None:
        super().__init__()
        self.policy = self.policy_cls()
        self.model = self.model_cls()

    def _both(self, method: str, *args: object) -> object:
        outcomes = []
        for obj in (self.model, self.policy):
            try:
                outcomes.append(("ok", getattr(obj, method)(*args)))
            except (KeyError, ValueError) as e:
                outcomes.append(("raised", type(e)))
        expected, actual = outcomes
        assert actual == expected, f"{method}{args}: policy gave {actual}, model {expected}"
        return actual[1]

    # Keys are drawn half from the interesting side (present keys for touch/remove/...,
    # absent ones for insert) and half from the whole universe, so both the normal paths
    # and the error paths get exercised on non-trivial states.
    def _key(self, data: st.DataObject, present: bool) -> int:
        side = [k for k in KEYS if (k in self.model) == present]
        return data.draw(st.sampled_from(side) | key_st if side else key_st)

    @rule(data=st.data(), priority=prio_st)
    def insert(self, data: st.DataObject, priority: int) -> None:
        self._both("insert", self._key(data, present=False), priority)

    @rule(keys=st.lists(key_st, min_size=2, max_size=5, unique=True), priority=prio_st)
    def insert_many(self, keys: list[int], priority: int) -> None:
        for key in keys:
            self._both("insert", key, priority)

    @rule(data=st.data(), priority=prio_st | st.none())
    def touch(self, data: st.DataObject, priority: int | None) -> None:
        self._both("touch", self._key(data, present=True), priority)

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        self._both("remove", self._key(data, present=True))

    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        self._both("pin", self._key(data, present=True))

    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        self._both("unpin", self._key(data, present=True))

    @rule(data=st.data())
    def hold(self, data: st.DataObject) -> None:
        """A block a request holds and lets go (G1 pins a prefix hit until its release)."""
        key = self._key(data, present=True)
        self._both("pin", key)
        self._both("unpin", key)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        present = [k for k in KEYS if k in self.model]
        pool = st.sampled_from(present + [99]) if present else st.just(99)
        protected = data.draw(st.lists(pool, max_size=3) | st.frozensets(pool, max_size=3))
        # Mostly feasible n, then one too many (the None case), then the edge values.
        eligible = sum(k not in self.model.pinned and k not in protected for k in present)
        n = data.draw(st.sampled_from([*range(1, eligible + 1), eligible + 1, 0, -1]), label="n")
        self._both("evict", n, protected)

    @invariant()
    def same_state(self) -> None:
        self.policy.check_integrity()
        assert len(self.policy) == len(self.model)
        assert [k for k in KEYS if k in self.policy] == [k for k in KEYS if k in self.model]


class LRUMachine(PolicyMachine):
    policy_cls, model_cls = LRUPolicy, RefLRU


class PriorityMachine(PolicyMachine):
    policy_cls, model_cls = PriorityPolicy, RefPriority


_SETTINGS = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestLRUAgainstModel = LRUMachine.TestCase
TestLRUAgainstModel.settings = _SETTINGS
TestPriorityAgainstModel = PriorityMachine.TestCase
TestPriorityAgainstModel.settings = _SETTINGS


def test_models_disagree_where_policies_should() -> None:
    """Guard against the two models silently collapsing into one another."""
    lru, prio = RefLRU(), RefPriority()
    for m in (lru, prio):
        m.insert("a", 0)
        m.insert("b", 5)
    assert lru.evict(1) == ["a"]
    assert prio.evict(1) == ["b"]


# --- the machines must catch plausible bugs (the property tests can fail) ----------------


class FIFOPolicy(LRUPolicy):
    """Bug: touch does not refresh recency."""

    def touch(self, key, priority=None):  # type: ignore[no-untyped-def]
        if key not in self:
            raise KeyError(key)


class PartialEvictLRU(LRUPolicy):
    """Bug: evicts what it can instead of returning None."""

    def evict(self, n, protected=()):  # type: ignore[no-untyped-def]
        got = super().evict(n, protected)
        if got is None:
            eligible = sum(1 for k in self._order if k not in protected)
            got = super().evict(eligible, protected)
        return got


class MaxTouchPriority(PriorityPolicy):
    """Bug: touch keeps the LEAST urgent priority."""

    def touch(self, key, priority=None):  # type: ignore[no-untyped-def]
        if priority is not None and key in self and priority > self._prio[key]:
            self.remove(key)
            self.insert(key, priority)
        else:
            super().touch(key, priority)


class IgnorePinPriority(PriorityPolicy):
    """Bug: pin records the key but leaves it ranked, so evict may still choose it."""

    def _unrank(self, key):  # type: ignore[no-untyped-def]
        self._prio[key]  # only the KeyError of an absent key

    def _rerank(self, key):  # type: ignore[no-untyped-def]
        pass


class UnpinAsOldestLRU(LRUPolicy):
    """Bug: an unpinned key goes back as the least recently used, not the most."""

    def _rerank(self, key):  # type: ignore[no-untyped-def]
        super()._rerank(key)
        self._order.move_to_end(key, last=False)


class UnpinAsOldestPriority(PriorityPolicy):
    """Bug: an unpinned key goes back to the least recently used end of its bucket."""

    def _rerank(self, key):  # type: ignore[no-untyped-def]
        super()._rerank(key)
        self._buckets[self._prio[key]].move_to_end(key, last=False)


@pytest.mark.parametrize(
    ("buggy", "model"),
    [
        (FIFOPolicy, RefLRU),
        (PartialEvictLRU, RefLRU),
        (MaxTouchPriority, RefPriority),
        (IgnorePinPriority, RefPriority),
        (UnpinAsOldestLRU, RefLRU),
        (UnpinAsOldestPriority, RefPriority),
    ],
)
def test_machine_catches_bug(buggy: type[EvictionPolicy], model: type[RefLRU]) -> None:
    attrs = {"policy_cls": buggy, "model_cls": model}
    machine = type(f"{buggy.__name__}Machine", (PolicyMachine,), attrs)
    quick = settings(
        max_examples=300,
        stateful_step_count=40,
        deadline=None,
        database=None,
        derandomize=True,  # a fixed search: this meta-test must not flake
        phases=[Phase.generate],  # no shrinking: we only need to know it fails
        suppress_health_check=list(HealthCheck),
    )
    # A wrong result fails the comparison (AssertionError), broken bookkeeping check_integrity.
    with pytest.raises((AssertionError, RuntimeError)):
        run_state_machine_as_test(machine, settings=quick)
