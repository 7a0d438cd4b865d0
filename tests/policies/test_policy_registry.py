"""Registry: builtin names, `module:Class` paths, and `kvtier.policies` entry points."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

import policies.registry as registry
from policies import LRUPolicy, PriorityPolicy, available_policies, make_policy
from policies.base import EvictionPolicy

THIS = __name__  # module:Class specs below point back into this module


class NewestFirstPolicy(LRUPolicy):
    """A real, tiny plugin: evicts the most recently used key first."""

    name = "mru"

    def evict(self, n, protected=()):  # type: ignore[no-untyped-def]
        self._order = type(self._order)(reversed(self._order.items()))
        try:
            return super().evict(n, protected)
        finally:
            self._order = type(self._order)(reversed(self._order.items()))


class Holder:
    Nested = NewestFirstPolicy


class NotAPolicy:
    name = "nope"


def not_a_class() -> LRUPolicy:
    return LRUPolicy()


@pytest.fixture
def plugins(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Replace the installed entry points with a controllable table {name: value}."""
    table: dict[str, str] = {}
    seen_groups: list[str] = []

    def fake_entry_points(*, group: str) -> list[EntryPoint]:
        seen_groups.append(group)
        return [EntryPoint(name=n, value=v, group=group) for n, v in table.items()]

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    yield table
    assert set(seen_groups) <= {"kvtier.policies"}


def test_builtin_names(plugins: dict[str, str]) -> None:
    assert type(make_policy("lru")) is LRUPolicy
    assert type(make_policy("priority")) is PriorityPolicy
    assert available_policies() == ["lru", "priority"]
    assert make_policy("lru") is not make_policy("lru")  # a fresh instance per call


def test_module_class_path() -> None:
    policy = make_policy(f"{THIS}:NewestFirstPolicy")
    assert type(policy) is NewestFirstPolicy
    for k in "abc":
        policy.insert(k)
    assert policy.evict(2) == ["c", "b"]
    assert type(make_policy(f"{THIS}:Holder.Nested")) is NewestFirstPolicy
    assert type(make_policy("policies.priority:PriorityPolicy")) is PriorityPolicy


@pytest.mark.parametrize(
    "spec",
    [f"{THIS}:NotAPolicy", f"{THIS}:not_a_class", "policies.base:EvictionPolicy", f"{THIS}:THIS"],
)
def test_non_policy_rejected(spec: str) -> None:
    with pytest.raises(ValueError, match="EvictionPolicy|abstract"):
        make_policy(spec)


@pytest.mark.parametrize(
    "spec", ["no_such_module_kvtier:Foo", f"{THIS}:Missing", f"{THIS}:", ":Foo"]
)
def test_unloadable_path(spec: str) -> None:
    with pytest.raises(ValueError):
        make_policy(spec)


def test_unknown_name_lists_available(plugins: dict[str, str]) -> None:
    plugins["mru"] = f"{THIS}:NewestFirstPolicy"
    with pytest.raises(ValueError) as err:
        make_policy("lfu")
    msg = str(err.value)
    assert "'lfu'" in msg and "lru" in msg and "priority" in msg and "mru" in msg


def test_entry_point_lookup(plugins: dict[str, str]) -> None:
    plugins["mru"] = f"{THIS}:NewestFirstPolicy"
    assert available_policies() == ["lru", "mru", "priority"]
    assert type(make_policy("mru")) is NewestFirstPolicy


def test_entry_point_must_be_a_policy(plugins: dict[str, str]) -> None:
    plugins["bad"] = f"{THIS}:NotAPolicy"
    plugins["broken"] = "no_such_module_kvtier:Foo"
    with pytest.raises(ValueError, match="not an EvictionPolicy"):
        make_policy("bad")
    with pytest.raises(ValueError, match="broken"):
        make_policy("broken")


def test_builtin_wins_over_plugin_with_same_name(plugins: dict[str, str]) -> None:
    plugins["lru"] = f"{THIS}:NewestFirstPolicy"
    assert type(make_policy("lru")) is LRUPolicy
    assert available_policies() == ["lru", "priority"]


def test_real_entry_points_are_queried() -> None:
    # Without monkeypatching, the installed environment is consulted and builtins survive.
    assert {"lru", "priority"} <= set(available_policies())
    assert all(isinstance(n, str) for n in available_policies())
    assert issubclass(registry.load_policy_class("priority"), EvictionPolicy)
