"""Eviction policies over opaque keys (pure stdlib; no project or torch imports)."""

from policies.base import EvictionPolicy
from policies.lru import LRUPolicy
from policies.priority import PriorityPolicy
from policies.registry import available_policies, make_policy

__all__ = ["EvictionPolicy", "LRUPolicy", "PriorityPolicy", "available_policies", "make_policy"]
