"""The policy API tiers call: BlockInfo, from_config, insert_block/touch_block (issue 18)."""

from __future__ import annotations

import dataclasses

import pytest

from policies import BlockInfo, EvictionPolicy, LRUPolicy, PriorityPolicy
from recording_policy import RecordingLRU


def test_block_info_defaults_and_validation() -> None:
    info = BlockInfo()
    assert (info.depth, info.parent, info.arrival, info.priority, info.session) == (0, None, 0.0, 0, None)
    with pytest.raises(ValueError, match="depth"):
        BlockInfo(depth=-1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.depth = 3  # type: ignore[misc]
    assert not hasattr(info, "__dict__")  # slotted: one per G1 block


@pytest.mark.parametrize("cls", [LRUPolicy, PriorityPolicy])
def test_from_config_default_takes_no_options(cls: type) -> None:
    assert type(cls.from_config(None, {})) is cls
    assert type(cls.from_config(128, {})) is cls
    with pytest.raises(ValueError, match=rf"'{cls.name}' takes no options.*\['alpha', 'beta'\]"):
        cls.from_config(128, {"beta": 1, "alpha": 2})


def test_block_calls_default_to_the_plain_ones_with_the_priority() -> None:
    policy = RecordingLRU()  # records the plain calls; the defaults under test are EvictionPolicy's
    EvictionPolicy.insert_block(policy, "a", BlockInfo(depth=2, parent="p", arrival=1.5, priority=3, session="s"))
    EvictionPolicy.touch_block(policy, "a", BlockInfo(priority=-1))
    assert policy.calls == [("insert", "a", 3), ("touch", "a", -1)]
    with pytest.raises(ValueError):
        EvictionPolicy.insert_block(policy, "a", BlockInfo())
    with pytest.raises(KeyError):
        EvictionPolicy.touch_block(policy, "zz", BlockInfo())


def test_priority_policy_ranks_by_block_info_priority() -> None:
    policy = PriorityPolicy()
    policy.insert_block("urgent", BlockInfo(priority=0))
    policy.insert_block("lazy", BlockInfo(priority=7))
    policy.touch_block("lazy", BlockInfo(priority=9))  # less urgent: stays at 7
    assert policy.evict(1) == ["lazy"]
