"""turn_lru against a plain-dict reference model, plus the behaviour its design rests on."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Hashable

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from policies import BlockInfo, EvictionPolicy, LRUPolicy, make_policy
from policies.turn_lru import TurnLRUPolicy

KEYS = list(range(10))
SESSIONS = [None, "a", "b", "c"]
LEVELS, HALF_LIFE = 3, 5  # small, so the cap and the halving are reached


class RefTurnLRU:
    """Every key's level, last-use time and use stamp in plain dicts; ranks by scanning.

    The rule: a session's k-th request gives its blocks level min(k-1, LEVELS-1) (no session:
    0); a touch keeps the higher of the old and new level. Each level's rate is
    returned/reached over the requests seen (halved every HALF_LIFE requests, both starting
    at 1); weight = (best rate / rate) ** gamma. Victims one at a time: each level's least
    recently used eligible key, the one with the largest weight * age, lowest level on ties.
    """

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma
        self.level: dict[Hashable, int] = {}
        self.used: dict[Hashable, float] = {}
        self.stamp: dict[Hashable, int] = {}
        self.pinned: set[Hashable] = set()
        self.sessions: dict[str, tuple[int, float]] = {}
        self.reached, self.returned = [1.0] * LEVELS, [1.0] * LEVELS
        self.requests, self.now = 0, 0.0
        self.clock = itertools.count()

    def _level_of(self, info: BlockInfo) -> int:
        self.now = max(self.now, info.arrival)
        if info.session is None:
            return 0
        count, last = self.sessions.get(info.session, (0, None))
        if last != info.arrival:
            count += 1
            self.sessions[info.session] = (count, info.arrival)
            self.reached[min(count - 1, LEVELS - 1)] += 1
            if count > 1:
                self.returned[min(count - 2, LEVELS - 1)] += 1
            self.requests += 1
            if self.requests % HALF_LIFE == 0:
                self.reached = [x / 2 for x in self.reached]
                self.returned = [x / 2 for x in self.returned]
        return min(count - 1, LEVELS - 1)

    def weights(self) -> list[float]:
        rates = [r / max(n, r) for r, n in zip(self.returned, self.reached)]
        return [(max(rates) / r) ** self.gamma for r in rates]

    def insert_block(self, key: Hashable, info: BlockInfo) -> None:
        if key in self.level:
            raise ValueError(key)
        self.level[key] = self._level_of(info)
        self.used[key], self.stamp[key] = self.now, next(self.clock)

    def touch_block(self, key: Hashable, info: BlockInfo) -> None:
        if key not in self.level:
            raise KeyError(key)
        self.level[key] = max(self.level[key], self._level_of(info))
        self.used[key] = self.now
        if key not in self.pinned:
            self.stamp[key] = next(self.clock)

    def remove(self, key: Hashable) -> None:
        if key not in self.level:
            raise KeyError(key)
        del self.level[key], self.used[key], self.stamp[key]
        self.pinned.discard(key)

    def pin(self, key: Hashable) -> None:
        if key not in self.level:
            raise KeyError(key)
        self.pinned.add(key)

    def unpin(self, key: Hashable) -> None:
        if key not in self.level:
            raise KeyError(key)
        if key in self.pinned:  # back as just used
            self.pinned.discard(key)
            self.used[key], self.stamp[key] = self.now, next(self.clock)

    def evict(self, n: int, protected: Collection[Hashable] = ()) -> list[Hashable] | None:
        if n < 0:
            raise ValueError(n)
        eligible = {k for k in self.level if k not in self.pinned and k not in protected}
        if len(eligible) < n:
            return None
        weights, victims = self.weights(), []
        for _ in range(n):
            heads = {}
            for k in eligible:
                lvl = self.level[k]
                if lvl not in heads or self.stamp[k] < self.stamp[heads[lvl]]:
                    heads[lvl] = k
            lvl = max(sorted(heads), key=lambda l: weights[l] * (self.now - self.used[heads[l]] + 1e-9))
            victims.append(heads[lvl])
            eligible.discard(heads[lvl])
        for k in victims:
            self.remove(k)
        return victims

    def __len__(self) -> int:
        return len(self.level)

    def __contains__(self, key: object) -> bool:
        return key in self.level


class TurnMachine(RuleBasedStateMachine):
    gamma = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.policy = TurnLRUPolicy(levels=LEVELS, gamma=self.gamma, half_life=HALF_LIFE)
        self.model = RefTurnLRU(self.gamma)
        self.arrival = 1.0

    def _both(self, method: str, *args: object) -> object:
        outcomes = []
        for obj in (self.model, self.policy):
            try:
                outcomes.append(("ok", getattr(obj, method)(*args)))
            except (KeyError, ValueError) as e:
                outcomes.append(("raised", type(e)))
        assert outcomes[1] == outcomes[0], f"{method}{args}: policy gave {outcomes[1]}, model {outcomes[0]}"
        return outcomes[1][1]

    def _info(self, session: str | None) -> BlockInfo:
        return BlockInfo(arrival=self.arrival, session=session)

    @rule(step=st.sampled_from([0.0, 0.5, 3.0]))
    def next_request(self, step: float) -> None:
        self.arrival += step

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True), session=st.sampled_from(SESSIONS))
    def insert(self, keys: list[int], session: str | None) -> None:
        for key in keys:
            self._both("insert_block", key, self._info(session))

    @rule(key=st.sampled_from(KEYS), session=st.sampled_from(SESSIONS))
    def touch(self, key: int, session: str | None) -> None:
        self._both("touch_block", key, self._info(session))

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: int) -> None:
        self._both("remove", key)

    @rule(key=st.sampled_from(KEYS))
    def pin(self, key: int) -> None:
        self._both("pin", key)

    @rule(key=st.sampled_from(KEYS))
    def unpin(self, key: int) -> None:
        self._both("unpin", key)

    @rule(n=st.integers(-1, 5), protected=st.sets(st.sampled_from(KEYS), max_size=3))
    def evict(self, n: int, protected: set[int]) -> None:
        pinned = set(self.model.pinned)
        victims = self._both("evict", n, protected)
        assert not isinstance(victims, list) or not set(victims) & (pinned | protected)

    @invariant()
    def same_state(self) -> None:
        assert len(self.policy) == len(self.model)
        assert all(k in self.policy for k in self.model.level)
        self.policy.check_integrity()


class SteepTurnMachine(TurnMachine):
    gamma = 2.5


@pytest.mark.parametrize("machine", [TurnMachine, SteepTurnMachine])
def test_turn_lru_matches_reference_model(machine: type[TurnMachine]) -> None:
    run_state_machine_as_test(machine, settings=settings(max_examples=150, stateful_step_count=60, deadline=None,
                                                          suppress_health_check=list(HealthCheck)))


def test_without_session_hints_it_is_lru() -> None:
    """Every block level 0: the same victims as LRU for the same operations."""
    turn, lru = TurnLRUPolicy(gamma=3.0), LRUPolicy()
    for i, key in enumerate([5, 1, 4, 2, 3]):
        turn.insert_block(key, BlockInfo(arrival=float(i)))
        lru.insert(key)
    for key in (1, 2):
        turn.touch_block(key, BlockInfo(arrival=9.0))
        lru.touch(key)
    assert turn.evict(4, protected={3}) == lru.evict(4, protected={3}) == [5, 4, 1, 2]


def _request(policy: TurnLRUPolicy, keys: list[str], session: str, at: float) -> None:
    for depth, key in enumerate(keys):
        info = BlockInfo(depth=depth, parent=keys[depth - 1] if depth else None, arrival=at, session=session)
        (policy.touch_block if key in policy else policy.insert_block)(key, info)


def test_learned_rates_keep_returning_conversations_longer() -> None:
    """Most one-turn sessions never return, those that returned once mostly do: after that
    traffic, an older second-turn chain outlives a newer first-turn one; LRU does the opposite."""
    policy, t = TurnLRUPolicy(gamma=1.0), 0.0
    for s in range(40):  # 40 sessions; every 4th comes back, and those come back again
        t += 1
        _request(policy, [f"s{s}/0"], f"s{s}", t)
        if s % 4 == 0:
            for turn in (1, 2):
                t += 1
                _request(policy, [f"s{s}/0", f"s{s}/{turn}"], f"s{s}", t)
    for key in list(policy._level):
        policy.remove(key)
    _request(policy, ["old/0"], "old", 100.0)
    _request(policy, ["old/0", "old/1"], "old", 101.0)  # a second turn, at level 1
    _request(policy, ["new/0"], "new", 110.0)  # a first turn, newer
    _request(policy, ["x/0"], "x", 130.0)  # time goes on: "new" is 20 s old, "old" 29 s
    assert policy.evict(1) == ["new/0"]
    lru = LRUPolicy()
    for key in ("old/0", "old/1", "new/0"):
        lru.insert(key)
    assert lru.evict(1) == ["old/0"]


def test_options_and_registry() -> None:
    policy = make_policy({"name": "turn_lru", "options": {"levels": 2, "gamma": 0.5}}, capacity=64)
    assert isinstance(policy, TurnLRUPolicy) and policy._levels == 2
    assert isinstance(make_policy('{"name": "turn_lru"}'), TurnLRUPolicy)
    with pytest.raises(ValueError, match=r"unknown options \['size'\]"):
        make_policy({"name": "turn_lru", "options": {"size": 3}})
    for bad in ({"levels": 0}, {"gamma": -1}, {"half_life": 1.5}, {"sessions": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            make_policy({"name": "turn_lru", "options": bad})


def test_forgets_the_oldest_sessions() -> None:
    policy = TurnLRUPolicy(sessions=2)
    for i, s in enumerate("abc"):
        policy.insert_block(s, BlockInfo(arrival=float(i), session=s))
    assert list(policy._sessions) == ["b", "c"]
    policy.check_integrity()


class _PerKey:
    """Wraps a policy so its run methods are the base class's defaults: one call per key."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.p = policy

    def insert_run(self, keys: list, info: BlockInfo) -> None:
        EvictionPolicy.insert_run(self.p, keys, info)  # type: ignore[arg-type]

    def touch_run(self, keys: list, info: BlockInfo) -> None:
        EvictionPolicy.touch_run(self.p, keys, info)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> object:
        return getattr(self.p, name)


_ops = st.lists(st.tuples(st.sampled_from(["insert", "touch", "evict", "pin", "unpin"]),
                          st.lists(st.sampled_from(KEYS), min_size=0, max_size=4), st.sampled_from(SESSIONS)),
                max_size=40)


@pytest.mark.parametrize("name", ["lru", "priority", "turn_lru"])
@settings(max_examples=120, deadline=None)
@given(ops=_ops)
@example(ops=[("insert", [0], "a"), ("insert", [1], "a"), ("touch", [1], "b"), ("evict", [0, 1], None)])
def test_run_methods_equal_one_call_per_key(name: str, ops: list) -> None:
    """A policy's own insert_run/touch_run rank exactly as the per-key default does,
    and a run that raises changes nothing."""
    fast, slow = make_policy(name), _PerKey(make_policy(name))
    for t, (op, keys, session) in enumerate(ops):
        info = BlockInfo(depth=1, parent="root", arrival=float(t), priority=t % 3, session=session)
        outcomes = []
        for policy in (fast, slow):
            try:
                if op == "insert":
                    outcomes.append(policy.insert_run(keys, info))
                elif op == "touch":
                    outcomes.append(policy.touch_run(keys, info))
                elif op == "evict":
                    outcomes.append(policy.evict(len(keys), protected={"root"}))
                else:
                    outcomes.append(getattr(policy, op)(keys[0]) if keys else None)
            except (KeyError, ValueError) as e:
                outcomes.append(type(e))
        assert outcomes[0] == outcomes[1], (op, keys, outcomes)
        assert len(fast) == len(slow.p)
        assert getattr(fast, "_level", None) == getattr(slow.p, "_level", None)  # turn_lru: same levels
        fast.check_integrity()
    assert fast.evict(len(fast)) == slow.p.evict(len(slow.p))
