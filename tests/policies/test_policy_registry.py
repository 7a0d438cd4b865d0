"""Registry: builtin names, `module:Class` paths, and `kvtier.policies` entry points."""

from __future__ import annotations

import json
from importlib.metadata import EntryPoint

import pytest

import policies.registry as registry
from policies import BlockInfo, LRUPolicy, PolicySpec, PriorityPolicy, available_policies, make_policy
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
    assert available_policies() == ["lru", "priority", "turn_lru"]
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
    assert available_policies() == ["lru", "mru", "priority", "turn_lru"]
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
    assert available_policies() == ["lru", "priority", "turn_lru"]


def test_real_entry_points_are_queried() -> None:
    # Without monkeypatching, the installed environment is consulted and builtins survive.
    assert {"lru", "priority"} <= set(available_policies())
    assert all(isinstance(n, str) for n in available_policies())
    assert issubclass(registry.load_policy_class("priority"), EvictionPolicy)


# --- specs with options (issue 18) ---------------------------------------------------------


class SizedPolicy(LRUPolicy):
    """A plugin that takes options and its tier's capacity."""

    name = "sized"

    def __init__(self, capacity: int | None = None, ghost: float = 1.0) -> None:
        super().__init__()
        self.capacity, self.ghost = capacity, ghost

    @classmethod
    def from_config(cls, capacity, options):  # type: ignore[no-untyped-def]
        unknown = sorted(set(options) - {"ghost"})
        if unknown:
            raise ValueError(f"policy 'sized' does not take {unknown}")
        return cls(capacity, float(options.get("ghost", 1.0)))


def test_mapping_and_json_specs_reach_from_config() -> None:
    spec = {"name": f"{THIS}:SizedPolicy", "options": {"ghost": 0.5}}
    for form in (spec, json.dumps(spec), "  " + json.dumps(spec), PolicySpec.parse(spec)):
        policy = make_policy(form, capacity=64)
        assert type(policy) is SizedPolicy and (policy.capacity, policy.ghost) == (64, 0.5)
    assert make_policy({"name": f"{THIS}:SizedPolicy"}).capacity is None  # capacity unknown, options default
    assert type(make_policy('{"name": "priority"}', capacity=8)) is PriorityPolicy
    assert PolicySpec.parse("lru") == PolicySpec("lru", {})


def test_spec_options_are_a_frozen_copy() -> None:
    opts = {"ghost": 2}
    spec = PolicySpec("sized", opts)
    opts["ghost"] = 3
    assert spec.options["ghost"] == 2
    with pytest.raises(TypeError):
        spec.options["ghost"] = 4  # type: ignore[index]


@pytest.mark.parametrize(("spec", "needle"), [
    ({"name": "lru", "opts": {}}, r"unknown key\(s\) \['opts'\]"),
    ({"options": {}}, 'no "name"'),
    ({"name": "lru", "options": [1]}, '"options" must be a mapping'),
    ({"name": ""}, "non-empty string"),
    ('{"name": "lru",', "not valid JSON"),
    (3, "a name or"),
    ({"name": "lru", "options": {"size": 3}}, r"'lru' takes no options; got \['size'\]"),
    ({"name": "priority", "options": {"x": 1}}, r"'priority' takes no options"),
    ({"name": f"{THIS}:SizedPolicy", "options": {"gost": 1}}, r"does not take \['gost'\]"),
    ({"name": "no_such_policy"}, "unknown eviction policy 'no_such_policy'"),
])
def test_bad_specs_name_what_is_wrong(spec: object, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make_policy(spec)  # type: ignore[arg-type]


def test_old_style_plugin_loads_and_refuses_options() -> None:
    """A plugin written before from_config/insert_block (NewestFirstPolicy) still works."""
    policy = make_policy(f"{THIS}:NewestFirstPolicy", capacity=100)
    assert type(policy) is NewestFirstPolicy
    for k in "abc":
        policy.insert_block(k, BlockInfo(depth=ord(k) - ord("a")))
    policy.touch_block("a", BlockInfo())
    assert policy.evict(1) == ["a"]
    with pytest.raises(ValueError, match=r"'mru' takes no options; got \['k'\]"):
        make_policy({"name": f"{THIS}:NewestFirstPolicy", "options": {"k": 1}})


def test_check_policy_names_where_the_spec_came_from() -> None:
    from policies import check_policy

    check_policy('{"name": "lru"}', "--flag")  # a good spec: nothing to say
    with pytest.raises(ValueError, match=r"^--flag: unknown eviction policy 'nope'"):
        check_policy("nope", "--flag")
    with pytest.raises(ValueError, match=r"^g2_eviction_policy: .*'ghost'"):  # a TypeError in from_config too
        check_policy({"name": f"{THIS}:SizedPolicy", "options": {"ghost": None}}, "g2_eviction_policy")
