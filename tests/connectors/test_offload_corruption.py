"""Acceptance 3 (issue 3), engine level: G3 never serves corrupt KV.

Engine A fills G3 and closes. Then one entry file gets a flipped byte in its KV payload
(found only when read: the header is intact), one is truncated (torn), and two entries
have their files swapped between keys. Engine B, started on the same directory, must give
outputs identical to offload off, count every bad entry in `tiers["G3"]["corrupt"]`, remove
the bad files, and serve everything before the first bad block of each prompt.

Control: the same flipped byte, with the entry's checksum re-sealed so that it can no
longer be detected, changes the outputs: the damage is one that would be visible if served.
(The SIGKILL crash case is covered at backend level in tests/kvstore/test_disk_faults.py.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvstore.disk import HEADER_SIZE, encode_header
from kvstore.keys import chain_keys
from offload_helpers import (
    OB,
    check_integrity,
    hit_tokens,
    load_kinds,
    offload_llm,
    reference,
    run,
    tokens,
    workload,
)

PROMPTS = workload()  # 300, 520, 641 tokens: 4, 8 and 10 reusable offload blocks
BLOCK = 16
FLIP_AT = (0, 1)  # (prompt, offload block): a flipped payload byte
TRUNCATE_AT = (1, 3)  # a truncated file
SWAP_AT = ((2, 2), (2, 6))  # two entries whose files are swapped


# One entry per G3 file (g3_io_mib below one block), as these tests damage single entries by their
# files (tests/connectors/test_offload_files.py covers files holding runs of blocks).
PER_ENTRY_FILES = {"kv_transfer_config": {"kv_connector_extra_config": {"g3_io_mib": 1e-4}}}


@pytest.fixture(scope="module")
def ref(model_dir):
    return reference(model_dir, PROMPTS)


def entry_path(disk: Path, prompt: list[int], chunk: int) -> Path:
    key = chain_keys(prompt, BLOCK)[(chunk + 1) * (OB // BLOCK) - 1]
    (ns,) = [d for d in disk.iterdir() if d.is_dir()]
    return ns / key.hex()[:2] / f"{key.hex()}.kvb"


def fill(model_dir, disk: Path, ref) -> None:
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), **PER_ENTRY_FILES)
    try:
        assert tokens(run(llm, PROMPTS)) == ref
    finally:
        llm.close()
    for p in PROMPTS:  # every reusable block of every prompt is on disk
        for j in range(hit_tokens(len(p)) // OB):
            assert entry_path(disk, p, j).is_file()


def flip_kv_byte(path: Path, reseal: bool = False) -> None:
    """Flip the top exponent bit of one float32 in the KV payload (past both headers: the
    disk entry header and the encoded block's header): a value of magnitude below 2, as
    K and V values here are, becomes 2^128 times larger (or inf)."""
    from connectors.codec import HEADER_BYTES

    raw = bytearray(path.read_bytes())
    at = HEADER_SIZE + HEADER_BYTES + 4 * 1000 + 3
    raw[at] ^= 0x40
    if reseal:  # a valid entry again: header checksum over the damaged payload
        head = raw[:HEADER_SIZE]
        ns, key = bytes(head[12:28]), bytes(head[28:44])
        raw[:HEADER_SIZE] = encode_header(ns, key, memoryview(raw)[HEADER_SIZE:])
    path.write_bytes(bytes(raw))


def test_corrupt_truncated_and_swapped_entries_are_never_served(model_dir, ref, tmp_path, caplog):
    disk = tmp_path / "g3"
    fill(model_dir, disk, ref)
    flipped = entry_path(disk, PROMPTS[FLIP_AT[0]], FLIP_AT[1])
    flip_kv_byte(flipped)
    truncated = entry_path(disk, PROMPTS[TRUNCATE_AT[0]], TRUNCATE_AT[1])
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    s1, s2 = (entry_path(disk, PROMPTS[p], j) for p, j in SWAP_AT)
    b1, b2 = s1.read_bytes(), s2.read_bytes()
    s1.write_bytes(b2)
    s2.write_bytes(b1)
    damaged = {p: p.read_bytes() for p in (flipped, truncated, s1, s2)}

    caplog.set_level(logging.WARNING)
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), **PER_ENTRY_FILES)
    try:
        # start-up found the torn file and the swapped pair (their headers name other keys);
        # the flipped payload passes the header checks and is only caught when read
        assert llm.engine.connector.tier("G3").backend.stats.corrupt == 3
        outs = run(llm, PROMPTS)
        assert tokens(outs) == ref
        # each prompt is served up to its first bad block, the rest is recomputed
        assert load_kinds(outs) == [{"G3": FLIP_AT[1] * OB}, {"G3": TRUNCATE_AT[1] * OB}, {"G3": SWAP_AT[0][1] * OB}]
        tiers = llm.get_stats().tiers
        assert tiers["G3"]["corrupt"] == 4
        assert tiers["load_failures"] == 1  # the flipped block, found only when read
        llm.engine.connector.flush()
        for bad, data in damaged.items():  # removed; or re-written from the recomputed KV
            assert not bad.exists() or bad.read_bytes() != data, f"bad entry {bad.name} is still on disk"
        for bad in damaged:  # a log line names every bad file
            assert any(bad.name in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING), bad
        check_integrity(llm)
    finally:
        llm.close()
    # the recomputed blocks were written back: a third engine is served every block again
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), **PER_ENTRY_FILES)
    try:
        outs = run(llm, PROMPTS)
        assert tokens(outs) == ref
        assert load_kinds(outs) == [{"G3": hit_tokens(len(p))} for p in PROMPTS]
        assert llm.get_stats().tiers["G3"]["corrupt"] == 0
        check_integrity(llm)
    finally:
        llm.close()


def test_control_resealed_damage_would_change_the_outputs(model_dir, ref, tmp_path):
    """With the checksum re-sealed over the damaged payload, G3 cannot tell, serves the
    block, and the tokens differ from offload off: the check above can fail."""
    disk = tmp_path / "g3"
    fill(model_dir, disk, ref)
    flip_kv_byte(entry_path(disk, PROMPTS[FLIP_AT[0]], FLIP_AT[1]), reseal=True)
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), **PER_ENTRY_FILES)
    try:
        outs = run(llm, PROMPTS[:1])
        assert load_kinds(outs) == [{"G3": hit_tokens(len(PROMPTS[0]))}]  # served in full
        assert llm.get_stats().tiers["G3"]["corrupt"] == 0
        assert tokens(outs) != ref[:1]
    finally:
        llm.close()


def test_failed_load_is_not_counted_as_tier_hits(model_dir, ref, tmp_path):
    """G3 hit_tokens must equal the tokens G3 actually supplied to requests."""
    disk = tmp_path / "g3"
    fill(model_dir, disk, ref)
    flip_kv_byte(entry_path(disk, PROMPTS[0], 2))  # blocks 0 and 1 load, block 2 fails
    llm = offload_llm(model_dir, kv_offload_disk=str(disk), **PER_ENTRY_FILES)
    try:
        outs = run(llm, PROMPTS[:1])
        assert tokens(outs) == ref[:1]
        served = sum(k.get("G3", 0) for k in load_kinds(outs))
        assert llm.get_stats().tiers["G3"]["hit_tokens"] == served
    finally:
        llm.close()
