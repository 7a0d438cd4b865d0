"""G2 sees the priority of the request that uses a block (issue 13: policies reach every tier):
a load by an urgent request keeps the block urgent, so less urgent blocks are evicted first.
Oracle: which key G2 evicts when full, under the priority policy (lower value = more urgent).
Issue 18: G2 and G3 pass each block's BlockInfo to their policies, on writes and on uses."""
from __future__ import annotations

import pytest

from kvstore.host import HostTier
from policies import BlockInfo, make_policy
from recording_policy import RecordingLRU


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def store(g2: HostTier, k: bytes, priority: int) -> None:
    slot = g2.prepare_store(k, b"d" * 16)
    assert slot is not None
    g2.complete_store(k, True, BlockInfo(priority=priority))


def evicted_by_next_store(g2: HostTier) -> set[bytes]:
    before = set(g2._slot)  # noqa: SLF001 - what is readable
    store(g2, key(99), 5)
    return before - set(g2._slot)  # noqa: SLF001


def test_load_by_an_urgent_request_keeps_the_block():
    g2 = HostTier(2, 64, make_policy("priority"))
    store(g2, key(1), 5)
    store(g2, key(2), 3)
    assert g2.prepare_load([key(1)], [BlockInfo(priority=0)]) is not None  # an urgent request reads key 1
    g2.complete_load([key(1)])
    assert evicted_by_next_store(g2) == {key(2)}  # without the priority, key 1 (5) would go


def test_a_load_by_a_less_urgent_request_is_only_a_use():
    g2 = HostTier(2, 64, make_policy("priority"))
    store(g2, key(1), 0)  # urgent
    store(g2, key(2), 5)
    assert g2.prepare_load([key(2)], [BlockInfo(priority=9)]) is not None  # recent, not urgent
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


# --- BlockInfo reaches G2's and G3's policies (issue 18) ----------------------------------


def test_g2_inserts_with_the_info_and_a_load_touches_before_it_pins():
    rec = RecordingLRU()
    g2 = HostTier(4, 64, rec)
    info = BlockInfo(depth=1, parent=key(0), arrival=2.0, priority=4, session="s")
    assert g2.prepare_store(key(1), b"d" * 16) is not None
    g2.complete_store(key(1), True, info)
    use = BlockInfo(depth=1, parent=key(0), arrival=9.0, priority=1, session="s")
    assert g2.prepare_load([key(1)], [use]) is not None  # a request's load: a use
    g2.complete_load([key(1)])
    assert g2.prepare_load([key(1)]) is not None  # a copy to a tier below: no use
    g2.complete_load([key(1)])
    assert rec.calls == [("insert_block", key(1), info), ("touch_block", key(1), use), ("pin", key(1)),
                         ("unpin", key(1)), ("pin", key(1)), ("unpin", key(1))]
    g2.check_integrity()


def test_g3_takes_infos_with_writes_and_uses_and_reads_are_no_uses_when_told(tmp_path):
    from kvstore.disk import DiskBackend
    from kvstore.entry import HEADER_SIZE
    from kvstore.sealed import SealedBackend

    ns = bytes(range(16))
    spec = "recording_policy:RecordingLRU"
    disk = DiskBackend(tmp_path / "a", 10_000, ns, policy=spec, entry_bytes=1000, touch_on_read=False)
    rec = RecordingLRU.made[-1]
    assert rec.capacity == 10_000 // (HEADER_SIZE + 1000)
    first, second = BlockInfo(depth=0, priority=2), BlockInfo(depth=1, parent=key(1), priority=2)
    assert disk.put_blocks([key(1), key(2)], [b"x" * 1000] * 2, [first, second]) == [True, True]
    assert disk.get([key(2)]) == [b"x" * 1000]  # not a use: the connector reports uses
    disk.touch_blocks([key(2), key(9)], [second, second])  # unknown keys are ignored
    assert rec.calls == [("insert_block", key(1), first), ("insert_block", key(2), second),
                         ("touch_block", key(2), second)]
    disk.check_integrity()
    disk.close()

    plain = DiskBackend(tmp_path / "b", 10_000, ns, policy=spec)  # as a standalone store: reads are uses
    plain.put([key(1)], [b"y"])
    plain.get([key(1)])
    assert RecordingLRU.made[-1].calls == [("insert", key(1), 0), ("touch", key(1), None)]
    plain.close()

    inner = DiskBackend(tmp_path / "c", 10_000, ns, policy=spec, touch_on_read=False)
    sealed = SealedBackend(inner, ns)
    assert sealed.put_blocks([key(2)], [b"z"], [second]) == [True]
    (call,) = RecordingLRU.made[-1].calls
    # The inner backend sees its own key names, for the block and for its parent.
    assert call == ("insert_block", sealed._inner_key(key(2)), BlockInfo(depth=1, parent=sealed._inner_key(key(1)),
                                                                          priority=2))
    sealed.close()


def test_default_block_calls_of_a_backend_fall_back_to_put_and_touch():
    """A plugin backend written before put_blocks/touch_blocks: put, then touch with the priority."""
    from kvstore.memory import MemoryBackend

    seen: list[tuple] = []

    class Old(MemoryBackend):
        def touch(self, keys, priority):  # type: ignore[no-untyped-def]
            seen.append((list(keys), priority))

    b = Old()
    assert b.put_blocks([key(1), key(2)], [b"a", b"b"], [BlockInfo(priority=3), BlockInfo(priority=5)]) == [True, True]
    b.touch_blocks([key(1)], [BlockInfo(priority=0)])
    assert b.get([key(1), key(2)]) == [b"a", b"b"]
    assert seen == [([key(1)], 3), ([key(2)], 5), ([key(1)], 0)]
    with pytest.raises(ValueError, match="2 keys but 1 block infos"):
        b.touch_blocks([key(1), key(2)], [BlockInfo()])
