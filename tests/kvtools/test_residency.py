"""kvtools.residency: the KV-event decoder (both wire forms) and the per-replica residency index,
against a plain dict-of-sets model, with sequence gaps, late joins and restarts marked stale."""
from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtools.residency import (BlockRemoved, BlockStored, Cleared, DecodeError, EventBatch, FleetView,
                               ResidencyIndex, Tier, UnknownEvent, ViewState, compare_with_stats, decode_message,
                               decode_payload, tier_of)

REPO = Path(__file__).resolve().parents[2]
H = [bytes([i]) * 16 for i in range(64)]  # block hashes, as kvtier's 16-byte keys
MEDIA = {Tier.G1: ("GPU", None), Tier.G2: ("CPU", None), Tier.G3: ("STORAGE", "LOCAL"), Tier.G4: ("STORAGE", "REMOTE")}


def stored(hashes, tier=Tier.G1, parent=None, block_size=16, **extra) -> dict:
    medium, locality = MEDIA[tier]
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": [], "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None,
            "locality": locality, **extra}


def removed(hashes, tier=Tier.G1, **extra) -> dict:
    medium, locality = MEDIA[tier]
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "locality": locality, **extra}


def frames(seq: int, events: list, topic: bytes = b"kv-events", *more) -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgpack.packb([time.time(), events, *more], use_bin_type=True)]


def feed(index: ResidencyIndex, seq: int, events: list) -> None:
    index.apply(decode_message(frames(seq, events)))
    index.check_integrity()


# ---- decoding ---------------------------------------------------------------------------------

def test_map_form_decodes_to_typed_events():
    batch = decode_message(frames(7, [stored(H[:2], parent=H[9], token_ids=list(range(32)), future_key=1),
                                      removed([H[0]], Tier.G2, group_idx=0), {"type": "AllBlocksCleared"},
                                      {"type": "BlockReused", "block_hashes": []}], b"kv-events", 3))
    assert batch.seq == 7 and batch.dp_rank == 3
    s, r, c, u = batch.events
    assert s == BlockStored((H[0], H[1]), H[9], 16, "GPU", None, tuple(range(32)))
    assert s.tier is Tier.G1 and r.tier is Tier.G2 and r.group_idx == 0
    assert c == Cleared() and u == UnknownEvent("BlockReused")


def test_both_array_forms_decode():
    """kvtier's first form (medium 6th, DISK for G3) and vLLM's (lora_id before medium)."""
    batch = decode_payload(msgpack.packb([1.0, [
        ["BlockStored", [H[1]], H[0], [5] * 16, 16, "GPU"],
        ["BlockStored", [H[3]], None, [], 64, "DISK"],
        ["BlockStored", [7, 8], None, [1, 2], 16, None, "CPU", None],
        ["BlockRemoved", [H[1]], "GPU"],
        ["AllBlocksCleared"],
    ]], use_bin_type=True), 0)
    a, b, c, d, e = batch.events
    assert (a.tier, a.parent_block_hash, a.token_ids, a.block_size) == (Tier.G1, H[0], (5,) * 16, 16)
    assert (b.tier, b.block_size) == (Tier.G3, 64)
    assert (c.tier, c.block_hashes) == (Tier.G2, (7, 8))  # int hashes (vLLM's) are fine
    assert d == BlockRemoved((H[1],), "GPU") and e == Cleared()


@pytest.mark.parametrize("medium, locality, tier", [
    ("GPU", None, Tier.G1), ("CPU", None, Tier.G2), ("STORAGE", None, Tier.G3), ("STORAGE", "LOCAL", Tier.G3),
    ("STORAGE", "REMOTE", Tier.G4), ("DISK", None, Tier.G3), (None, None, Tier.G1), ("gpu", None, Tier.G1),
    ("NVME", None, None), ("STORAGE", "ELSEWHERE", None),
])
def test_medium_to_tier(medium, locality, tier):
    assert tier_of(medium, locality) is tier


@pytest.mark.parametrize("message, match, seq", [
    (frames(0, [])[:2], "3 frames", None),
    ([b"t", b"\0" * 7, b""], "8 bytes", None),
    ([b"t", b"\0" * 8, b"\xc1"], "undecodable batch 0", 0),
    (frames(4, [stored([[1, 2]])]), "block hash must be bytes", 4),
    (frames(4, [stored([H[0]], block_size=0)]), "block_size must be an int >= 1", 4),
    (frames(4, [{"type": "BlockStored", "medium": "GPU"}]), "expected an array", 4),
    (frames(4, [42]), "map or a type-tagged array", 4),
    ([b"t", b"\0" * 8, msgpack.packb({"ts": 1})], r"\[ts, \[event", 0),
])
def test_bad_messages_are_decode_errors(message, match, seq):
    with pytest.raises(DecodeError, match=match) as e:
        decode_message(message)
    assert e.value.seq == seq  # known when readable: the index still counts the batch in sequence


def test_events_validate_their_fields():
    with pytest.raises(ValueError, match="group_idx"):
        BlockRemoved((H[0],), "GPU", group_idx=-1)
    with pytest.raises(ValueError, match="token_ids"):
        BlockStored((H[0],), None, 16, "GPU", token_ids=("a",))
    with pytest.raises(ValueError, match="seq"):
        EventBatch(-1, 0.0, ())


# ---- the index against a model ------------------------------------------------------------------

tiers = st.sampled_from(list(Tier))
hash_lists = st.lists(st.integers(0, 11), max_size=5)
ops = st.one_of(
    st.tuples(st.just("store"), tiers, hash_lists, st.booleans()),
    st.tuples(st.just("remove"), tiers, hash_lists, st.booleans()),
    st.tuples(st.just("clear"), st.just(Tier.G1), st.just([]), st.just(False)),
)


def _wire(op, tier, ids, array_form):
    hashes = [H[i] for i in ids]
    if op == "clear":
        return ["AllBlocksCleared"] if array_form else {"type": "AllBlocksCleared"}
    if array_form and tier is not Tier.G4:  # the array form has no locality: STORAGE is G3, DISK too
        medium = {Tier.G1: "GPU", Tier.G2: "CPU", Tier.G3: "DISK"}[tier]
        return ["BlockStored", hashes, None, [], 16, medium] if op == "store" else ["BlockRemoved", hashes, medium]
    return stored(hashes, tier) if op == "store" else removed(hashes, tier)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(ops, max_size=6), max_size=8))
def test_index_matches_a_dict_of_sets(batches):
    index = ResidencyIndex("r")
    model = {t: set() for t in Tier}
    stores = {t: 0 for t in Tier}
    dup = {t: 0 for t in Tier}
    unknown = {t: 0 for t in Tier}
    for seq, batch in enumerate(batches):
        for op, tier, ids, _ in batch:
            if op == "store":
                stores[tier] += len(ids)
                for i in ids:  # a hash twice in one event is a duplicate store too
                    dup[tier] += H[i] in model[tier]
                    model[tier].add(H[i])
            elif op == "remove":
                for i in ids:
                    unknown[tier] += H[i] not in model[tier]
                    model[tier].discard(H[i])
            else:
                model[Tier.G1].clear()
        feed(index, seq, [_wire(*o) for o in batch])
        counts = index.counts()
        for t in Tier:
            assert index.resident(t) == model[t]
            assert counts[t].hashes == counts[t].blocks == len(model[t])  # block_size 16 everywhere: 1 hash 1 block
            assert (counts[t].stores, counts[t].duplicate_stores, counts[t].unknown_removes) == \
                (stores[t], dup[t], unknown[t])
        assert set(index.links) == set().union(*model.values())
    assert index.state is (ViewState.LIVE if batches else ViewState.WAITING)
    assert index.complete == bool(batches)


def test_stores_are_idempotent_and_unknown_removes_counted():
    index = ResidencyIndex()
    feed(index, 0, [stored(H[:3]), stored(H[1:3])])
    feed(index, 1, [removed([H[0], H[9]])])
    c = index.counts()[Tier.G1]
    assert (c.hashes, c.stores, c.duplicate_stores, c.removes, c.unknown_removes) == (2, 5, 2, 2, 1)
    assert index.state is ViewState.LIVE


def test_chain_links_follow_the_events():
    index = ResidencyIndex()
    feed(index, 0, [stored(H[:3], parent=None), stored([H[3]], parent=H[2]), ["BlockStored", [H[3]], None, [], 64,
                                                                            "CPU"]])
    assert index.chain(H[3]) == [H[3], H[2], H[1], H[0]]  # the array-form G2 store kept H3's parent
    assert index.links[H[3]].tokens == 16
    feed(index, 1, [removed(H[:4])])
    assert set(index.links) == {H[3]}  # still in G2


# ---- staleness ------------------------------------------------------------------------------

def test_a_sequence_gap_marks_the_view_stale():
    index = ResidencyIndex("a")
    feed(index, 0, [stored(H[:2])])
    feed(index, 1, [stored([H[2]], Tier.G2)])
    assert index.state is ViewState.LIVE and index.complete
    feed(index, 4, [removed([H[0]])])
    assert index.state is ViewState.STALE and not index.complete
    assert (index.seq.gaps, index.seq.missed) == (1, 2)
    assert all(c.stale for c in index.counts().values())
    assert "gap before batch 4" in index.stale_reasons[0]
    feed(index, 5, [])
    assert index.seq.gaps == 1 and index.state is ViewState.STALE  # stays stale: the lost events stay lost


def test_joining_late_is_stale_and_a_reset_makes_g1_exact_again():
    index = ResidencyIndex()
    feed(index, 12, [stored(H[:2])])
    assert index.state is ViewState.STALE and "joined at batch 12" in index.stale_reasons[0]
    feed(index, 13, [{"type": "AllBlocksCleared"}])
    c = index.counts()
    assert not c[Tier.G1].stale and c[Tier.G1].hashes == 0 and c[Tier.G2].stale
    assert index.state is ViewState.STALE


def test_a_restarted_publisher_empties_the_memory_tiers():
    index = ResidencyIndex()
    feed(index, 0, [stored(H[:2]), stored(H[:2], Tier.G2), stored([H[5]], Tier.G3)])
    feed(index, 1, [])
    feed(index, 0, [stored([H[7]])])  # back to 0: a new process
    c = index.counts()
    assert index.resident(Tier.G1) == {H[7]} and not index.resident(Tier.G2)
    assert not c[Tier.G1].stale and not c[Tier.G2].stale and c[Tier.G3].stale and c[Tier.G4].stale
    assert index.resident(Tier.G3) == {H[5]} and index.seq.restarts == 1
    feed(index, 3, [])  # 1 and 2 of the new publisher lost
    assert index.counts()[Tier.G1].stale and index.seq.gaps == 1


def test_an_undecodable_message_is_stale_but_not_a_gap(caplog):
    fleet = FleetView(["a"])
    fleet.receive("a", frames(0, [stored(H[:1])]))
    with caplog.at_level(logging.WARNING, logger="kvtools.residency"):
        assert fleet.receive("a", [b"kv-events", (1).to_bytes(8, "big"), b"\xc1"]) is None
        fleet.receive("a", [b"kv-events", b"junk"])
    assert fleet.receive("a", frames(2, [])) is not None
    index = fleet["a"]
    assert index.malformed == 2 and index.seq.gaps == 0 and index.state is ViewState.STALE
    assert len([r for r in caplog.records if "undecodable" in r.message]) == 1  # logged once per replica
    fleet.check_integrity()


def test_unknown_media_and_other_groups_are_counted_not_applied(caplog):
    index = ResidencyIndex("r")
    with caplog.at_level(logging.WARNING, logger="kvtools.residency"):
        feed(index, 0, [{**stored([H[0]]), "medium": "NVME"}, {**stored([H[1]]), "medium": "NVME"},
                        stored([H[2]], group_idx=1), removed([H[2]], group_idx=1),
                        {"type": "Mystery"}])
    assert index.other_medium == {"NVME": 2} and index.other_group == 2 and index.unknown_events == 1
    assert all(not index.resident(t) for t in Tier)
    assert len([r for r in caplog.records if "NVME" in r.message]) == 1
    assert index.state is ViewState.LIVE  # nothing was lost: those events were just not residency


# ---- G1-granular counts and prefix depth ------------------------------------------------------

def test_offload_blocks_count_in_g1_blocks_in_both_forms():
    """kv_offload_block_size 64 over 16-token G1 blocks: a self-describing G2 store lists 4 G1
    hashes; the array form names the offload block by its last G1 hash with block_size 64."""
    new, old = ResidencyIndex(), ResidencyIndex()
    feed(new, 0, [stored(H[:8]), stored(H[:4], Tier.G2), stored(H[4:8], Tier.G2, parent=H[3])])
    feed(old, 0, [stored(H[:8]), ["BlockStored", [H[3]], None, [], 64, "CPU"],
                  ["BlockStored", [H[7]], None, [], 64, "CPU"]])
    for index in (new, old):
        c = index.counts()
        assert index.block_size == 16 and c[Tier.G2].blocks == 8 and c[Tier.G2].unit_tokens == 64
        assert index.prefix_depth(H[:10]) == {Tier.G1: 8, Tier.G2: 8, Tier.G3: 0, Tier.G4: 0}
    feed(new, 1, [removed(H[:4], Tier.G2)])
    feed(old, 1, [["BlockRemoved", [H[3]], "CPU"]])
    for index in (new, old):
        assert index.counts()[Tier.G2].blocks == 4
        assert index.prefix_depth(H[:8])[Tier.G2] == 0  # the first offload block is gone: no prefix there


def test_prefix_depth_stops_at_the_first_missing_block():
    index = ResidencyIndex()
    feed(index, 0, [stored([H[0], H[1], H[3]])])
    assert index.prefix_depth([H[0], H[1], H[2], H[3]])[Tier.G1] == 2
    assert index.prefix_depth([H[5], H[0]])[Tier.G1] == 0
    assert index.prefix_depth([]) == {t: 0 for t in Tier}
    fleet = FleetView(["a", "b"])
    fleet.receive("a", frames(0, [stored(H[:3])]))
    assert {n: d[Tier.G1] for n, d in fleet.prefix_depths(H[:4]).items()} == {"a": 3, "b": 0}


# ---- against /v1/kv/stats ---------------------------------------------------------------------

def _stats(g1_blocks=100, g2_blocks=2, g4_written=3) -> dict:
    return {"tiers": {"G1": {"num_blocks": g1_blocks, "free_blocks": 90},
                      "G2": {"backend": "host", "hit_tokens": 0, "blocks": g2_blocks},
                      "G3": {"backend": "disk", "hit_tokens": 0, "used_bytes": 4096},
                      "G4": {"backend": "redis", "hit_tokens": 0, "written_blocks": g4_written}}}


def test_counts_line_up_with_the_servers_stats():
    index = ResidencyIndex()
    feed(index, 0, [stored(H[:8]), stored(H[:4], Tier.G2), stored(H[4:8], Tier.G2, parent=H[3]),
                    stored(H[:4], Tier.G3)] + [stored(H[i:i + 4], Tier.G4) for i in (0, 4, 8)])
    checks = {c.tier: c for c in compare_with_stats(index, _stats())}
    assert (checks[Tier.G1].events, checks[Tier.G1].server, checks[Tier.G1].match) == (8, 100, True)
    assert (checks[Tier.G2].events, checks[Tier.G2].server, checks[Tier.G2].match) == (8, 8, True)  # 2 x 4
    assert checks[Tier.G3].server is None and checks[Tier.G3].match is None and "4096" in checks[Tier.G3].note
    assert (checks[Tier.G4].events, checks[Tier.G4].server, checks[Tier.G4].match) == (12, 12, True)
    bad = {c.tier: c for c in compare_with_stats(index, _stats(g1_blocks=4, g2_blocks=3, g4_written=2))}
    assert bad[Tier.G1].match is False and bad[Tier.G2].match is False and bad[Tier.G4].match is False
    # an explicit stack with Redis third: a batched tier is remote storage (G4) whatever its name
    [g4] = compare_with_stats(index, {"tiers": {"G3": {"backend": "redis", "hit_tokens": 0, "written_blocks": 3}}})
    assert (g4.tier, g4.match) == (Tier.G4, True)
    feed(index, 2, [])  # a gap: nothing is compared any more
    assert all(c.match is None for c in compare_with_stats(index, _stats()))


def test_g2_before_any_g2_event():
    index = ResidencyIndex()
    feed(index, 0, [stored(H[:2])])
    checks = {c.tier: c for c in compare_with_stats(index, _stats(g2_blocks=0))}
    assert checks[Tier.G2].match is True
    checks = {c.tier: c for c in compare_with_stats(index, _stats(g2_blocks=5))}
    assert checks[Tier.G2].server is None and "size unknown" in checks[Tier.G2].note


def test_importable_without_torch_or_zmq():
    """A router plugin may have only msgpack."""
    code = ("import sys; sys.modules['torch'] = None; sys.modules['zmq'] = None; "
            "import kvtools.residency as r; print(r.FleetView(['a']).to_dict()['a']['state'])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.strip() == "waiting"
