"""G2 sees the priority of the request that uses a block (issue 13: policies reach every tier):
a load by an urgent request keeps the block urgent, so less urgent blocks are evicted first.
Oracle: which key G2 evicts when full, under the priority policy (lower value = more urgent)."""
from __future__ import annotations

from kvstore.host import HostTier
from policies import make_policy


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def store(g2: HostTier, k: bytes, priority: int) -> None:
    slot = g2.prepare_store(k, b"d" * 16)
    assert slot is not None
    g2.complete_store(k, True, priority)


def evicted_by_next_store(g2: HostTier) -> set[bytes]:
    before = set(g2._slot)  # noqa: SLF001 - what is readable
    store(g2, key(99), 5)
    return before - set(g2._slot)  # noqa: SLF001


def test_load_by_an_urgent_request_keeps_the_block():
    g2 = HostTier(2, 64, make_policy("priority"))
    store(g2, key(1), 5)
    store(g2, key(2), 3)
    assert g2.prepare_load([key(1)], priority=0) is not None  # an urgent request reads key 1
    g2.complete_load([key(1)])
    assert evicted_by_next_store(g2) == {key(2)}  # without the priority, key 1 (5) would go


def test_without_a_priority_a_load_is_only_a_use():
    g2 = HostTier(2, 64, make_policy("priority"))
    store(g2, key(1), 0)  # urgent
    store(g2, key(2), 5)
    assert g2.prepare_load([key(2)]) is not None  # recent, not urgent
    g2.complete_load([key(2)])
    assert evicted_by_next_store(g2) == {key(2)}


def test_disk_tier_keeps_the_block_an_urgent_request_used(tmp_path):
    """G3 (and any backend with its own eviction) gets the priority through `touch`: the disk
    evicts the less urgent entry when it is full. Also through the sealed wrapper plugins get."""
    from kvstore.disk import DiskBackend
    from kvstore.sealed import SealedBackend

    ns = bytes(range(16))
    for wrap in (False, True):
        disk = DiskBackend(tmp_path / f"g3-{wrap}", capacity_bytes=7400, namespace=ns, policy="priority")
        tier = SealedBackend(disk, ns) if wrap else disk
        block = b"x" * 3000
        assert tier.put([key(1)], [block]) == [True]
        tier.touch([key(1)], 5)
        assert tier.put([key(2)], [block]) == [True]
        tier.touch([key(2)], 3)
        tier.touch([key(1)], 0)  # an urgent request read key 1
        tier.touch([key(7)], 0)  # unknown keys are ignored
        assert tier.put([key(3)], [block]) == [True]  # no room for three: one goes
        assert tier.exists([key(1), key(2), key(3)]) == [True, False, True]
        tier.close()
