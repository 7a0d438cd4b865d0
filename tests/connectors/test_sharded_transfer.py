"""connectors/sharded.py's bookkeeping against a plain model, and the plans' wire form
(engine/parallel/transfers.py): a transfer is reported once every rank has reported it; a load
counts the fewest blocks any rank filled, and the blocks rank 0 has and another lacks are handed
back for storing again."""
from __future__ import annotations

import random

import msgspec
import pytest

from connectors.offload_plans import Chunk, LoadDone, LoadJob, StoreDone, StoreJob
from connectors.sharded import ShardedTransfer
from engine.parallel.transfers import Transfers, done_of, load_of, reports_of, store_of, to_wire
from kvstore.g1 import BlockId
from kvstore.keys import BlockKey
from policies import BlockInfo

K = 2  # G1 blocks per offload block


class FakePeers:
    def __init__(self, size: int) -> None:
        self.size, self.sent, self.reports = size, [], []

    def send_transfers(self, loads, stores):
        self.sent.append((list(loads), list(stores)))

    def drain_transfers(self):
        out, self.reports = self.reports, []
        return out

    def flush_transfers(self):
        pass

    def set_waker(self, wake):
        self.wake = wake


def key(i: int) -> BlockKey:
    return BlockKey(bytes([i]) * 16)


def load_job(req: str, first_chunk: int, n_chunks: int, first_g1: int) -> LoadJob:
    chunks = tuple(Chunk(j, key(j), bytes(16), "G3", key(j - 1) if j else None)
                   for j in range(first_chunk, first_chunk + n_chunks))
    dst = tuple(BlockId(100 + i) for i in range((first_chunk + n_chunks) * K - first_g1))
    return LoadJob(req, chunks, first_g1, dst, len(dst) * 16, {}, BlockInfo(depth=first_chunk, arrival=1.5))


@pytest.mark.parametrize("seed", range(20))
def test_reports_combine_as_a_plain_model_says(seed):
    rng = random.Random(seed)
    size = rng.choice([2, 3, 4])
    peers, shorts = FakePeers(size), []
    sharded = ShardedTransfer(peers, K, shorts.append, lambda: None)
    jobs = [load_job(f"r{i}", rng.randrange(3), rng.randrange(1, 4), 0) for i in range(4)]
    jobs = [j if not j.chunks[0].index else LoadJob(j.req_id, j.chunks, j.chunks[0].index * K + rng.randrange(K),
                                                    j.dst[:len(j.dst) - rng.randrange(K)], 0, {}) for j in jobs]
    stores = [StoreJob(key(50 + i), bytes(16), (BlockId(i),), BlockInfo()) for i in range(3)]
    sharded.send(jobs, stores)
    assert peers.sent == [(jobs, stores)]
    filled = {(j.req_id, r): rng.randrange(len(j.dst) + 1) for j in jobs for r in range(size)}
    events = [(r, LoadDone(j.req_id, j.dst[filled[j.req_id, r]:], 0, filled[j.req_id, r])) for j in jobs for r in range(size)]
    events += [(r, StoreDone(s.key)) for s in stores for r in range(size)]
    rng.shuffle(events)
    got: list = []
    seen: dict = {}
    for rank, ev in events:
        seen.setdefault(ev.req_id if isinstance(ev, LoadDone) else ev.key, set()).add(rank)
        if rank == 0:
            got += sharded.combine([ev])
        else:
            peers.reports.append((rank, ev))
            got += sharded.combine([])
        ident = ev.req_id if isinstance(ev, LoadDone) else ev.key
        done_now = [g for g in got if (g.req_id if isinstance(g, LoadDone) else g.key) == ident]
        assert bool(done_now) == (len(seen[ident]) == size)  # reported exactly when every rank has
    want_loads = {}
    want_short = []
    for j in jobs:
        n = min(filled[j.req_id, r] for r in range(size))
        want_loads[j.req_id] = LoadDone(j.req_id, j.dst[n:], 0, n)
        if n < filled[j.req_id, 0]:  # the offload blocks holding any G1 block past the fewest filled
            want_short.append({c.key for c in j.chunks if any(j.first_g1 + n <= b < (c.index + 1) * K
                                                              for b in range(c.index * K, (c.index + 1) * K))})
    assert {g.req_id: g for g in got if isinstance(g, LoadDone)} == want_loads
    assert sorted(g.key for g in got if isinstance(g, StoreDone)) == sorted(s.key for s in stores)
    assert sorted(map(sorted, map(set, shorts))) == sorted(map(sorted, want_short))
    assert sharded.short_loads == len(want_short)
    sharded.check_integrity()


def test_plans_cross_the_wire_without_rank_0s_slots_or_events():
    job = LoadJob("r", (Chunk(2, key(2), b"d" * 16, "G2", key(1)),), 4, (BlockId(7), BlockId(8)), 48,
                  {key(2): 5}, BlockInfo(depth=2, parent=key(1), arrival=3.0, priority=-1, session="s"), group=1,
                  skipped_tokens=16)
    store = StoreJob(key(3), b"e" * 16, (BlockId(1), BlockId(2)), BlockInfo(depth=3, parent=key(2)))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(to_wire([job], [store])), type=Transfers)
    back = load_of(wire.loads[0])
    assert back.g2_slots == {} and back.chunks[0].blocks is None
    assert (back.req_id, back.chunks, back.first_g1, back.dst, back.end_token, back.info, back.group,
            back.skipped_tokens) == (job.req_id, job.chunks, job.first_g1, job.dst, job.end_token, job.info, job.group,
                                     job.skipped_tokens)
    assert store_of(wire.stores[0]) == store
    reports = [LoadDone("r", (BlockId(8),), 1, 1), StoreDone(key(3))]
    assert [(r.req_id, r.group, r.num_filled) if isinstance(r, LoadDone) else r.key
            for r in reports_of(done_of(1, reports))] == [("r", 1, 1), key(3)]


def test_a_parent_that_is_not_a_key_cannot_cross():
    job = LoadJob("r", (), 0, (), 0, {}, BlockInfo(parent=("not", "bytes")))
    with pytest.raises(TypeError, match="must be bytes"):
        to_wire([job], [])
