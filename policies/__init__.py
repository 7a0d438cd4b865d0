"""Eviction policies over opaque keys (pure stdlib; no project or torch imports)."""

from policies.base import BlockInfo, EvictionPolicy
from policies.lru import LRUPolicy
from policies.pins import PinnedAside, as_lookup, check_candidates, check_count, check_run
from policies.priority import PriorityPolicy
from policies.turn_lru import TurnLRUPolicy
from policies.registry import PolicySpec, PolicySpecLike, available_policies, check_policy, make_policy

__all__ = ["BlockInfo", "EvictionPolicy", "LRUPolicy", "PinnedAside", "PolicySpec", "PolicySpecLike", "PriorityPolicy",
           "TurnLRUPolicy", "as_lookup", "available_policies", "check_candidates", "check_count", "check_policy", "check_run",
           "make_policy"]
